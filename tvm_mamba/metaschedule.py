"""MetaSchedule design spaces from the hand rules (block-scheduled kernels, i.e. the CUDA rules).

``design_space(key)`` wraps a rule in ``ms.space_generator.ScheduleFn``: the rule runs on MetaSchedule's
schedule with ``SampledDecisions``, so every ``decisions.pick`` becomes a ``sample_categorical`` whose
initial decision is the hand default. MetaSchedule needs static shapes: the key's bucket fixes batch and
seqlen. ``sample_candidates`` draws candidates with MetaSchedule's replay-trace search;
``decisions_of(trace, picks)`` turns a candidate's trace back into knob values, which is what the
tuning logs, candidate packs and the dispatcher use (so MetaSchedule-found and measured-template records
are one format). Measuring CUDA candidates needs a GPU: through a TVM RPC tracker
(``ms.runner.RPCRunner``) or the runtime-only candidate round (candidates.py).
"""
from __future__ import annotations

import tvm
from tvm.s_tir import meta_schedule as ms

from .runtime import KernelKey, dispatch
from .runtime.target import target_from_key
from .schedules.rule import SampledDecisions, on_schedule


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
    picks: list[tuple[str, tuple]] = []

    def sch_fn(sch):
        d = SampledDecisions(sch)
        with on_schedule(sch):
            out = rules.apply(sch.mod["main"], target, d) if rules is not None else None
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
