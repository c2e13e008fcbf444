"""MetaSchedule design spaces from the hand rules (block-scheduled kernels, i.e. the CUDA rules).

``design_space(key)`` wraps a rule in ``ms.space_generator.ScheduleFn``: the rule runs on MetaSchedule's
schedule with ``SampledDecisions``, so every ``decisions.pick`` becomes a ``sample_categorical`` whose
initial decision is the hand default. MetaSchedule needs static shapes: the key's bucket fixes batch and
seqlen. ``sample_candidates`` draws candidates with MetaSchedule's replay-trace search;
``decisions_of(trace, picks)`` turns a candidate's trace back into knob values, which is what the
tuning logs, candidate packs and the dispatcher use (so MetaSchedule-found and measured-template records
are one format). Measuring CUDA candidates needs a GPU: through a TVM RPC tracker
(``ms.runner.RPCRunner``) or the runtime-only candidate round (candidates.py).

``search(key, folder, trials, runner)`` is the tuner's path for block-scheduled kernels: ``ms.tune_tir`` over
the rule's design space with MetaSchedule's builder and runner (local, or ``RPCRunner`` through a tracker),
its trials appended to the op's JSONDatabase (``database_workload.json`` / ``database_tuning_record.json``
beside the knob records), and the best trace's knob values returned. ``commit_trials`` writes trials measured
elsewhere (the runtime-only GPU round) into the same database. ``replay`` builds a database record the
MetaSchedule way (``compile_tir``: the trace applied to the bucket's static PrimFunc).
"""
from __future__ import annotations

import logging

import tvm
from tvm.s_tir import meta_schedule as ms

from ..runtime import KernelKey, dispatch
from ..runtime.target import target_from_key
from ..schedules.rule import Decisions, SampledDecisions, on_schedule
from ..schedules.rule import watch as rule_watch

WORKLOADS, TRIALS = "database_workload.json", "database_tuning_record.json"
BUILD_TIMEOUT_S = 120.0  # per candidate build, in MetaSchedule's builder process (its default is 30 s)


def static_func(key: KernelKey) -> tvm.tirx.PrimFunc:
    """The key's PrimFunc with its symbolic dims bound to the bucket's values (batch 1 if unbucketed)."""
    func = dispatch.build_func(key)
    bucket = dict(key.shape_bucket)
    binds = {}
    for p in func.params:
        if any(isinstance(d, tvm.tirx.Var) for d in p.shape):
            shape = [bucket.get(d.name, 1) if isinstance(d, tvm.tirx.Var) else int(d) for d in p.shape]
            binds[p] = tvm.tirx.decl_buffer(shape, str(p.dtype), name=p.name)
    return func.specialize(binds) if binds else func


def design_space(key: KernelKey):
    """(space generator, picks list) for a key whose rule is written with sblocks; picks fills with the
    knob names in sampling order when the space is generated."""
    target = target_from_key(key.target)
    rules = dispatch.rule_module(target, key.op)
    dims = dispatch.dims_of(key)
    picks: list[tuple[str, tuple]] = []

    def sch_fn(sch):
        d = SampledDecisions(sch)
        with on_schedule(sch):
            out = rules.lay_out(key.direction, dims, target, d)
        if out is None:
            raise ValueError(f"no schedule rule applies to {key}")
        picks[:] = [(n, d.space[n]) for n in d.order]
        return out

    return ms.space_generator.ScheduleFn(sch_fn, sch_rules=[], postprocs=[], mutator_probs={}), picks


def decisions_of(trace, picks) -> dict:
    """Knob values of a sampled trace (SampleCategorical decisions, in pick order)."""
    values = []
    for inst in trace.insts:
        if inst.kind.name == "SampleCategorical":
            values.append(int(inst.attrs[0][int(trace.decisions[inst])]))
    return {name: v for (name, _), v in zip(picks, values)}


def sample_candidates(key: KernelKey, n: int, seed: int = 0) -> list[dict]:
    """Up to n distinct knob settings drawn from the MetaSchedule space (the default first)."""
    target = target_from_key(key.target)
    gen, picks = design_space(key)
    mod = tvm.IRModule({"main": static_func(key).with_attr("global_symbol", "main")})
    ctx = ms.TuneContext(mod=mod, target=target, space_generator=gen, search_strategy="replay-trace",
                         task_name=key.slug(), rand_state=seed, num_threads=1)
    spaces = ctx.generate_design_space()
    default = decisions_of(spaces[0].trace, picks)
    ctx.pre_tuning(max_trials=2 * n, num_trials_per_iter=2 * n, design_spaces=spaces,
                   database=ms.database.MemoryDatabase(), cost_model=ms.cost_model.RandomModel())
    out = [default]
    for cand in ctx.generate_measure_candidates() or []:
        d = decisions_of(cand.sch.trace, picks)
        if d not in out:
            out.append(d)
        if len(out) >= n:
            break
    ctx.post_tuning()
    return out


def block_scheduled(key: KernelKey) -> bool:
    """Whether the key's rule schedules the compute definition's blocks (``schedule_compute``), i.e. is a
    MetaSchedule design space (a template laid out is built from integer knobs and is not)."""
    target = target_from_key(key.target)
    with rule_watch() as seen:
        out = dispatch.rule_module(target, key.op).lay_out(key.direction, dispatch.dims_of(key), target, Decisions())
    return out is not None and bool(seen.block)


def _module(key: KernelKey) -> tvm.IRModule:
    return tvm.IRModule({"main": static_func(key).with_attr("global_symbol", "main")})


def _line_ok(kind: str, obj, n_workloads: int) -> bool:
    if kind == WORKLOADS:
        return isinstance(obj, list) and len(obj) == 2 and all(isinstance(v, str) for v in obj)
    return (isinstance(obj, list) and len(obj) == 2 and isinstance(obj[0], int) and 0 <= obj[0] < n_workloads
            and isinstance(obj[1], list) and len(obj[1]) == 4)


def _sanitize(folder) -> None:
    """Drop lines MetaSchedule's loader would die on (a line cut by an interrupted run, foreign text), with
    a warning naming the file: JSONDatabase raises on the first bad line and would lose the whole file."""
    import json
    import warnings

    n_workloads = 0
    for kind in (WORKLOADS, TRIALS):
        path = folder / kind
        if not path.exists():
            continue
        lines = path.read_text(errors="replace").splitlines()
        good = []
        for line in lines:
            try:
                ok = line.strip() and _line_ok(kind, json.loads(line), n_workloads)
            except ValueError:
                ok = False
            if ok:
                good.append(line)
        dropped = len([ln for ln in lines if ln.strip()]) - len(good)
        if dropped:
            warnings.warn(f"tvm_mamba: dropped {dropped} malformed line(s) of MetaSchedule "
                          f"database {path}", RuntimeWarning, stacklevel=3)
            tmp = path.with_suffix(".json.tmp")
            tmp.write_text("".join(ln + "\n" for ln in good))
            tmp.replace(path)
        if kind == WORKLOADS:
            n_workloads = len(good)


def database(folder) -> "ms.database.JSONDatabase":
    """The op folder's MetaSchedule JSONDatabase (append-only; created if missing). Malformed lines are
    dropped first; a file MetaSchedule still cannot load is moved aside (``*.bad``), both with a warning."""
    import pathlib
    import warnings

    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    _sanitize(folder)
    paths = dict(path_workload=str(folder / WORKLOADS), path_tuning_record=str(folder / TRIALS))
    try:
        return ms.database.JSONDatabase(**paths)
    except Exception as err:  # noqa: BLE001 - TVM raises a bare RuntimeError for any parse failure
        for kind in (WORKLOADS, TRIALS):
            if (folder / kind).exists():
                (folder / kind).replace(folder / f"{kind}.bad")
        warnings.warn(f"tvm_mamba: MetaSchedule database in {folder} could not be loaded ({str(err)[-120:]}); "
                      f"moved aside to *.bad, starting a new one", RuntimeWarning, stacklevel=2)
        return ms.database.JSONDatabase(**paths)


def _build_in_target(mod, target, _params):
    """MetaSchedule's default build (a runtime Module it can export) inside the target's scope (the CUDA
    rules read it), without the default's import of every vendor's tensor intrinsics."""
    from tvm.driver import build as tvm_build

    with target:
        return tvm_build(mod, target=target)


def _log_tail(work: str, lines: int = 30) -> str:
    """The last lines of MetaSchedule's task logs under ``work`` (where it writes build/run errors)."""
    import pathlib

    text = [ln for f in sorted(pathlib.Path(work).glob("logs/*task_*.log")) for ln in f.read_text().splitlines()]
    return "\n".join(text[-lines:])


def search(key: KernelKey, folder, trials: int, runner="local", seed: int = 0) -> tuple[dict, int]:
    """MetaSchedule tuning of one block-scheduled workload at its bucket's static shape: (knob values of the
    best measured trace, trials in the database for it). Trials go to ``folder``'s JSONDatabase."""
    import tempfile

    target = target_from_key(key.target)
    gen, _ = design_space(key)
    mod = _module(key)
    db = database(folder)
    # our f_build for every target: MetaSchedule's default one imports tvm.s_tir.tensor_intrin (every
    # vendor's tensor intrinsics, ~20 s of TVMScript parsing) in each fresh builder process, which alone
    # nears the builder's default 30 s timeout and turns a loaded machine's trials invalid
    builder = ms.builder.LocalBuilder(f_build=_build_in_target, timeout_sec=BUILD_TIMEOUT_S)
    logging.getLogger("tvm.s_tir.meta_schedule").setLevel(logging.WARNING)  # its per-round tables
    with tempfile.TemporaryDirectory() as work:  # MetaSchedule's text logs; the records go to db
        ms.tune_tir(mod, target, work_dir=work, max_trials_global=trials, num_trials_per_iter=trials,
                    space=gen, strategy="replay-trace", database=db, builder=builder, runner=runner,
                    cost_model="random", num_tuning_cores=1, seed=seed)
        records = db.get_top_k(db.commit_workload(mod), 1 << 20)
        if not records:
            raise RuntimeError(f"MetaSchedule measured no valid trial for {key}; its log ends:\n"
                               + _log_tail(work))
    return knobs_of(key, records[0].trace), len(records)


def _space(key: KernelKey):
    """(static module, the design space's first schedule, picks in sampling order)."""
    gen, picks = design_space(key)
    mod = _module(key)
    space = ms.TuneContext(mod=mod, target=target_from_key(key.target), space_generator=gen, task_name=key.slug(),
                           num_threads=1).generate_design_space()[0]
    return mod, space, picks


def knobs_of(key: KernelKey, trace) -> dict:
    """Knob values of a trace of the key's design space (e.g. a JSONDatabase record's)."""
    return decisions_of(trace, _space(key)[2])


def trace_of(key: KernelKey, values: dict):
    """(module, trace) of the rule's design space with its categorical decisions set to ``values``."""
    mod, space, picks = _space(key)
    trace, names = space.trace, iter(n for n, _ in picks)
    for inst in list(trace.insts):
        if inst.kind.name == "SampleCategorical":
            name = next(names)
            cands = [int(c) for c in inst.attrs[0]]
            trace = trace.with_decision(inst, tvm.tirx.IntImm("int64", cands.index(int(values[name]))), True)
    return mod, trace


def commit_trials(key: KernelKey, folder, trials) -> None:
    """Record trials measured elsewhere (e.g. on a GPU with the runtime only), ``[(knob values, seconds)]``,
    in the op's database (opened once)."""
    target = target_from_key(key.target)
    db = database(folder)
    for values, time_s in trials:
        mod, trace = trace_of(key, values)
        args = ms.arg_info.ArgInfo.from_prim_func(mod["main"])
        db.commit_tuning_record(ms.database.TuningRecord(trace, db.commit_workload(mod), [float(time_s)], target,
                                                         args))


def replay(key: KernelKey, folder):
    """(scheduled static module, TuningRecord) of the database's best record for ``key``, rebuilt the
    MetaSchedule way (the trace applied to the bucket's PrimFunc); LookupError if there is none."""
    target = target_from_key(key.target)
    mod = _module(key)
    db = database(folder)
    rec = db.query_tuning_record(mod, target, workload_name="main") if db.has_workload(mod) else None
    if rec is None:
        raise LookupError(f"no MetaSchedule record for {key} in {folder}")
    return db.query_schedule(mod, target, workload_name="main").mod, rec
