"""AOT kernel packs: kernels built on a build host, run where only the TVM runtime is installed.

``python -m tvm_mamba aot --target cuda --arch sm_90 --out DIR`` (or ``--target cpu``) builds every kernel
configuration (each op's build_check_configs / tuning_configs, with the plan dispatch picks for each shape
bucket: tuned record or hand default) and exports one ``.so`` per distinct (workload, plan), plus
``manifest.json``::

    {"format": 2, "target": "cuda-sm_90", "tvm": ..., "tvm_ffi": ...,
     "entries": [{"key": KernelKey json (with bucket), "file": "...so", "plan": "default" | "tuned: ...",
                  "sha256": the file's digest}]}

A file is mapped only if its bytes match the listed sha256 (runtime/verified.py); a file that does not is
refused with an error naming it (a pack is not rebuilt in place). A manifest that does not have this
structure is refused with ``BadManifest`` naming the file and what is wrong (``read_manifest``). Format 1
(no digests) is refused with the command that rebuilds the pack.

With ``TVM_MAMBA_KERNEL_PACK=DIR``, build_and_load serves a key from the pack (nearest bucket of the same
workload) before building anything; with ``TVM_USE_RUNTIME_LIB=1`` (no compiler on the machine) that is
the only way in, and a key the pack lacks is a clear error naming the key and the command that builds it.

CUDA cubins are made here with no GPU: TVM's CUDA sidecar needs a ``libcuda.so.1`` to load, so the aot
command re-runs itself with a stub driver (every entry point returns CUDA_ERROR_NO_DEVICE; it is only
dlopen'ed, never used to run anything) and ``TVM_CUDA_COMPILE_MODE=nvcc``.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import pathlib
import subprocess
import tempfile

import tvm
import tvm_ffi

from . import records
from .key import KernelKey, bucket_distance

ENV = "TVM_MAMBA_KERNEL_PACK"
MANIFEST = "manifest.json"
FORMAT = 2  # 2: every entry lists its file's sha256

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


class BadManifest(ValueError):
    """A kernel pack's manifest.json that is missing, not JSON, or not of the structure above."""


def _entry_problem(e) -> str | None:
    """Why one manifest entry is not {"key": KernelKey json, "file": a file name in the pack, "plan": str,
    "sha256": 64 hex digits} (None if it is)."""
    if not isinstance(e, dict):
        return f"is {type(e).__name__}, not an object"
    missing = [f for f in ("key", "file", "plan", "sha256") if f not in e]
    if missing:
        return f"has no {', '.join(repr(f) for f in missing)}"
    why = records.key_problem(e["key"])
    if why:
        return why
    file = e["file"]
    if not isinstance(file, str) or not file or file != os.path.basename(file) or file in (".", ".."):
        return f"file {file!r} is not a file name inside the pack"
    if not isinstance(e["plan"], str):
        return "plan is not a string"
    sha = e["sha256"]
    if not (isinstance(sha, str) and len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)):
        return "sha256 is not 64 lowercase hex digits"
    return None


def read_manifest(folder: pathlib.Path) -> dict:
    """The pack's manifest, its structure checked; BadManifest naming the file and what is wrong otherwise."""
    path = pathlib.Path(folder) / MANIFEST
    text, why = records.read_text(path)
    data, why = (None, why) if text is None else records.parse_json(text, limit=records.MAX_FILE_BYTES)
    if why is None and not isinstance(data, dict):
        why = f"the top level is {type(data).__name__}, not an object"
    if why is None and data.get("format") != FORMAT:
        why = (f"format {data.get('format')!r}, expected {FORMAT}" +
               (" (a pack made before file digests: rebuild it with `python -m tvm_mamba aot`)"
                if data.get("format") == 1 else ""))
    if why is None and not isinstance(data.get("target"), str):
        why = "target is not a string"
    if why is None and not isinstance(data.get("entries"), list):
        why = "entries is not a list"
    for i, e in enumerate(data["entries"] if why is None else ()):
        problem = _entry_problem(e)
        if problem:
            why = f"entries[{i}] {problem}"
            break
    if why:
        raise BadManifest(f"kernel pack manifest {path}: {why}")
    return data


class Pack:
    def __init__(self, folder: str | os.PathLike):
        self.folder = pathlib.Path(folder)
        data = read_manifest(self.folder)
        self.target = data["target"]
        self.entries: dict[KernelKey, list[tuple[dict, str, str, str]]] = {}
        for e in data["entries"]:
            key = KernelKey.from_json(e["key"])
            self.entries.setdefault(key.workload(), []).append(
                (dict(key.shape_bucket), e["file"], e["plan"], e["sha256"]))

    def find(self, key: KernelKey) -> tuple[pathlib.Path, str, str] | None:
        """(file, plan, sha256) of the nearest bucket of ``key``'s workload, or None."""
        cands = self.entries.get(key.workload())
        if not cands:
            return None
        want = dict(key.shape_bucket)
        _, file, plan, sha256 = min(cands, key=lambda c: bucket_distance(want, c[0]))
        return self.folder / file, plan, sha256


@functools.lru_cache(maxsize=8)
def _open(folder: str) -> Pack:
    return Pack(folder)


def active_pack() -> Pack | None:
    folder = os.environ.get(ENV)
    return _open(folder) if folder else None


def write_manifest(folder: pathlib.Path, target_key: str, entries: list[dict]) -> None:
    """Write ``folder``'s manifest.json, each entry with its file's sha256 added (files are hashed once)."""
    digests: dict[str, str] = {}
    for e in entries:
        if e["file"] not in digests:
            digests[e["file"]] = hashlib.sha256((folder / e["file"]).read_bytes()).hexdigest()
    data = {"format": FORMAT, "target": target_key, "tvm": tvm.__version__, "tvm_ffi": tvm_ffi.__version__,
            "entries": [dict(e, sha256=digests[e["file"]]) for e in entries]}
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, folder / MANIFEST)
