"""Shared CUDA scheduling steps for TE kernels made of elementwise blocks and small reductions."""
from __future__ import annotations

from tvm import s_tir


def spatial_loop_count(sch: s_tir.Schedule, block) -> int:
    """Number of leading data-parallel block iters (TE puts spatial axes before reduce axes)."""
    return sum(1 for iv in sch.get(block).iter_vars if int(iv.iter_type) == 0)


def bind_flat(sch: s_tir.Schedule, block, threads: int):
    """Fuse the block's spatial loops, split by ``threads`` and bind blockIdx.x / threadIdx.x: one thread per
    output element, consecutive threads on consecutive innermost (time) positions, so loads coalesce.
    Reduction loops stay serial inside the thread. Returns the threadIdx loop."""
    loops = sch.get_loops(block)[: spatial_loop_count(sch, block)]
    return threads_over(sch, sch.fuse(*loops) if len(loops) > 1 else loops[0], threads)


def threads_over(sch: s_tir.Schedule, loop, threads: int):
    """Split ``loop`` by ``threads``: blocks on blockIdx.x, ``threads`` per block on threadIdx.x (one thread
    per iteration). Returns the threadIdx loop."""
    bx, tx = sch.split(loop, factors=[None, threads])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    return tx


def schedule_acc_chain(sch: s_tir.Schedule, threads: int, acc_suffix: str = "_acc") -> None:
    """Bind every block; blocks named ``*_acc`` (register accumulators of a small reduction) are computed
    inside the thread of their consumer, in local scope."""
    root = sch.get_sblock("root")
    blocks = sch.get_child_blocks(root)
    names = [sch.get(b).name_hint for b in blocks]
    accs = [b for b, n in zip(blocks, names) if n.endswith(acc_suffix)]
    others = [b for b, n in zip(blocks, names) if not n.endswith(acc_suffix)]
    thread_loop = {}
    for b in others:
        thread_loop[sch.get(b).name_hint] = bind_flat(sch, b, threads)
    for a in accs:
        consumers = sch.get_consumers(a)
        consumer_name = sch.get(consumers[0]).name_hint
        sch.compute_at(a, thread_loop[consumer_name])
        sch.set_scope(a, 0, "local")
