"""``python -m tvm_mamba tune``: search each kernel's design space per shape bucket and record the best.

Workloads: every op's ``tuning_configs(preset)`` (else its ``build_check_configs()``) x batch buckets x
seqlen buckets. For each workload the rule is applied once with its defaults to learn its design space
(``Decisions.space``); candidates (all combinations, or a sample of ``--trials`` always including the
default) are compiled and timed with TVM's ``time_evaluator`` on inputs of the bucket's shape — locally,
or on a remote device through TVM's RPC tracker (``--rpc-tracker host:port --rpc-key key``). A winner other
than the default is confirmed by timing it and the default alternately (3 rounds; it must be >= 3% faster),
else the default is recorded. The result is appended to ``<logs>/<device-key>/<op>/records.jsonl`` with the
default's time beside it, where ``<logs>`` is ``--out``, else the user tuning folder (``tuning.logs_dir()``:
``$TVM_MAMBA_TUNING_LOGS``, else ``$XDG_CACHE_HOME/tvm_mamba/tuning_logs``), which dispatch reads before the
shipped logs. Never the installed package: it may not be writable, and an upgrade replaces it.

Progress: one line per workload (a bar redrawn in place on a terminal) counting the workloads that fit in the
budget at the mean time per workload so far, with readable names (``workload_label``).

Resumable: a workload already in the log is skipped; each record is fsynced as it is written, so an
interrupted run loses only the workload in flight. Tuning never executes anything read from the logs.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import pathlib
import random
import sys
import tempfile
import time

import numpy as np
import tvm

from . import metaschedule as msd
from ..runtime import KernelKey, cpu_target, target_key
from ..runtime import dispatch, registry, tuning
from ..runtime.cache import compile_module
from ..schedules.rule import Decisions

SEQLENS = (512, 2048)
BATCHES = (1, 4)
CONFIRM_ROUNDS = 3     # alternate default / winner measurements before recording a winner
CONFIRM_MARGIN = 0.03  # the winner must be >= 3% faster than the default in the confirmation


def _configs(op: str, preset: str):
    mod = registry.op(op).compute
    if hasattr(mod, "tuning_configs"):
        return mod.tuning_configs(preset)
    return mod.build_check_configs() if hasattr(mod, "build_check_configs") else []


def symbolic_dims(key: KernelKey) -> list[str]:
    """Names of the kernel's symbolic (dynamic) dims, e.g. ["batch", "seqlen"] or ["rows"] or ["M"]."""
    names = []
    for p in dispatch.build_func(key).params:
        for d in p.shape:
            if isinstance(d, tvm.tirx.Var) and d.name not in names:
                names.append(d.name)
    return names


def bucket_for(names: list[str], batch: int, seqlen: int) -> dict[str, int]:
    """The grid point (batch, seqlen) in the kernel's own dims: batch and seqlen as such; any other dynamic
    dim (token rows of a norm, M of an int8 matmul) is the token count batch*seqlen."""
    return {n: batch if n == "batch" else seqlen if n == "seqlen" else batch * seqlen for n in names}


def _derived(key: KernelKey, dims: dict) -> dict:
    """Dims the op derives from the others (e.g. a reduction's part count), via compute.<op>.derived_dims."""
    fn = getattr(registry.op(key.op).compute, "derived_dims", None)
    return fn(key.direction, dims, dict(key.static)) if fn is not None else {}


def workloads(ops, target, preset: str = "default", seqlens=SEQLENS, batches=BATCHES,
              directions=None) -> list[KernelKey]:
    tkey = target_key(target)
    keys = []
    for op in ops:
        for direction, static, dtypes in _configs(op, preset):
            if directions and direction not in directions:
                continue
            base = KernelKey.make(op, direction, dtypes, static, tkey)
            names = symbolic_dims(base)
            names = [n for n in names if n not in _derived(base, {n: 1 for n in names})]
            for b, L in itertools.product(batches, seqlens):
                keys.append(KernelKey.make(op, direction, dtypes, static, tkey, bucket_for(names, b, L)))
    return list(dict.fromkeys(keys))


def design_space(key: KernelKey) -> dict[str, tuple]:
    d = Decisions()
    dispatch.schedule(key, d)
    return d.space


def candidates(space: dict[str, tuple], defaults: dict, trials: int, seed: int = 0) -> list[dict]:
    names = sorted(space)
    every = [dict(zip(names, combo)) for combo in itertools.product(*(space[n] for n in names))]
    default = {n: defaults[n] for n in names}
    rest = [c for c in every if c != default]
    random.Random(seed).shuffle(rest)
    return [default] + rest[: max(trials - 1, 0)]


def _shape(param, bucket: dict, analyzer=None) -> tuple[int, ...]:
    """A parameter's concrete shape at the bucket: symbolic dims (bare vars or expressions of them, such
    as a checkpoint count ceil(seqlen / chunk)) are evaluated with the bucket's values bound."""
    dims = []
    for s in param.shape:
        if isinstance(s, (int, tvm.tirx.IntImm)):
            dims.append(int(s))
            continue
        if isinstance(s, tvm.tirx.Var) and s.name not in bucket:
            raise ValueError(f"tuning: no bucket value for symbolic dim {s.name!r}")
        value = analyzer.simplify(s) if analyzer is not None else s
        if not isinstance(value, tvm.tirx.IntImm):
            value = bucket.get(getattr(s, "name", None))
            if value is None:
                raise ValueError(f"tuning: cannot evaluate dim {s} at bucket {bucket}")
        dims.append(int(value))
    return tuple(dims)


def bucket_analyzer(func, bucket: dict):
    """An arith Analyzer with every symbolic dim var of ``func`` bound to its bucket value."""
    from tvm.sym.analyzer import Analyzer

    analyzer = Analyzer()
    for p in func.params:
        for s in p.shape:
            if isinstance(s, tvm.tirx.Var) and s.name in bucket:
                analyzer.bind(s, tvm.tirx.const(int(bucket[s.name]), "int32"))
    return analyzer


def make_args(key: KernelKey, dev, seed: int = 0, fixed: dict | None = None) -> list:
    """Inputs of the bucket's shape: random floats in [-1, 1), zeros for integer tensors; the state matrix
    ``A`` of the scans in (-1, -0.5], its model domain (mamba_ssm's A = -exp(A_log)): a positive A makes the
    recurrences grow to ~1e14 and the sums cancel, which is no shape a model runs. ``fixed``: derived dims
    to take as given instead (the roofline counts small lengths with a large shape's part counts)."""
    func = dispatch.build_func(key)
    bucket = dict(key.shape_bucket)
    bucket.update(_derived(key, bucket))
    bucket.update({k: v for k, v in (fixed or {}).items() if k in bucket})
    analyzer = bucket_analyzer(func, bucket)
    rng = np.random.default_rng(seed)
    args = []
    for p in func.params:
        shape, dtype = _shape(p, bucket, analyzer), str(p.dtype)
        if dtype.startswith("float") or dtype == "bfloat16":
            host = rng.uniform(-1, 1, size=shape).astype("float32")
            if p.name == "A" and key.op in ("selective_scan", "ssd"):
                host = -0.75 - 0.25 * host
            if dtype == "bfloat16":
                import ml_dtypes

                host = host.astype(ml_dtypes.bfloat16)
            else:
                host = host.astype(dtype)
        else:
            host = np.zeros(shape, dtype=dtype)
        args.append(tvm.runtime.tensor(host, dev))
    return args


class LocalMeasurer:
    def __init__(self):
        self.dev = tvm.cpu(0)

    def __call__(self, key: KernelKey, ex, args) -> float:
        name = f"{key.op}_{key.direction}"
        timer = ex.mod.time_evaluator(name, self.dev, number=3, repeat=5, min_repeat_ms=20)
        return float(np.median(timer(*args).results))

    def args(self, key):
        return make_args(key, self.dev)

    def ms_runner(self):
        return "local"


class RPCMeasurer:
    """Measure on a device registered with a TVM RPC tracker (export -> upload -> time remotely). The session
    is requested when first needed and released before a MetaSchedule search: a server serves one session at a
    time, so MetaSchedule's RPCRunner would otherwise wait for ours forever."""

    def __init__(self, tracker: str, rpc_key: str, timeout: int = 60):
        from tvm import rpc

        host, port = tracker.rsplit(":", 1)
        self.where = (host, int(port), rpc_key, timeout)
        self.tracker = rpc.connect_tracker(host, int(port))
        self.session = None
        self.uploads = 0

    @property
    def dev(self):
        if self.session is None:
            self.session = self.tracker.request(self.where[2], priority=1, session_timeout=0)
        return self.session.cpu(0)

    def __call__(self, key, ex, args) -> float:
        # a fresh file name per upload: re-uploading over a library the server has loaded (dlopen keeps
        # it mapped) crashes the server process
        dev = self.dev
        self.uploads += 1
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, f"{key.slug()}-{self.uploads}.so")
            ex.export_library(path)
            self.session.upload(path)
        remote = self.session.load_module(os.path.basename(path))
        timer = remote.time_evaluator(f"{key.op}_{key.direction}", dev, number=3, repeat=5, min_repeat_ms=20)
        return float(np.median(timer(*args).results))

    def args(self, key):
        return make_args(key, self.dev)

    def ms_runner(self):
        import gc

        from tvm.s_tir import meta_schedule as ms

        self.session = None  # release ours (closed when collected) so the runner's session can start
        gc.collect()
        host, port, rpc_key, timeout = self.where
        return ms.runner.RPCRunner(ms.runner.RPCConfig(tracker_host=host, tracker_port=port, tracker_key=rpc_key,
                                                       session_timeout_sec=timeout))


def tune_one(key: KernelKey, measure, trials: int, folder: pathlib.Path | None = None
             ) -> tuple[dict, float, float, int, str]:
    """(best decisions, best time, default time, number of candidates, source) for one workload; source is
    "metaschedule" or "template". A block-scheduled
    kernel (a MetaSchedule design space) is searched by MetaSchedule when ``folder`` is given: its trials go
    to ``folder/<op>/``'s JSONDatabase and its best trace's knobs face the default below; a loop-nest
    template's candidates are enumerated (or sampled) from its knob lists and measured here."""
    space = design_space(key)
    if not space:
        raise ValueError("its schedule has no knobs to tune")
    defaults = Decisions()
    dispatch.schedule(key, defaults)
    if folder is not None and msd.block_scheduled(key):
        found, n_trials = msd.search(key, folder / key.op, trials, measure.ms_runner())
        cands = [defaults.used] + ([found] if found != defaults.used else [])
        source = "metaschedule"
    else:
        cands = candidates(space, defaults.used, trials)
        n_trials, source = len(cands), "template"
    args = measure.args(key)
    times, built = [], []
    for values in cands:
        built.append(compile_module(key, dispatch.schedule(key, Decisions(values))))
        times.append(measure(key, built[-1], args))
    best = int(np.argmin(times))
    if best == 0:
        return cands[0], times[0], times[0], n_trials, source
    # Confirm: a single measurement on a shared machine picks noise (re-measured "5.8x" records were 0.76x).
    t_best_m, t_def_m = confirm(key, measure, built[best], built[0], args)
    if t_best_m > t_def_m * (1.0 - CONFIRM_MARGIN):
        return cands[0], t_def_m, t_def_m, n_trials, source
    return cands[best], t_best_m, t_def_m, n_trials, source


def confirm(key, measure, ex_best, ex_default, args, rounds: int = CONFIRM_ROUNDS) -> tuple[float, float]:
    """(winner, default) medians of ``rounds`` alternating measurements of the two."""
    t_best, t_def = [], []
    for _ in range(rounds):
        t_def.append(measure(key, ex_default, args))
        t_best.append(measure(key, ex_best, args))
    return float(np.median(t_best)), float(np.median(t_def))


def _winner(rec: dict) -> bool:
    return rec["time_s"] < rec["default_time_s"] and not rec.get("rechecked")


def recheck(ops, out: str | None = None, rounds: int = 5, target=None) -> tuple[int, int]:
    """Re-time every winning record of ``ops`` in this machine's logs (``out``, else the user folder) against
    the hand default (``rounds`` alternations, a fresh process's view); a winner that is no longer
    CONFIRM_MARGIN faster is rewritten as "default kept" (so dispatch serves the default). Malformed lines are
    kept as they are (dispatch skips them). Returns (records rechecked, records demoted)."""
    target = target or cpu_target()
    folder = pathlib.Path(out or tuning.logs_dir()) / tuning.device_key(target_key(target))
    logs = {}
    for op in ops:
        lines, parsed, _ = tuning.read_records(folder / op / tuning.RECORDS)
        if lines:
            logs[folder / op / tuning.RECORDS] = (lines, parsed)
    progress = Progress(sum(1 for _, parsed in logs.values() for r in parsed if r is not None and _winner(r)))
    measure, checked, demoted = LocalMeasurer(), 0, 0
    for path, (lines, parsed) in logs.items():
        for i, rec in enumerate(parsed):
            if rec is None or not _winner(rec):
                continue
            key = KernelKey.from_json(rec["key"])
            progress.step(workload_label(key))
            demoted += _recheck_one(key, rec, measure, rounds)
            checked += 1
            lines[i] = json.dumps(rec, sort_keys=True)
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(ln + "\n" for ln in lines if ln.strip()))
        tmp.replace(path)
    progress.done()
    tuning.refresh()
    return checked, demoted


def _recheck_one(key: KernelKey, rec: dict, measure, rounds: int) -> bool:
    """Re-time one winning record in place (``rec`` updated, marked rechecked); True if it was demoted."""
    defaults = Decisions()
    dispatch.schedule(key, defaults)
    t_best, t_def = confirm(key, measure, compile_module(key, dispatch.schedule(key, Decisions(rec["decisions"]))),
                            compile_module(key, dispatch.schedule(key, defaults)), measure.args(key), rounds)
    rec["rechecked"] = True
    if t_best > t_def * (1.0 - CONFIRM_MARGIN):
        rec.update(decisions=defaults.used, time_s=t_def, default_time_s=t_def)
        return True
    rec.update(time_s=t_best, default_time_s=t_def)
    return False


def workload_label(key: KernelKey) -> str:
    """A readable one-line name: ``causal_conv1d.fwd f32 dim=1536 width=4 silu bias | batch=1 seqlen=512``
    (flags that are off and the target are left out: one run tunes one target)."""
    dts = sorted(set(dict(key.dtypes).values()))
    short = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64"}
    words = ["/".join(short.get(d, d) for d in dts)] if dts else []
    for name, value in key.static_dims:
        if value is True:
            words.append(name[4:] if name.startswith("has_") else name)
        elif value not in (False, None):
            words.append(str(value) if name == "activation" else f"{name}={value}")
    bucket = " ".join(f"{k}={v}" for k, v in key.shape_bucket)
    return f"{key.op}.{key.direction} {' '.join(words)}" + (f" | {bucket}" if bucket else "")


class Progress:
    """Progress over ``total`` workloads, optionally within ``budget_s``: the count shown is what will be
    done (``total``, or fewer when the mean time per workload so far says the budget runs out first). On a
    terminal one bar redrawn in place, else (a log file, CI) one plain line per workload."""

    def __init__(self, total: int, budget_s: float | None = None, stream=None):
        self.total, self.budget_s, self.done_n = total, budget_s, 0
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = time.perf_counter()

    def planned(self) -> int:
        """Workloads that will be started: each starts while the budget is not yet spent."""
        elapsed = time.perf_counter() - self.t0
        if self.budget_s is None or not self.done_n:
            return self.total
        left = max(self.budget_s - elapsed, 0.0)
        return min(self.total, self.done_n + math.ceil(left / (elapsed / self.done_n)))

    def step(self, label: str) -> None:
        """Workload ``done_n + 1`` (named ``label``) starts."""
        self._show(self.done_n, label)
        self.done_n += 1

    def _show(self, i: int, label: str) -> None:
        n, elapsed = self.planned(), time.perf_counter() - self.t0
        eta = elapsed / i * (n - i) if i else 0.0
        of = f" (of {self.total} to do)" if n < self.total else ""
        if self.tty:
            bar = "#" * int(30 * i / max(n, 1))
            self.stream.write(f"\r[{bar:<30}] {i}/{n}{of}  elapsed {elapsed:5.0f}s  eta {eta:5.0f}s  {label[:70]:<70}")
        else:
            self.stream.write(f"tune: [{i + 1}/{n}{of}] {label}  (elapsed {elapsed:.0f}s, eta {eta:.0f}s)\n")
        self.stream.flush()

    def done(self) -> None:
        if self.tty:
            self._show(self.done_n, "done")
            self.stream.write("\n")
        self.stream.flush()


def run(ops, preset="default", seqlens=SEQLENS, batches=BATCHES, trials=8, budget_s=3600.0,
        out: str | None = None, rpc_tracker: str | None = None, rpc_key: str | None = None,
        target=None, directions=None) -> pathlib.Path:
    target = target or cpu_target()
    dev = tuning.device_key(target_key(target))
    folder = pathlib.Path(out or tuning.logs_dir()) / dev
    keys = workloads(ops, target, preset, seqlens, batches, directions)
    done = tuning.recorded_keys(folder)
    todo = [k for k in keys if k not in done]
    tuning.write_meta(folder, dev, {"trials_per_workload": trials, "budget_s": budget_s, "workloads": len(keys),
                                    "rpc": bool(rpc_tracker)})
    measure = RPCMeasurer(rpc_tracker, rpc_key) if rpc_tracker else LocalMeasurer()
    print(f"tune: {len(keys)} workloads for {dev} ({len(keys) - len(todo)} already recorded) -> {folder}",
          flush=True)
    progress = Progress(len(todo), budget_s)
    for i, key in enumerate(todo):
        if time.perf_counter() - progress.t0 > budget_s:
            print(f"\ntune: budget of {budget_s:.0f}s spent; {len(todo) - i} workloads left (rerun to resume)")
            break
        progress.step(workload_label(key))
        t_key = time.perf_counter()
        try:
            best, t_best, t_default, n, source = tune_one(key, measure, trials, folder)
        except Exception as err:  # noqa: BLE001 - one bad workload must not stop the run
            print(f"\ntune: skipped {workload_label(key)}: {type(err).__name__}: "
                  f"{(str(err).strip().splitlines() or [''])[-1][:200]}")
            continue
        tuning.append_record(folder, key, best, t_best, t_default, n, tune_s=round(time.perf_counter() - t_key, 1),
                             source=source)
    progress.done()
    return folder
