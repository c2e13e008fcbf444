"""Tuning logs: device keys, reading records (JSON only, never code), and the dispatch lookup.

Layout: ``<logs>/<device-key>/<op>/records.jsonl`` (knob-template records, one JSON object per line,
append-only) and ``<logs>/<device-key>/meta.json`` (TVM / tvm-ffi / LLVM versions, device, date, budget).
A record::

    {"key": KernelKey.to_json() incl. shape_bucket, "decisions": {...}, "time_s": best,
     "default_time_s": hand default, "candidates": n}

Two ``<logs>`` folders are read, in this order (``search_roots()``):

1. the *user* folder, where ``tune`` writes by default (``logs_dir()``): ``$TVM_MAMBA_TUNING_LOGS`` if set,
   else ``$XDG_CACHE_HOME/tvm_mamba/tuning_logs`` (``~/.cache/tvm_mamba/tuning_logs``); inside
   ``with tvm_mamba.tuning_logs(path=...)`` that path instead. Not the installed package: a system install
   is not writable, and an upgrade would delete the records.
2. the *shipped* logs, the package's ``tuning_logs/`` (``package_logs_dir()``; off with
   ``tuning_logs(shipped=False)``).

Lookup: the first folder with a usable record for the workload serves it (so a user's own tuning run
overrides what shipped): exact (workload, bucket), else the nearest tuned bucket of the same workload
(log2 distance); a record that is not faster than the hand default is never used. Logs whose meta does not
match the running versions are ignored with one warning. Records are data (runtime/records.py): a file
that is not a regular file (FIFO, directory, device) is never opened for reading, a line that does not
validate against the KernelKey schema is skipped, and a record whose knob values the op's schedule rule
does not accept (``32.0`` for ``32``, a value outside the knob's list, a knob the rule does not read) is
skipped when it would be served; each with one warning naming the file. The hand default (or the next
usable record) serves instead, and ``explain()`` says so.

Trust: the user folder is created 0700 and, like the kernel cache (cache_dir), refused (``UntrustedPath``
naming it and the fix) when it, a device folder in it or a log file is owned by another user or writable
by group/others: records choose which schedule builds, so they are not taken from someone else. The
shipped logs are trusted as the package's code is.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.util
import json
import os
import pathlib
import stat
import threading
import warnings

import tvm
import tvm_ffi

from ..schedules.rule import Decisions
from . import records, rules
from .cache_dir import UntrustedPath, build_root, private_mkdir, require_trusted
from .key import KernelKey, Plan, bucket_distance

ENV = "TVM_MAMBA_TUNING_LOGS"
RECORDS = "records.jsonl"
_state = threading.local()
_generation = [0]


def generation() -> int:
    """Changes whenever what lookup() answers may change (a refresh, a ``tuning_logs`` block entered or
    left); ``dispatch.generation()`` includes it, so kernel callers' fast paths re-resolve."""
    return _generation[0]


def _invalidate() -> None:
    _generation[0] += 1


@functools.lru_cache(maxsize=None)  # find_spec checks the filesystem: ~0.4 ms per kernel call otherwise
def package_logs_dir() -> pathlib.Path:
    """The shipped logs: the package's ``tuning_logs/`` (the repository's in a source checkout)."""
    spec = importlib.util.find_spec("tvm_mamba.tuning_logs")
    if spec is not None and spec.submodule_search_locations:
        return pathlib.Path(list(spec.submodule_search_locations)[0])
    return pathlib.Path(__file__).resolve().parents[2] / "tuning_logs"


def logs_dir() -> pathlib.Path:
    """The user logs folder (where ``tune`` writes, read before the shipped logs): the ``tuning_logs(path=)``
    block's path, else ``$TVM_MAMBA_TUNING_LOGS``, else ``$XDG_CACHE_HOME/tvm_mamba/tuning_logs``."""
    override = getattr(_state, "path", None) or os.environ.get(ENV)
    if override:
        return _as_path(str(override))
    env = os.environ  # plan() runs on every kernel call: two dict reads here, the path built once
    return _user_default(env.get("XDG_CACHE_HOME") or "", env.get("HOME", ""))


@functools.lru_cache(maxsize=64)
def _as_path(raw: str) -> pathlib.Path:
    return pathlib.Path(raw)


@functools.lru_cache(maxsize=16)
def _user_default(xdg: str, home: str) -> pathlib.Path:
    """``home`` ($HOME) is only part of the memo key: expanduser reads it."""
    return pathlib.Path(xdg or os.path.join(os.path.expanduser("~"), ".cache")) / "tvm_mamba" / "tuning_logs"


def search_roots() -> tuple[pathlib.Path, ...]:
    """The logs folders a lookup reads, first match wins: user folder, then the shipped logs."""
    user = logs_dir()
    if not getattr(_state, "shipped", True):
        return (user,)
    return _roots(user, package_logs_dir())


@functools.lru_cache(maxsize=64)
def _roots(user: pathlib.Path, shipped: pathlib.Path) -> tuple[pathlib.Path, ...]:
    # $TVM_MAMBA_TUNING_LOGS pointing at the shipped folder (a maintainer re-tuning a checkout): read it once
    same = os.path.abspath(user) == os.path.abspath(shipped)
    return (shipped,) if same else (user, shipped)


def enabled() -> bool:
    return getattr(_state, "enabled", True)


@contextlib.contextmanager
def tuning_logs(enabled: bool = True, path: str | os.PathLike | None = None, shipped: bool = True):
    """``with tvm_mamba.tuning_logs(enabled=False):`` runs with hand defaults only (A/B comparisons);
    ``path=`` reads that logs folder instead of the user folder for the block; ``shipped=False`` leaves
    out the package's shipped logs (a log judged on its own)."""
    prev = (getattr(_state, "enabled", True), getattr(_state, "path", None), getattr(_state, "shipped", True))
    _state.enabled, _state.path, _state.shipped = enabled, (str(path) if path else prev[1]), shipped
    refresh()
    try:
        yield
    finally:
        _state.enabled, _state.path, _state.shipped = prev
        _invalidate()


# --- device keys -----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _cpu_vendor() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    v = line.split(":", 1)[1].strip()
                    return {"GenuineIntel": "intel", "AuthenticAMD": "amd"}.get(v, v.lower())
    except OSError:
        pass
    return "unknown"


@functools.lru_cache(maxsize=None)
def _cpu_isa() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return "unknown"
    for isa, flag in (("avx512", " avx512f"), ("avx2", " avx2"), ("sse4", " sse4_2")):
        if flag in flags:
            return isa
    return "generic"


def device_key(target_key: str, gpu_name: str | None = None) -> str:
    """``cpu-intel-rocketlake-avx512`` for ``llvm-rocketlake``; ``nvidia-h200-sm90`` for ``cuda-sm_90``
    (the model comes from ``gpu_name``, e.g. torch.cuda.get_device_name())."""
    kind, _, rest = target_key.partition("-")
    if kind == "llvm":
        return f"cpu-{_cpu_vendor()}-{rest}-{_cpu_isa()}"
    if kind == "cuda":
        model = "unknown"
        if gpu_name:
            words = [w.lower() for w in gpu_name.replace("NVIDIA", "").split() if w]
            model = "-".join(w for w in words if w not in ("tesla",)) or "unknown"
        return f"nvidia-{model}-{rest.replace('_', '')}"
    return target_key


def _parts(dev: str) -> tuple[str, str, str, str]:
    """(kind, vendor, model, isa) of a device key: ``cpu-intel-rocketlake-avx512`` -> (cpu, intel,
    rocketlake, avx512); ``nvidia-h200-sm90`` -> (gpu, nvidia, h200, sm90)."""
    words = dev.split("-")
    if words[0] == "cpu" and len(words) >= 3:
        return "cpu", words[1], "-".join(words[2:-1]), words[-1]
    if len(words) >= 2:
        return "gpu", words[0], "-".join(words[1:-1]), words[-1]
    return dev, "", "", ""


def nearest_device(dev: str, available) -> str | None:
    """The device key in ``available`` whose records are most likely to fit ``dev``: same kind (CPU / GPU)
    required; then the same ISA (CPU: avx512 / avx2 / ...; GPU: the sm arch), since the knobs are mostly
    vector widths and tile sizes fitted to the register width; then the same vendor; then the same model.
    Ties: the alphabetically first. None when no key of the same kind is available."""
    kind, vendor, model, isa = _parts(dev)
    same_kind = sorted(d for d in available if d != dev and _parts(d)[0] == kind)
    if not same_kind:
        return None
    # max() keeps the first of equal scores: the alphabetically first, same_kind being sorted
    return max(same_kind, key=lambda d: (_parts(d)[3] == isa, _parts(d)[1] == vendor, _parts(d)[2] == model))


def running_meta() -> dict:
    return {"tvm": tvm.__version__, "tvm_ffi": tvm_ffi.__version__,
            "llvm": int(tvm.target.codegen.llvm_version_major())}


# --- reading ---------------------------------------------------------------------------------------
_warned: set[str] = set()


def _warn_once(msg: str, once: str | None = None) -> None:
    """Warn ``msg`` once per ``once`` (default: per message), e.g. once per file however many lines are bad."""
    tag = once or msg
    if tag not in _warned:
        _warned.add(tag)
        warnings.warn(msg, RuntimeWarning, stacklevel=4)


def read_records(path: pathlib.Path):
    """(lines, parsed, problems) of one records.jsonl: ``parsed[i]`` is line i's record dict, or None
    (blank or invalid: one reason per invalid line in ``problems``). A file that is not a regular file gives
    no lines and one reason. Never raises on the file's content."""
    text, why = records.read_text(path)
    if text is None:
        return [], [], [why]
    lines = text.splitlines()
    parsed, problems = [], []
    for line in lines:
        if not line.strip():
            parsed.append(None)
            continue
        obj, why = records.parse_json(line)
        why = why or records.record_problem(obj)
        parsed.append(None if why else obj)
        if why:
            problems.append(why)
    return lines, parsed, problems


def _read_meta(folder: pathlib.Path) -> tuple[dict | None, str | None]:
    """(meta dict, None) or (None, why) for ``folder/meta.json``."""
    text, why = records.read_text(folder / "meta.json")
    if text is None:
        return None, f"meta.json {why}"
    obj, why = records.parse_json(text, limit=records.MAX_FILE_BYTES)  # one object over many lines
    why = why or records.meta_problem(obj)
    return (None, f"unreadable meta.json ({why})") if why else (obj, None)


@functools.lru_cache(maxsize=64)
def _load(root: str, dev: str, stamp: tuple) -> dict:
    """{workload KernelKey: [(bucket dict, record dict, file)]} for one device folder (schema-valid records
    only; whether the rule accepts their knobs is checked when one would serve, see _rule_problem)."""
    folder = pathlib.Path(root) / dev
    index: dict[KernelKey, list] = {}
    if not folder.is_dir():
        return index
    meta, why = _read_meta(folder)
    if why:
        _warn_once(f"tvm_mamba: ignoring tuning logs {folder}: {why}")
        return index
    want = running_meta()
    if any(str(meta.get(k)) != str(v) for k, v in want.items()):
        _warn_once(f"tvm_mamba: ignoring tuning logs {folder} (made with "
                   f"{ {k: meta.get(k) for k in want} }, running {want})")
        return index
    for f in sorted(folder.glob(f"*/{RECORDS}")):
        lines, parsed, problems = read_records(f)
        for obj in parsed:
            if obj is not None:
                key = KernelKey.from_json(obj["key"])  # cannot raise: record_problem checked every field
                index.setdefault(key.workload(), []).append((dict(key.shape_bucket), obj, str(f)))
        if problems and not lines:  # a FIFO, directory, device or unreadable file
            _warn_once(f"tvm_mamba: skipped tuning log {f}: {problems[0]}", once=f"malformed:{f}:{stamp}")
        elif problems:
            _warn_once(f"tvm_mamba: skipped {len(problems)} malformed line(s) in tuning log {f} "
                       f"(first: {problems[0]})", once=f"malformed:{f}:{stamp}")
    return index


_STAMP_TTL_S = 1.0  # re-stat the logs at most once a second: plan() runs on every kernel call
_stamps: dict[tuple[str, str], tuple[float, tuple]] = {}


def refresh() -> None:
    """Forget cached log state (the next lookup re-reads changed files and warns again)."""
    _stamps.clear()
    _dev_memo.clear()
    _warned.clear()
    _invalidate()


def _folder_stamp(root: pathlib.Path, dev: str) -> tuple:
    import time

    now = time.monotonic()
    cached = _stamps.get((str(root), dev))
    if cached is not None and now - cached[0] < _STAMP_TTL_S:
        return cached[1]
    stamp = []
    user = root != package_logs_dir()  # the shipped logs are trusted as the package's code is
    if user:
        for folder in (root, root / dev):
            require_trusted(folder, "tuning logs directory", ENV)
    for p in sorted((root / dev).rglob("*.json*")) if (root / dev).is_dir() else ():
        try:  # stat, not open: safe on a FIFO; a vanished or dangling entry counts as changed
            st = p.stat()
        except OSError:
            stamp.append((str(p), -1, -1, 0))
            continue
        if user and stat.S_ISREG(st.st_mode):  # what is read (a FIFO or device is skipped unread: records.py)
            require_trusted(p, "tuning log", ENV, st=st)
        stamp.append((str(p), st.st_mtime_ns, st.st_size, st.st_mode))
    _stamps[(str(root), dev)] = (now, tuple(stamp))
    return tuple(stamp)


# --- does the rule accept a record's knobs? -------------------------------------------------------------
class _StrictDecisions(Decisions):
    """Reads knobs as Decisions does, but a recorded value counts only if it is one of the rule's
    candidates with the candidate's type (Decisions.pick compares with ``in``: ``32.0 in (8, 16, 32)``)."""

    def __init__(self, values):
        super().__init__(values)
        self.rejected: dict[str, tuple] = {}

    def pick(self, name, candidates, default):
        candidates = tuple(candidates)
        value = self.values.get(name, default)
        if not records.strictly_in(value, candidates):
            self.rejected.setdefault(name, candidates)
            value = default
        self.used[name], self.space[name] = value, candidates
        return value


def _check_decisions(workload: KernelKey, values: dict) -> str | None:
    """Why the op's rule does not accept ``values`` (None if it does): the rule is applied with them, as a
    build would, so knobs read only under other knob values (selective_scan's ``vector`` under ``layout``)
    are judged in context."""
    if not values:
        return None  # the hand default
    d = _StrictDecisions(values)
    try:
        rules.apply(workload, d)
    except Exception as err:  # noqa: BLE001 - a record that breaks the rule is a bad record, not a crash
        return f"the schedule rule fails with them ({type(err).__name__}: {str(err)[:80]})"
    bad = [f"{n}={values[n]!r} is not one of {c}" for n, c in d.rejected.items() if n in values]
    bad += [f"{n} is not a knob of this kernel" for n in values if n not in d.space]
    return "; ".join(bad) or None


_checked: dict[str, str | None] = {}


def _rule_problem(workload: KernelKey, values: dict) -> str | None:
    """_check_decisions, memoized in the process and on disk beside the compiled kernels: applying a rule
    takes 0.1-3 s, and a warm start (kernels loaded from disk) should not pay it on every run. The disk
    entry lives under build_root() (the cache's version folder), whose name includes the schedule sources'
    digest, so editing a rule re-checks."""
    tag = hashlib.sha256((workload.digest() + json.dumps(values, sort_keys=True)).encode()).hexdigest()[:24]
    if tag in _checked:
        return _checked[tag]
    path = None
    try:
        path = build_root() / "tuning_checks" / f"{tag}.json"
        text, _ = records.read_text(path)
        obj, _ = records.parse_json(text) if text is not None else (None, None)
        if isinstance(obj, dict) and (obj.get("problem") is None or isinstance(obj.get("problem"), str)):
            _checked[tag] = obj.get("problem")
            return _checked[tag]
    except UntrustedPath:
        raise
    except OSError:
        path = None
    problem = _checked[tag] = _check_decisions(workload, values)
    if path is not None:
        _write_atomic(path, json.dumps({"problem": problem}))
    return problem


def _write_atomic(path: pathlib.Path, text: str) -> None:
    try:
        private_mkdir(path.parent)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(text)
        tmp.replace(path)
    except OSError:  # a memo only: an unwritable cache re-checks next run
        pass


# --- lookup ----------------------------------------------------------------------------------------
_dev_memo: dict[tuple, object] = {}  # device folder per (root, target); stand_in per target
_found_memo: dict[tuple, object] = {}  # (key, roots and stamps) -> find_record's answer (runs on every call)


def _device_folder(root: pathlib.Path, target_key: str) -> str:
    memo = (str(root), target_key)
    dev = _dev_memo.get(memo)
    if dev is None:
        dev = device_key(target_key)
        if target_key.startswith("cuda-"):  # the GPU model is not in the target key: take this arch's folder
            found = sorted(root.glob(f"nvidia-*-{target_key[5:].replace('_', '')}"))
            dev = found[0].name if found else dev
        _dev_memo[memo] = dev
    return dev


def find_record(key: KernelKey, dev: str | None = None):
    """(record dict, file) serving ``key``, or None: the first of search_roots() with a usable record; when
    this device has no records at all (no folder, or empty ones), a stand-in class's (``stand_in``), whose
    records are looked up under its own target key."""
    roots = search_roots()
    own = tuple((root, d, _folder_stamp(root, d), key) for root in roots
                for d in (dev or _device_folder(root, key.target),))
    where = own
    if dev is None and not any(_load(str(r), d, st) for r, d, st, _ in own):
        near = stand_in(key.target)
        if near is not None:
            where = tuple((root, near[0], _folder_stamp(root, near[0]), dataclasses.replace(key, target=near[1]))
                          for root in roots)
    memo = (key, tuple((str(r), d, s) for r, d, s, _ in where))
    if memo in _found_memo:
        return _found_memo[memo]
    if len(_found_memo) > 4096:
        _found_memo.clear()
    found = None
    for root, d, stamp, k in where:
        found = _find(k, root, d, stamp)
        if found is not None:
            break
    _found_memo[memo] = found
    return found


def stand_in(target_key: str) -> tuple[str, str] | None:
    """(device key, its records' target key) of the tuned CPU class whose records serve a device that has
    none, or None. The rule: same kind and the same ISA class (``avx512`` / ``avx2`` / ...: the vector
    width, which most knobs are fitted to: lanes, register blocks, accumulator counts) are required; among
    those, the same vendor, then the same model (``nearest_device``). A record's knobs are still checked
    against this target's rule before one serves. GPUs need none: their folder is found by arch."""
    memo = ("stand-in", target_key, tuple(str(r) for r in search_roots()))
    if memo in _dev_memo:
        return _dev_memo[memo]
    dev = device_key(target_key)
    found = {}  # device key -> target key of its records, over every root
    for root in search_roots():
        for meta in sorted(root.glob("*/meta.json")) if root.is_dir() else ():
            other = meta.parent.name
            if other in found or _parts(other)[::3] != _parts(dev)[::3] or other == dev:
                continue  # [::3]: (kind, isa)
            targets = {k.target for k in _load(str(root), other, _folder_stamp(root, other))}
            if len(targets) == 1:
                found[other] = targets.pop()
    near = nearest_device(dev, found)
    out = (near, found[near]) if near else None
    _dev_memo[memo] = out
    return out


def _find(key: KernelKey, root: pathlib.Path, dev: str, stamp: tuple):
    """The best usable record of ``key``'s workload in one device folder: nearest bucket, then fastest;
    a record the rule rejects is skipped with a warning and the next one tried."""
    entries = _load(str(root), dev, stamp).get(key.workload())
    want = dict(key.shape_bucket)
    useful = [e for e in entries or () if e[1]["time_s"] < e[1]["default_time_s"]]  # never slower than default
    for bucket, rec, file in sorted(useful, key=lambda e: (bucket_distance(want, e[0]), e[1]["time_s"])):
        problem = _rule_problem(key.workload(), rec["decisions"])
        if problem is None:
            return rec, file
        _warn_once(f"tvm_mamba: skipped tuning record(s) in {file} that the schedule rule does not accept "
                   f"(first: {key.op}.{key.direction} {bucket}: {problem}); the hand default serves instead",
                   once=f"rejected:{file}:{stamp}")
    return None


def lookup(key: KernelKey) -> Plan | None:
    """A tuned plan for ``key`` or None (hand defaults); ``dispatch.plan`` calls it after its hooks."""
    if not enabled():
        return None
    found = find_record(key)
    if found is None:
        return None
    rec, file = found
    decisions = tuple(sorted(rec["decisions"].items()))
    bucket = ",".join(f"{k}={v}" for k, v in sorted(rec["key"].get("shape_bucket", {}).items()))
    how = ", MetaSchedule" if rec.get("source") == "metaschedule" else ""
    if rec["key"]["target"] != key.target:
        how += f", stand-in class for {device_key(key.target)}"
    return Plan(key, decisions, f"tuned: {file} [{bucket}] ({1e3 * rec['time_s']:.3f} ms vs default "
                                         f"{1e3 * rec['default_time_s']:.3f} ms{how})")



def device_summary(target_key: str, gpu_name: str | None = None) -> dict:
    """What ``info`` prints: {"device": key, "user": (records, folder), "shipped": (records, folder),
    "nearest": (device key, "user" | "shipped", records) or None, "stand_in": device key or None}; nearest
    and stand_in only when neither folder has records for this device (nearest_device gives the order;
    stand_in the class whose records serve, which must share the ISA class)."""
    dev = device_key(target_key, gpu_name)
    out = {"device": dev, "nearest": None, "stand_in": None}
    others: dict[str, tuple[str, int]] = {}
    for name, root in (("user", logs_dir()), ("shipped", package_logs_dir())):
        out[name] = (_count(root, dev), root / dev)
        for folder in sorted(root.glob("*/meta.json")) if root.is_dir() else ():
            other = folder.parent.name
            if other != dev and other not in others:
                others[other] = (name, _count(root, other))
    if not out["user"][0] and not out["shipped"][0]:
        near = nearest_device(dev, [d for d, (_, n) in others.items() if n])
        out["nearest"] = (near, *others[near]) if near else None
        out["stand_in"] = (stand_in(target_key) or (None,))[0] if target_key.startswith("llvm") else None
    return out


def _count(root: pathlib.Path, dev: str) -> int:
    return sum(len(v) for v in _load(str(root), dev, _folder_stamp(root, dev)).values())


# --- writing ---------------------------------------------------------------------------------------
def write_meta(folder: pathlib.Path, device: str, budget: dict) -> None:
    import datetime

    private_mkdir(folder)
    refresh()
    today = datetime.date.today().isoformat()
    old, _ = _read_meta(folder)  # keep the history of runs made with these versions (the latest also as "budget")
    runs = (old or {}).get("runs", [old["budget"]] if old and "budget" in old else [])
    if not isinstance(runs, list) or not old or any(str(old.get(k)) != str(v) for k, v in running_meta().items()):
        runs = []
    meta = dict(running_meta(), device=device, date=today, budget=budget, runs=runs + [dict(budget, date=today)])
    tmp = folder / "meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    tmp.replace(folder / "meta.json")


def append_record(folder: pathlib.Path, key: KernelKey, decisions: dict, time_s: float, default_time_s: float,
                  candidates: int, **extra) -> None:
    """Append one record line (flushed and fsynced: an interrupted run leaves a valid log). ``extra``:
    JSON fields kept beside (``tune_s``: seconds spent tuning it; ``source``: "metaschedule" when the
    candidates came from the op's MetaSchedule JSONDatabase)."""
    path = folder / key.op / RECORDS
    private_mkdir(path.parent)
    _require_regular(path)
    refresh()
    line = json.dumps({"key": key.to_json(), "decisions": decisions, "time_s": time_s,
                       "default_time_s": default_time_s, "candidates": candidates, **extra}, sort_keys=True)
    with open(path, "a+b") as f:
        f.seek(0, os.SEEK_END)
        if f.tell():  # an interrupted run may have left a partial last line: start a fresh one
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")
        f.write(line.encode() + b"\n")
        f.flush()
        os.fsync(f.fileno())


def _require_regular(path: pathlib.Path) -> None:
    """Refuse to append to a FIFO / directory / device where the log file should be (opening a FIFO
    waits for a reader; the others fail mid-write): the tuner says which path to remove instead."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        raise OSError(f"tuning log {path} is not a regular file; remove it to record here")


def recorded_keys(folder: pathlib.Path) -> set[KernelKey]:
    """Keys (with bucket) already tuned in ``folder`` (for resuming); malformed lines count as not tuned."""
    done = set()
    for f in sorted(folder.glob(f"*/{RECORDS}")):
        done.update(KernelKey.from_json(obj["key"]) for obj in read_records(f)[1] if obj is not None)
    return done
