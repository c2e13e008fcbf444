"""AOT kernel packs: kernels built on a build host, run where only the TVM runtime is installed.

``python -m tvm_mamba aot --target cuda --arch sm_90 --out DIR`` (or ``--target cpu``) builds every kernel
configuration (each op's build_check_configs / tuning_configs, with the plan dispatch picks for each shape
bucket: tuned record or hand default) and exports one ``.so`` per distinct (workload, plan), plus
``manifest.json``::

    {"format": 1, "target": "cuda-sm_90", "tvm": ..., "tvm_ffi": ...,
     "entries": [{"key": KernelKey json (with bucket), "file": "...so", "plan": "default" | "tuned: ..."}]}

With ``TVM_MAMBA_KERNEL_PACK=DIR``, build_and_load serves a key from the pack (nearest bucket of the same
workload) before building anything; with ``TVM_USE_RUNTIME_LIB=1`` (no compiler on the machine) that is
the only way in, and a key the pack lacks is a clear error naming the key and the command that builds it.

CUDA cubins are made here with no GPU: TVM's CUDA sidecar needs a ``libcuda.so.1`` to load, so the aot
command re-runs itself with a stub driver (every entry point returns CUDA_ERROR_NO_DEVICE; it is only
dlopen'ed, never used to run anything) and ``TVM_CUDA_COMPILE_MODE=nvcc``.
"""
from __future__ import annotations

import functools
import json
import os
import pathlib
import subprocess
import tempfile

import tvm
import tvm_ffi

from .key import KernelKey, bucket_distance

ENV = "TVM_MAMBA_KERNEL_PACK"
MANIFEST = "manifest.json"

_STUB_SYMBOLS = ("cuDeviceGetName", "cuFuncSetAttribute", "cuGetErrorName", "cuGetErrorString", "cuLaunchKernelEx",
                 "cuModuleGetFunction", "cuModuleLoadData", "cuModuleUnload", "cuTensorMapEncodeTiled")


def runtime_only() -> bool:
    import tvm.base

    return bool(getattr(tvm.base, "_RUNTIME_ONLY", False))


@functools.lru_cache(maxsize=None)
def load_cuda_runtime() -> bool:
    """Register TVM's CUDA module loader (the sidecar library); TVM skips it in runtime-only mode."""
    import tvm_ffi.libinfo
    from tvm.base import _LOADED_LIBS

    if tvm_ffi.get_global_func("ffi.Module.load_from_bytes.cuda", allow_missing=True) is not None:
        return True
    lib_dir = pathlib.Path(_LOADED_LIBS["tvm_runtime"]._name).resolve().parent
    try:
        _LOADED_LIBS["tvm_runtime_cuda"] = tvm_ffi.libinfo.load_lib_ctypes(
            package="tvm", target_name="tvm_runtime_cuda", extra_lib_paths=[lib_dir], mode="RTLD_LOCAL")
    except (OSError, FileNotFoundError, RuntimeError):
        return False
    return True


def make_stub_driver(folder: pathlib.Path) -> pathlib.Path:
    """Write and compile the libcuda.so.1 stub into ``folder`` (for building only)."""
    folder.mkdir(parents=True, exist_ok=True)
    src = folder / "cuda_stub.c"
    src.write_text("".join(f"int {name}(void) {{ return 100; }}\n" for name in _STUB_SYMBOLS))
    out = folder / "libcuda.so.1"
    subprocess.run([os.environ.get("CC", "gcc"), "-shared", "-fPIC", "-o", str(out), str(src)], check=True)
    return out


class Pack:
    def __init__(self, folder: str | os.PathLike):
        self.folder = pathlib.Path(folder)
        data = json.loads((self.folder / MANIFEST).read_text())
        if data.get("format") != 1:
            raise ValueError(f"{self.folder / MANIFEST}: unknown pack format {data.get('format')!r}")
        self.target = data["target"]
        self.entries: dict[KernelKey, list[tuple[dict, str, str]]] = {}
        for e in data["entries"]:
            key = KernelKey.from_json(e["key"])
            self.entries.setdefault(key.workload(), []).append((dict(key.shape_bucket), e["file"], e["plan"]))

    def find(self, key: KernelKey) -> tuple[pathlib.Path, str] | None:
        cands = self.entries.get(key.workload())
        if not cands:
            return None
        want = dict(key.shape_bucket)
        _, file, plan = min(cands, key=lambda c: bucket_distance(want, c[0]))
        return self.folder / file, plan


@functools.lru_cache(maxsize=8)
def _open(folder: str) -> Pack:
    return Pack(folder)


def active_pack() -> Pack | None:
    folder = os.environ.get(ENV)
    return _open(folder) if folder else None


def write_manifest(folder: pathlib.Path, target_key: str, entries: list[dict]) -> None:
    data = {"format": 1, "target": target_key, "tvm": tvm.__version__, "tvm_ffi": tvm_ffi.__version__,
            "entries": entries}
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, folder / MANIFEST)
