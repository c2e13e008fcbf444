"""The one loader for every shared library tvm_mamba maps from its kernel cache or a kernel pack.

Mapping a library runs its constructors, and a truncated one faults (SIGBUS) when a page past its end is
touched, so a file is mapped only once its bytes match a sha256 recorded when it was written:

- a cache file (kernels, the OpenMP launcher): a stamp beside it, ``<name>.sha256``, JSON
  ``{"sha256": ..., **facts}``, where the facts say what it was built for (a kernel's key and plan, the
  launcher's source), so a file copied over another one does not verify either. ``write()`` writes both
  atomically (temp file + rename, the library first, then its stamp).
- a pack file: the sha256 its manifest lists (runtime/pack.py).

What this protects against: corruption, truncation, a crash mid-write, a file built for another key.
What it does not: anyone who can write the folder, who can write a matching stamp (or manifest) too.
That is what cache_dir's ownership and mode checks are for (docs/design.md, "Trust").
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import stat
import tempfile
import threading
from typing import Any, Callable

from . import cache_dir


class BadLibrary(RuntimeError):
    """A library that was not mapped: ``path`` and ``why`` (missing, wrong bytes, no stamp, failed load)."""

    def __init__(self, path: pathlib.Path, why: str):
        super().__init__(f"tvm_mamba: {path}: {why}")
        self.path, self.why = path, why


def stamp_path(path: pathlib.Path) -> pathlib.Path:
    return path.with_name(path.name + ".sha256")


def _read(path: pathlib.Path, private: bool) -> bytes:
    """The file's bytes (a regular file; with ``private``, it and its folder trusted: see cache_dir)."""
    if private:
        cache_dir.require_trusted(path.parent)
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise BadLibrary(path, "not a regular file")
            if private:
                cache_dir.require_trusted(path, "kernel cache file", st=st)
            return f.read()
    except OSError as err:
        if isinstance(err, cache_dir.UntrustedPath):
            raise
        raise BadLibrary(path, f"unreadable ({err.strerror or err})") from None


def _stamp_problem(path: pathlib.Path, digest: str, facts: dict) -> str | None:
    try:
        stamp = json.loads(stamp_path(path).read_text())
    except (OSError, ValueError):
        return "it has no readable stamp"
    if not isinstance(stamp, dict) or stamp.get("sha256") != digest:
        return "its bytes do not match the stamp written with it"
    if stamp != {"sha256": digest, **facts}:
        return "its stamp names another build"
    return None


def verify(path: pathlib.Path, *, facts: dict | None = None, sha256: str | None = None,
           private: bool = True) -> None:
    """Raise BadLibrary unless the file's bytes match its stamp, which must also carry ``facts`` (cache
    files), or ``sha256`` (pack files, whose manifest gives it). ``private``: the file and its folder must be
    trusted (cache_dir.require_trusted, which raises UntrustedPath; packs are named by the user, like
    PYTHONPATH, and not checked)."""
    digest = hashlib.sha256(_read(path, private)).hexdigest()
    if sha256 is not None:
        why = None if digest == sha256 else f"its sha256 {digest[:12]}... is not the {sha256[:12]}... listed"
    else:
        why = _stamp_problem(path, digest, facts or {})
    if why:
        raise BadLibrary(path, why)


def load(path: pathlib.Path, mapper: Callable[[pathlib.Path], Any], *, facts: dict | None = None,
         sha256: str | None = None, private: bool = True) -> Any:
    """``mapper(path)`` (the one place a library is mapped) once it verifies (see verify); BadLibrary if it
    does not (nothing mapped) or the mapper fails; cache_dir.UntrustedPath for an untrusted cache file.
    Between the check and the mapping the file could be replaced by whoever can write its folder: the
    trust checks, not the digest, keep others out."""
    path = pathlib.Path(path)
    verify(path, facts=facts, sha256=sha256, private=private)
    try:
        return mapper(path)
    except (BadLibrary, cache_dir.UntrustedPath):  # another library the mapper loads (the launcher): as is
        raise
    except Exception as err:  # noqa: BLE001 - a library that verifies but does not load is a bad file too
        msg = str(err).strip().splitlines()[-1][:160] if str(err).strip() else ""
        raise BadLibrary(path, f"{type(err).__name__}: {msg}") from err


def _atomic(path: pathlib.Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a 0600 temp file in the same folder and a rename."""
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{os.getpid()}-{threading.get_ident()}-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write(path: pathlib.Path, data: bytes, facts: dict) -> None:
    """Write the library ``data`` to ``path`` and then its stamp, each atomically: a reader sees the old file,
    or the new file with no stamp or the old stamp (not verified: it takes the build lock and re-checks), or
    both new. Raises FileNotFoundError if the folder is removed meanwhile (the caller recreates it)."""
    _atomic(path, data)
    stamp = {"sha256": hashlib.sha256(data).hexdigest(), **facts}
    _atomic(stamp_path(path), json.dumps(stamp).encode())


def discard(path: pathlib.Path) -> None:
    """Remove a library and its stamp (missing ones are fine)."""
    for p in (path, stamp_path(path)):
        p.unlink(missing_ok=True)
