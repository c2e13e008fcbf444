"""Where the kernel cache lives (``cache_root()``): kept apart from ``cache.py`` so that ``tuning`` (which
memoizes its record checks there) does not import the build path, which imports dispatch, which calls tuning.

``$TVM_MAMBA_CACHE_DIR`` (default ``$XDG_CACHE_HOME/tvm_mamba`` or ``~/.cache/tvm_mamba``), then a folder
named by the package, TVM and tvm-ffi versions and a digest of the package's compute/schedule/runtime
sources, so an edited kernel never loads a stale binary.
"""
from __future__ import annotations

import functools
import hashlib
import os
import pathlib
import tempfile
import warnings

import tvm
import tvm_ffi

_PKG_ROOT = pathlib.Path(__file__).resolve().parent.parent


@functools.lru_cache(maxsize=None)
def _source_digest() -> str:
    h = hashlib.sha256()
    for sub in ("compute", "schedules", "runtime"):
        root = _PKG_ROOT / sub
        if not root.exists():  # editable layouts map schedules/ elsewhere
            import importlib

            root = pathlib.Path(importlib.import_module(f"tvm_mamba.{sub}").__path__[0])
        files = list(root.rglob("*.py")) + [f for f in (root / "cudasim_include").rglob("*") if f.is_file()]
        for f in sorted(files):  # cudasim_include: the CUDA execution header the simulated kernels build with
            h.update(f.name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:12]


def cache_base() -> pathlib.Path:
    """``$TVM_MAMBA_CACHE_DIR``, else ``$XDG_CACHE_HOME/tvm_mamba``, else ``~/.cache/tvm_mamba``."""
    base = os.environ.get("TVM_MAMBA_CACHE_DIR")
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        base = os.path.join(xdg, "tvm_mamba")
    return pathlib.Path(base)


_fallback: dict[str, pathlib.Path] = {}


def _usable(folder: pathlib.Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(folder, os.W_OK | os.X_OK)


def cache_root() -> pathlib.Path:
    """This package version's folder in the cache. An unusable cache directory (not creatable, not a
    directory, read-only) is replaced, with one warning naming it, by a temporary folder for this process."""
    from .. import __version__

    versions = f"tvm_mamba-{__version__}_tvm-{tvm.__version__}_ffi-{tvm_ffi.__version__}_src-{_source_digest()}"
    base = cache_base()
    if str(base) in _fallback:
        return _fallback[str(base)] / versions
    root = base / versions
    if not _usable(root):
        tmp = pathlib.Path(tempfile.mkdtemp(prefix="tvm_mamba_cache_"))
        _fallback[str(base)] = tmp
        warnings.warn(f"tvm_mamba: the kernel cache directory {base} is not usable (set TVM_MAMBA_CACHE_DIR to a "
                      f"writable folder); building into {tmp} for this process only", RuntimeWarning, stacklevel=3)
        return tmp / versions
    return root
