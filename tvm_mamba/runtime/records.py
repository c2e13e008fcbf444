"""Tuning-log files read as data: never block on a special file, never trust a field's type.

A log folder is written by our tuner, but it is read on every machine the package is installed on, where
it may be truncated, hand-edited, produced by another version, or replaced by something that is not a
file at all. Everything here answers "usable or not, and why" instead of raising, so that the dispatcher
can skip a bad record with one warning and serve the hand default (tuning.py does the warning).

- ``read_text(path)``: the text of a *regular* file, else ``(None, reason)``. A FIFO, directory or device
  where a file is expected is never read: it is opened with ``O_NONBLOCK`` (opening a FIFO for reading
  otherwise waits for a writer forever) and checked with ``fstat`` before a byte is read.
- ``parse_json(text)``: ``json.loads`` that also turns ``RecursionError`` (deeply nested input: the C
  decoder recurses per level) into a reason.
- ``record_problem(obj)``: why a parsed line is not a record of the KernelKey schema (None if it is).
- ``meta_problem(obj)``: why a parsed ``meta.json`` is not a JSON object of versions.
"""
from __future__ import annotations

import json
import math
import os
import stat

# A record line is ~600 bytes and a shipped records.jsonl ~50 KB: 64 MiB is far beyond any real log and
# keeps a stray multi-GB file (a log pointed at a dataset) from being read into memory on a kernel call.
MAX_FILE_BYTES = 64 << 20
MAX_LINE_CHARS = 64 << 10  # a line longer than this is not a record (and not worth parsing)


def read_text(path) -> tuple[str | None, str | None]:
    """(text, None) for a regular file, else (None, why). Never blocks: see the module docstring."""
    try:
        fd = os.open(str(path), os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as err:
        return None, f"unreadable ({err.strerror or err})"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, f"not a regular file ({_kind(st.st_mode)})"
        if st.st_size > MAX_FILE_BYTES:
            return None, f"too large ({st.st_size} bytes > {MAX_FILE_BYTES})"
        with os.fdopen(fd, "rb", closefd=True) as f:
            fd = None
            data = f.read(MAX_FILE_BYTES + 1)
        return data.decode("utf-8", errors="replace"), None
    except OSError as err:
        return None, f"unreadable ({err.strerror or err})"
    finally:
        if fd is not None:
            os.close(fd)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "a special file"


def parse_json(text: str, limit: int = MAX_LINE_CHARS):
    """(object, None), or (None, why) for text that is not JSON, longer than ``limit``, or nested too deeply."""
    if len(text) > limit:
        return None, f"line of {len(text)} characters"
    try:
        return json.loads(text), None
    except RecursionError:  # "[[[[..." thousands deep: the decoder's recursion limit
        return None, "nested too deeply"
    except ValueError as err:
        return None, f"not JSON ({str(err)[:60]})"


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # True is an int to Python, not to a schedule


def _is_plain(v) -> bool:
    """A static-dim value KernelKey can freeze and hash: a scalar, or a flat list of scalars."""
    scalar = (bool, int, float, str, type(None))
    return isinstance(v, scalar) or (isinstance(v, list) and all(isinstance(x, scalar) for x in v))


def _str_map(obj, value_ok) -> bool:
    return isinstance(obj, dict) and all(isinstance(k, str) and value_ok(v) for k, v in obj.items())


def key_problem(key) -> str | None:
    """Why ``key`` is not a KernelKey.to_json() dict: op / direction / target strings, dtypes str -> str,
    static dims str -> plain value, shape_bucket str -> positive int."""
    if not isinstance(key, dict):
        return "key is not an object"
    for name in ("op", "direction", "target"):
        if not isinstance(key.get(name), str):
            return f"key.{name} is not a string"
    if not _str_map(key.get("dtypes"), lambda v: isinstance(v, str)):
        return "key.dtypes is not an object of strings"
    if not _str_map(key.get("static_dims"), _is_plain):
        return "key.static_dims is not an object of plain values"
    if not _str_map(key.get("shape_bucket", {}), lambda v: _is_int(v) and v > 0):
        return "key.shape_bucket is not an object of positive integers"
    return None


def _is_time(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def record_problem(obj) -> str | None:
    """Why ``obj`` is not a tuning record (None if it is): the key schema above, ``decisions`` str ->
    int / str / bool (the knob types rules read; whether the rule accepts each value is checked later,
    per workload, by tuning.py), ``time_s`` / ``default_time_s`` finite positive seconds."""
    if not isinstance(obj, dict):
        return "not an object"
    why = key_problem(obj.get("key"))
    if why:
        return why
    if not _str_map(obj.get("decisions"), lambda v: isinstance(v, (int, str))):  # bool is an int subclass
        return "decisions is not an object of integers / strings / booleans"
    for name in ("time_s", "default_time_s"):
        if not _is_time(obj.get(name)):
            return f"{name} is not a positive number of seconds"
    return None


def meta_problem(obj) -> str | None:
    """Why a parsed meta.json cannot describe a log folder (it must be an object; its versions are
    compared by tuning.py)."""
    return None if isinstance(obj, dict) else f"meta.json is {type(obj).__name__}, not an object"


def strictly_in(value, candidates) -> bool:
    """``value in candidates`` with the type too: ``32.0 == 32`` and ``True == 1`` in Python, but a float
    vector width or a bool tile size does not build."""
    return any(type(value) is type(c) and value == c for c in candidates)
