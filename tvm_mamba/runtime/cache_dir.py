"""Where the kernel cache lives (``cache_root()``) and whom it trusts: kept apart from ``cache.py`` so that
``tuning`` (which memoizes its record checks there) does not import the build path, which imports dispatch,
which calls tuning.

``$TVM_MAMBA_CACHE_DIR`` (default ``$XDG_CACHE_HOME/tvm_mamba`` or ``~/.cache/tvm_mamba``), then a folder
named by the package, TVM and tvm-ffi versions and a digest of the package's compute/schedule/runtime
sources, so an edited kernel never loads a stale binary.

Trust (as ssh's StrictModes): the cache holds shared libraries this process maps and runs, so whoever can
write it can run code as the user. Folders are created 0700 and files 0600; a cache or tuning folder, or a
file loaded from one, that is owned by another user (root excepted: root can replace the package itself) or
writable by group/others is refused with ``UntrustedPath`` naming it and the fix. ``TVM_MAMBA_SHARED_CACHE=
readonly`` opts in to a cache someone else owns: it is read only (what verifies is loaded, nothing is
written there) and builds go to a private temporary folder (``build_root()``).
"""
from __future__ import annotations

import functools
import hashlib
import os
import pathlib
import stat
import tempfile
import warnings

import tvm
import tvm_ffi

_PKG_ROOT = pathlib.Path(__file__).resolve().parent.parent


@functools.lru_cache(maxsize=None)
def _source_digest() -> str:
    h = hashlib.sha256()
    for sub in ("compute", "schedules", "runtime"):
        root = _PKG_ROOT / sub  # schedules: the link to the repository's schedules/ (or its copy in a wheel)
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


SHARED_ENV = "TVM_MAMBA_SHARED_CACHE"  # "readonly": use a cache you do not own, reading only


def shared_readonly() -> bool:
    """True when $TVM_MAMBA_SHARED_CACHE=readonly: the cache is read only and ownership is not checked."""
    value = os.environ.get(SHARED_ENV, "").strip().lower()
    if value not in ("", "readonly"):
        raise ValueError(f"{SHARED_ENV}: expected 'readonly' (or unset), got {value!r}")
    return value == "readonly"


class UntrustedPath(PermissionError):
    """A cache or tuning folder (or a file loaded from one) another user could have written."""


def trust_problem(st: os.stat_result) -> str | None:
    """Why a file or folder with this stat is not trusted (None if it is): owned by another user than this
    one or root, or writable by group or others. A symlink is judged by what it points to (os.stat)."""
    uid = os.geteuid()
    if st.st_uid not in (uid, 0):
        return f"it is owned by uid {st.st_uid}, not by you (uid {uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"it is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def require_trusted(path: pathlib.Path, what: str = "kernel cache directory", env: str = "TVM_MAMBA_CACHE_DIR",
                    st: os.stat_result | None = None) -> None:
    """Raise UntrustedPath naming ``path`` (a ``what``, placed by ``env``) and the fix unless it is trusted
    (see trust_problem); a missing path passes (nothing to load from it). Skipped under
    $TVM_MAMBA_SHARED_CACHE=readonly."""
    if shared_readonly():
        return
    try:
        st = st or os.stat(path)
    except (FileNotFoundError, NotADirectoryError):  # nothing there (an unusable folder: see cache_root)
        return
    why = trust_problem(st)
    if why:
        fix = "chmod go-w" if "writable" in why else "chown $USER"
        raise UntrustedPath(
            f"tvm_mamba: refusing the {what} {path}: {why}, so another user could place code there that this "
            f"process would run. Fix: `{fix} {path}`, or set {env} to a folder of your own, or set "
            f"{SHARED_ENV}=readonly to read it without writing (trusting whoever can write it)")


def private_mkdir(folder: pathlib.Path) -> None:
    """Create ``folder`` and its missing parents with mode 0700 (as XDG asks of cache folders); existing
    folders keep their mode."""
    missing = []
    while not folder.exists():
        missing.append(folder)
        if folder.parent == folder:
            break
        folder = folder.parent
    for f in reversed(missing):
        try:
            os.mkdir(f, 0o700)
        except FileExistsError:  # another process made it first (then it is judged by require_trusted)
            pass


_fallback: dict[str, pathlib.Path] = {}
_private: dict[str, pathlib.Path] = {}


def _usable(folder: pathlib.Path) -> bool:
    try:
        private_mkdir(folder)
    except OSError:
        return False
    return folder.is_dir() and os.access(folder, os.W_OK | os.X_OK)


def _versions() -> str:
    from .. import __version__

    return f"tvm_mamba-{__version__}_tvm-{tvm.__version__}_ffi-{tvm_ffi.__version__}_src-{_source_digest()}"


def cache_root() -> pathlib.Path:
    """This package version's folder in the cache, the one kernels are read from. An untrusted folder raises
    UntrustedPath; an unusable one (not creatable, not a directory, read-only) is replaced, with one warning
    naming it, by a temporary folder for this process. Under $TVM_MAMBA_SHARED_CACHE=readonly it is
    neither checked nor created (build_root() is where this process writes)."""
    versions, base = _versions(), cache_base()
    if str(base) in _fallback:
        return _fallback[str(base)] / versions
    root = base / versions
    if shared_readonly():
        return root
    require_trusted(base)  # before creating anything inside it
    if not _usable(root):
        tmp = pathlib.Path(tempfile.mkdtemp(prefix="tvm_mamba_cache_"))
        _fallback[str(base)] = tmp
        warnings.warn(f"tvm_mamba: the kernel cache directory {base} is not usable (set TVM_MAMBA_CACHE_DIR to a "
                      f"writable folder); building into {tmp} for this process only", RuntimeWarning, stacklevel=3)
        return tmp / versions
    require_trusted(root)
    return root


def build_root() -> pathlib.Path:
    """Where this process writes kernels: cache_root(), or under $TVM_MAMBA_SHARED_CACHE=readonly a private
    temporary folder (0700, one per process and cache)."""
    root = cache_root()
    if not shared_readonly():
        return root
    tmp = _private.get(str(root))
    if tmp is None:
        tmp = _private[str(root)] = pathlib.Path(tempfile.mkdtemp(prefix="tvm_mamba_private_"))
    return tmp / root.name
