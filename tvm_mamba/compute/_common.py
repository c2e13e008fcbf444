"""Helpers shared by the compute builders (no torch)."""
from __future__ import annotations

import dataclasses
import functools
import importlib
import pathlib
from typing import Any, Mapping

from tvm import tirx

FLOAT_DTYPES = ("float32", "float16", "bfloat16")


def stamp(func: tirx.PrimFunc, kernel: str) -> tirx.PrimFunc:
    """Name the PrimFunc after its kernel (its symbol in the compiled library) and declare its buffers
    unaliased (the kernels' inputs and outputs never overlap: the torch ops copy an output that would)."""
    return func.with_attrs({"global_symbol": kernel, "tirx.noalias": True, "tvm_mamba.kernel": kernel})


def check_dtype(name: str, dtype: str, allowed=FLOAT_DTYPES) -> str:
    if dtype not in allowed:
        raise ValueError(f"{name}: dtype must be one of {allowed}, got {dtype!r}")
    return dtype


def f32(expr) -> tirx.PrimExpr:
    """Widen to float32 (a float32 -> float32 cast folds away)."""
    return expr.astype("float32")


# Kernels whose whole work is at most this many elements run on the calling thread (decode-size calls): a
# thread-pool launch costs more than the work, and next to torch's spinning OpenMP threads a pinned TVM
# worker could wait a scheduler slice per launch (the small LM's decode: 920-940 ms instead of ~80 ms in 2
# of 5 processes). CPU templates test it at run time against their symbolic sizes.
SERIAL_WORK = 1 << 15


OMIT_DEFAULT = {"omit_default": True}


@dataclasses.dataclass(frozen=True)
class Dims:
    """Base of the typed static dims of one op: a frozen dataclass of model dims, flags and dtypes
    (fields named ``<tensor>_dtype``) that flows from the torch op to the KernelKey, the compute builder
    and the schedule rule, instead of the same keyword list repeated in every signature.

    The KernelKey keeps its two plain maps (``static_dims``, ``dtypes``: tuning records and cache paths
    derive from them, so their format does not change): ``key_parts`` splits a Dims into them and
    ``from_key`` rebuilds it. A subclass lists its fields with defaults and validates in ``__post_init__``;
    a field declared ``dataclasses.field(default=..., metadata=OMIT_DEFAULT)`` is left out of the key at
    its default, so keys (and tuning records) made before the field existed still match.
    """

    def key_parts(self) -> tuple[dict[str, Any], dict[str, str]]:
        """(static_dims, dtypes) as the KernelKey holds them: ``u_dtype`` -> dtypes["u"]."""
        static, dtypes = {}, {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.metadata.get("omit_default") and value == f.default:
                continue  # a field added after records were made: its default keeps the old key
            if f.name.endswith("_dtype"):
                dtypes[f.name[:-len("_dtype")]] = value
            else:
                static[f.name] = value
        return static, dtypes

    def static(self) -> dict[str, Any]:
        """Every field by name (a builder's keyword form: ``builder(**dims.static())`` is ``builder(dims)``)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_key(cls, static_dims: Mapping[str, Any], dtypes: Mapping[str, str]):
        """The Dims of a KernelKey's maps (unknown names are a TypeError: a key of another op)."""
        return cls(**dict(static_dims), **{f"{k}_dtype": v for k, v in dtypes.items()})

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)

    @classmethod
    def of(cls, *args, **fields):
        """The dims a builder is called with: ``builder(dims)`` passes an instance through; the field form
        ``builder(dim, width, ...)`` / ``builder(dim=..., ...)`` (tests, scripts) makes one."""
        if len(args) == 1 and not fields and isinstance(args[0], cls):
            return args[0]
        return cls(*args, **fields)

    @classmethod
    def cached(cls, *args, **fields):
        """``cls(*args, **fields)``, memoized: a torch op makes dims on every kernel call, and a frozen
        dataclass's __init__ plus validation costs several microseconds, a lookup about one."""
        return _cached_dims(cls, args, tuple(fields.items()))


@functools.lru_cache(maxsize=4096)
def _cached_dims(cls, args: tuple, fields: tuple) -> Dims:
    return cls(*args, **dict(fields))


def lazy_names(package: str, init_file: str):
    """The ``__getattr__`` of an op package whose definitions write TVMScript (the scans, SSD, Mamba-3): the
    op's names from its ``dims.py`` (typed dims: no TVMScript) or else its ``kernels.py`` (the builders, the
    templates, ``KERNELS`` / ``DIMS`` / ``TEMPLATES``, the configs), each imported on first use. The torch op
    keys its kernels with the dims on a runtime-only TVM (an AOT pack on a GPU machine), which cannot import
    TVMScript. A submodule's own name is left to the import system."""
    folder = pathlib.Path(init_file).parent

    def getattr_(name: str):
        if name.startswith("__") or (folder / f"{name}.py").exists():
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        for part in ("dims", "kernels"):
            module = importlib.import_module(f"{package}.{part}")
            if name in vars(module):
                return vars(module)[name]
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return getattr_
