"""A model's kernel set: the kernel keys one of its runs resolved, kept per model signature, so that the next
cold start (an empty cache, a new version of the package or of TVM: the cache folder is per version) can compile
them together (runtime/prebuild.py: a pool of processes) instead of one after another as the first forward
reaches each.

    prebuild.prefetch(signature)             # modules: before a model's generate
    with kernel_sets.recording(signature):   # every key resolved in this thread is noted, then saved
        ...

A set is saved in ``<cache base>/kernel_sets/<signature>.json`` (outside the per-version folder, so an upgrade's
cold start is pooled), a JSON list of KernelKey objects merged with what was saved before; ``python -m tvm_mamba
aot --model`` writes the same file from a ``dry_run`` of the model (stub kernels: nothing compiles or runs).
Files are data: a key that does not parse is skipped; the folder is the kernel cache's, so it is held to the
same trust rules (cache_dir.require_trusted). cache.build_and_load calls ``note`` and ``stub_for``; this
module imports nothing above the cache.
"""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import threading

from . import records
from .cache_dir import cache_base, private_mkdir, require_trusted
from .key import KernelKey

FOLDER = "kernel_sets"
MAX_KEYS = 512  # a set larger than this is cut (its first keys kept): a model runs tens of kernels
_local = threading.local()
_settled: dict[tuple, frozenset] = {}  # (cache base, signature) -> keys saved and resolved in this process


def folder() -> pathlib.Path:
    base = cache_base()
    require_trusted(base)
    return base / FOLDER


def path(signature: str) -> pathlib.Path:
    if not signature.isalnum():
        raise ValueError(f"kernel set signature: expected letters and digits, got {signature!r}")
    return folder() / f"{signature}.json"


def load(signature: str) -> list[KernelKey]:
    """The saved set of ``signature`` in first-use order ([] when none or unreadable)."""
    text, _ = records.read_text(path(signature))
    obj, why = records.parse_json(text, limit=records.MAX_FILE_BYTES) if text is not None else (None, "absent")
    keys = []
    for item in (obj.get("keys") if isinstance(obj, dict) and not why else None) or ():
        try:
            keys.append(KernelKey.from_json(item))
        except (KeyError, TypeError, ValueError, AttributeError):
            continue  # data, not code: a key this version does not read is left out
    return keys


def save(signature: str, keys) -> None:
    """Merge ``keys`` into the saved set (new ones appended), written atomically."""
    have = load(signature)
    merged = list(dict.fromkeys([*have, *keys]))[:MAX_KEYS]
    if merged == have:
        return
    target = path(signature)
    private_mkdir(target.parent)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps({"keys": [k.to_json() for k in merged]}, sort_keys=True))
    tmp.replace(target)


class _Stub:
    """What build_and_load hands out in a dry run: a kernel that runs nothing (outputs keep whatever memory
    they were given), so a model's forward reaches every kernel key it would use without compiling any."""

    simulated, module, path, build_seconds, load_seconds = False, None, None, 0.0, 0.0
    on_host = False  # it checks no index values (a recipe of stub launches reads them first)

    def __init__(self, key: KernelKey):
        from .key import Plan

        self.key, self.plan = key, Plan(key, (), "dry run")
        self.fn = self

    def __call__(self, *args):
        return None

    def bind(self, *args):
        return self


def in_dry_run() -> bool:
    return getattr(_local, "dry", False)


def stub_for(key: KernelKey):
    """A stub kernel when this thread is in a dry run (``dry_run``), else None (cache._resolve asks)."""
    return _Stub(key) if in_dry_run() else None


@contextlib.contextmanager
def dry_run():
    """``with dry_run(): model.generate(...)``: kernel calls run nothing, no kernel is compiled or loaded, and
    no prefetch starts; with ``recording`` inside, the keys are saved as a real run's. Only for a process that
    exits afterwards (``aot --model``'s child): the ops' own memos then hold stubs."""
    _local.dry = True
    try:
        yield
    finally:
        _local.dry = False


def note(key: KernelKey) -> None:
    """Called by cache.build_and_load for every key it resolves anew: kept when this thread is recording."""
    got = getattr(_local, "keys", None)
    if got is not None:
        got.setdefault(key, None)


def settled(signature: str) -> bool:
    """Whether this process has saved ``signature``'s set and resolved its kernels (with this cache): a later
    run of the model needs no prefetch (runtime/prebuild.py) and no rewrite of the file."""
    return (str(cache_base()), signature) in _settled


@contextlib.contextmanager
def recording(signature: str):
    """Note the keys this thread resolves in the block and save them to ``signature``'s set (also when the
    block raises: what ran is still the model's)."""
    outer = getattr(_local, "keys", None)
    _local.keys = {}
    try:
        yield
    finally:
        got, _local.keys = _local.keys, outer
        if outer is not None:
            outer.update(got)
        settled = (str(cache_base()), signature)
        if not set(got) <= _settled.get(settled, frozenset()):
            with contextlib.suppress(OSError):
                save(signature, got)
                _settled[settled] = _settled.get(settled, frozenset()) | frozenset(got)
