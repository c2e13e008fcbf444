"""Tuning logs: device keys, reading records (JSON only, never code), and the dispatch lookup.

Layout: ``<logs>/<device-key>/<op>/records.jsonl`` (knob-template records, one JSON object per line,
append-only) and ``<logs>/<device-key>/meta.json`` (TVM / tvm-ffi / LLVM versions, device, date, budget).
``<logs>`` is the package's ``tuning_logs/`` or ``$TVM_MAMBA_TUNING_LOGS``. A record::

    {"key": KernelKey.to_json() incl. shape_bucket, "decisions": {...}, "time_s": best,
     "default_time_s": hand default, "candidates": n}

Lookup: exact (workload, bucket), else the nearest tuned bucket of the same workload (log2 distance);
a record that is not faster than the hand default is never used. Logs whose meta does not match the
running versions are ignored with one warning; malformed / truncated / foreign files and lines are
skipped with a warning naming them.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import math
import os
import pathlib
import threading
import warnings

import tvm
import tvm_ffi

from . import dispatch
from .key import KernelKey

ENV = "TVM_MAMBA_TUNING_LOGS"
RECORDS = "records.jsonl"
_state = threading.local()


@functools.lru_cache(maxsize=None)  # find_spec checks the filesystem: ~0.4 ms per kernel call otherwise
def package_logs_dir() -> pathlib.Path:
    spec = importlib.util.find_spec("tvm_mamba.tuning_logs")
    if spec is not None and spec.submodule_search_locations:
        return pathlib.Path(list(spec.submodule_search_locations)[0])
    return pathlib.Path(__file__).resolve().parents[2] / "tuning_logs"


def logs_dir() -> pathlib.Path:
    override = getattr(_state, "path", None) or os.environ.get(ENV)
    return _as_path(str(override)) if override else package_logs_dir()


@functools.lru_cache(maxsize=64)
def _as_path(raw: str) -> pathlib.Path:
    return pathlib.Path(raw)


def enabled() -> bool:
    return getattr(_state, "enabled", True)


@contextlib.contextmanager
def tuning_logs(enabled: bool = True, path: str | os.PathLike | None = None):
    """``with tvm_mamba.tuning_logs(enabled=False):`` runs with hand defaults only (A/B comparisons);
    ``path=`` reads another logs folder for the block."""
    prev = getattr(_state, "enabled", True), getattr(_state, "path", None)
    _state.enabled, _state.path = enabled, (str(path) if path else prev[1])
    refresh()
    try:
        yield
    finally:
        _state.enabled, _state.path = prev


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
        flags = open("/proc/cpuinfo").read()
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


def running_meta() -> dict:
    return {"tvm": tvm.__version__, "tvm_ffi": tvm_ffi.__version__,
            "llvm": int(tvm.target.codegen.llvm_version_major())}


# --- reading ---------------------------------------------------------------------------------------
_warned: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=4)


def _valid_record(obj) -> bool:
    return (isinstance(obj, dict) and isinstance(obj.get("key"), dict) and isinstance(obj.get("decisions"), dict)
            and isinstance(obj.get("time_s"), (int, float)) and isinstance(obj.get("default_time_s"), (int, float))
            and all(isinstance(v, (int, float, str, bool)) for v in obj["decisions"].values()))


@functools.lru_cache(maxsize=64)
def _load(root: str, dev: str, stamp: tuple) -> dict:
    """{workload KernelKey: [(bucket dict, record dict, file)]} for one device folder."""
    folder = pathlib.Path(root) / dev
    index: dict[KernelKey, list] = {}
    meta_file = folder / "meta.json"
    if not folder.is_dir():
        return index
    try:
        meta = json.loads(meta_file.read_text())
        want = running_meta()
        if any(str(meta.get(k)) != str(v) for k, v in want.items()):
            _warn_once(f"tvm_mamba: ignoring tuning logs {folder} (made with "
                       f"{ {k: meta.get(k) for k in want} }, running {want})")
            return index
    except (OSError, ValueError) as err:
        _warn_once(f"tvm_mamba: ignoring tuning logs {folder}: unreadable meta.json ({err})")
        return index
    for f in sorted(folder.glob(f"*/{RECORDS}")):
        bad = 0
        for line in f.read_text(errors="replace").splitlines():
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                if not _valid_record(obj):
                    raise ValueError("not a record")
                key = KernelKey.from_json(obj["key"])
            except (ValueError, KeyError, TypeError):
                bad += 1
                continue
            index.setdefault(key.workload(), []).append((dict(key.shape_bucket), obj, str(f)))
        if bad:
            _warn_once(f"tvm_mamba: skipped {bad} malformed line(s) in tuning log {f}")
    return index


_STAMP_TTL_S = 1.0  # re-stat the logs at most once a second: plan() runs on every kernel call
_stamps: dict[tuple[str, str], tuple[float, tuple]] = {}


def refresh() -> None:
    """Forget cached log state (the next lookup re-reads changed files)."""
    _stamps.clear()
    _dev_memo.clear()


def _folder_stamp(root: pathlib.Path, dev: str) -> tuple:
    import time

    now = time.monotonic()
    cached = _stamps.get((str(root), dev))
    if cached is not None and now - cached[0] < _STAMP_TTL_S:
        return cached[1]
    folder = root / dev
    try:
        stamp = tuple((str(p), p.stat().st_mtime_ns, p.stat().st_size) for p in sorted(folder.rglob("*.json*")))
    except OSError:
        stamp = ()
    _stamps[(str(root), dev)] = (now, stamp)
    return stamp


def _distance(a: dict, b: dict) -> float:
    names = set(a) | set(b)
    return sum(abs(math.log2(max(a.get(n, 1), 1)) - math.log2(max(b.get(n, 1), 1))) for n in names)


_dev_memo: dict[tuple[str, str], str] = {}
_found_memo: dict[tuple, object] = {}  # (key, root, dev, stamp) -> find_record's answer (runs on every call)


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
    """(record dict, file) serving ``key``, or None."""
    root = logs_dir()
    if dev is None:
        dev = _device_folder(root, key.target)
    stamp = _folder_stamp(root, dev)
    memo = (key, str(root), dev, stamp)
    if memo in _found_memo:
        return _found_memo[memo]
    if len(_found_memo) > 4096:
        _found_memo.clear()
    found = _find(key, root, dev, stamp)
    _found_memo[memo] = found
    return found


def _find(key: KernelKey, root: pathlib.Path, dev: str, stamp: tuple):
    index = _load(str(root), dev, stamp)
    entries = index.get(key.workload())
    if not entries:
        return None
    want = dict(key.shape_bucket)
    useful = [e for e in entries if e[1]["time_s"] < e[1]["default_time_s"]]  # never slower than default
    if not useful:
        return None
    best_dist = min(_distance(want, e[0]) for e in useful)
    nearest = [e for e in useful if _distance(want, e[0]) == best_dist]
    _, rec, file = min(nearest, key=lambda e: e[1]["time_s"])
    return rec, file


def lookup(key: KernelKey) -> "dispatch.Plan | None":
    """The dispatch plan hook: a tuned plan for ``key`` or None (hand defaults)."""
    if not enabled():
        return None
    found = find_record(key)
    if found is None:
        return None
    rec, file = found
    decisions = tuple(sorted(rec["decisions"].items()))
    bucket = ",".join(f"{k}={v}" for k, v in sorted(rec["key"].get("shape_bucket", {}).items()))
    how = ", MetaSchedule" if rec.get("source") == "metaschedule" else ""
    return dispatch.Plan(key, decisions, f"tuned: {file} [{bucket}] ({1e3 * rec['time_s']:.3f} ms vs default "
                                         f"{1e3 * rec['default_time_s']:.3f} ms{how})")


dispatch.register_plan_hook(lookup)


# --- writing ---------------------------------------------------------------------------------------
def write_meta(folder: pathlib.Path, device: str, budget: dict) -> None:
    import datetime

    folder.mkdir(parents=True, exist_ok=True)
    refresh()
    today = datetime.date.today().isoformat()
    try:  # keep the history of runs made with these versions (the latest also as "budget")
        old = json.loads((folder / "meta.json").read_text())
        runs = old.get("runs", [old["budget"]] if "budget" in old else [])
        runs = runs if all(str(old.get(k)) == str(v) for k, v in running_meta().items()) else []
    except (OSError, ValueError, AttributeError):
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
    path.parent.mkdir(parents=True, exist_ok=True)
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


def recorded_keys(folder: pathlib.Path) -> set[KernelKey]:
    """Keys (with bucket) already tuned in ``folder`` (for resuming)."""
    done = set()
    for f in folder.glob(f"*/{RECORDS}"):
        for line in f.read_text(errors="replace").splitlines():
            try:
                done.add(KernelKey.from_json(json.loads(line)["key"]))
            except (ValueError, KeyError, TypeError):
                continue
    return done
