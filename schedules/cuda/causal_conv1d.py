"""CUDA schedule for the causal_conv1d kernels (TE compute from tvm_mamba/compute/causal_conv1d/__init__.py).

Forward: one block per (batch, channel) row and tile of ``tile`` time steps (blockIdx.x = row, blockIdx.y =
tile). The block first stages in shared memory what its outputs read from global memory: the tile's window
of x with its width-1 halo (the left neighbour's last inputs, or the initial states / zeros before t = 0),
the row's weights, bias and initial states. Each global input is then requested once, plus (width-1) / tile
for the halo, instead of width times (every tap re-loading x: 5.5x the forward's minimum bytes before). The
copies are cooperative (consecutive threads on consecutive time steps: a warp's requests fill whole 128-byte
lines); a thread then computes tile / threads outputs ``threads`` apart (conflict-free shared reads,
coalesced stores), its accumulator in a register. A staged time axis is a ring indexed by time mod a power
of two, so its shared size is static with a symbolic seqlen (see _stage).

Backward: one pass per (batch, channel) row (blockIdx.x = row), walking the row in tiles. Per tile the block
stages x with both width-1 halos, computes grad = dout * act'(pre) for the tile and the width-1 steps after
it into a shared ring (pre from the staged x, in a register), writes the tile's g (the workspace output),
dx from the staged grad (its forward halo included), and adds g * x and g to each thread's (width+1)
register sums: stage 1 of dweight / dbias. The g, dx and sum loop nests are merged row by row and tile by
tile (s_tir merge), grad computed at the merged tile loop, so x, dout, g and dx move once each. After the
row a fixed shuffle tree sums the thread slots; stage 2 sums the rows over batch in order. No atomics.
(Three kernels before, with g written, then read by dx and again, with x, by the sums: 1.78x the minimum.)

The decode step (causal_conv1d_update) is the loop-nest template of compute/causal_conv1d/update.py laid
out as one thread per (batch, channel) row, as upstream's kernel.

Knobs: ``threads`` per block (64, 128, 256, 512; default 256); ``tile`` time steps per tile (512, 1024;
default 1024, whose halo adds 0.3% at width 4). Both are MetaSchedule-samplable: the split factors take
the samples, and the rings are sized for the largest tile when the knobs are samples.
"""
from __future__ import annotations

import tvm
from tvm import s_tir

from ..rule import Decisions, schedule_compute, schedule_of
from ...compute.causal_conv1d.update import update_template
from ...compute.causal_conv1d import KERNELS
from ._common import bind_flat, schedule_acc_chain
from ._strategy import CUDA_SHARED_BYTES, GpuCaps, GpuStrategy

# Inputs a tile reads through its window or per output, staged once per block (the backward stages x per
# tile and the rest per row, _bwd). Not staged: seq_idx (an
# initial state carries position 0's id, so its read region spans the row's whole prefix) and dfinal (read
# at a clamped index TVM cannot bound: the copy would be sized 2^31 - 1); both are read per tap / output.
STAGED = ("x", "weight", "bias", "initial_states")
THREADS = (64, 128, 256, 512)
# time steps per tile (a multiple of every threads value); 2048 would need rings of 4096: 32 KB of the
# backward's shared memory (x and g rings in fp32), fewer blocks per SM
TILES = (512, 1024)


def _stage(sch: s_tir.Schedule, block, at, threads: int, window: int, names=STAGED) -> None:
    """cache_read every global input of ``block`` named in ``names`` into shared memory at loop ``at`` (the
    block's tile), loaded cooperatively: the copy's loops fused, split over ``threads`` on threadIdx.x.
    compute_at clips each copy to the tile's window and the buffer's extent (a predicate, no OOB reads).

    Every copy is one row: indexed by its last axis only (the block's batch / channel are fixed), and a
    symbolic time axis as a ring of ``window`` (a power of two >= the tile and its halos) indexed by time mod
    ``window``: injective over one tile's window, and a static shared size.
    (TVM 0.27's CompactBufferAllocation cannot size a stage clipped against a symbolic seqlen: it fails with
    "Literal value 2147483648 exceeds range of int32".)"""
    names = [rg.source.name for rg in sch.get(block).reads if rg.source.scope() == "global" and rg.source.name in names]
    for name in dict.fromkeys(names):
        _stage_shared(sch, [block], name, at, threads, window)


def threads_inner(sch: s_tir.Schedule, loop, threads: int) -> None:
    """Split ``loop`` by ``threads`` and bind the inner part to threadIdx.x (the outer part stays serial)."""
    _, tx = sch.split(loop, factors=[None, threads])
    sch.bind(tx, "threadIdx.x")


def _window(tile: int, width: int) -> int:
    """Ring size of a staged time axis: the smallest power of two >= the tile and both width-1 halos."""
    return 1 << (tile + 2 * (width - 1) - 1).bit_length()


def split_tile(sch: s_tir.Schedule, loop, tile, threads):
    """``loop`` (time) split into (tile, step, thread): ``tile`` steps a tile, a thread's steps ``threads``
    apart (tile / threads of them). Knob values may be MetaSchedule samples (ExprRV)."""
    to, rest = sch.split(loop, factors=[None, tile])
    v, tx = sch.split(rest, factors=[None, threads])
    return to, v, tx


def tile_rows(sch: s_tir.Schedule, block, threads, tile):
    """Lay ``block`` (loops batch, channel, time) out as blockIdx.x = (batch, channel) row, blockIdx.y = tile
    of ``tile`` steps, threadIdx.x within it. Returns (tile loop, thread loop)."""
    b, c, t = sch.get_loops(block)
    row = sch.fuse(b, c)
    tile, _, tx = split_tile(sch, t, tile, threads)
    sch.bind(row, "blockIdx.x")
    sch.bind(tile, "blockIdx.y")
    sch.bind(tx, "threadIdx.x")
    return tile, tx


def _fwd(sch: s_tir.Schedule, threads, tile, window: int) -> None:
    """The conv accumulator in a register inside the thread of its elementwise consumer ``out``, both blocks'
    global inputs staged per tile (see the module docstring); final_states a thread per element."""
    out = sch.get_sblock("out")
    tile, tx = tile_rows(sch, out, threads, tile)
    acc = sch.get_sblock("conv_acc")
    sch.compute_at(acc, tx)
    sch.set_scope(acc, 0, "local")
    _stage(sch, acc, tile, threads, window)
    _stage(sch, out, tile, threads, window)
    bind_flat(sch, sch.get_sblock("final_states"), threads)


def _row_tiles(sch: s_tir.Schedule, block, tile, threads):
    """``block``'s loops (batch, channel, time) as (row, tile, step, thread): the row fused, time split by
    split_tile. Returns the row loop; nothing bound yet (the rows are merged first)."""
    b, c, t = sch.get_loops(block)
    split_tile(sch, t, tile, threads)
    return sch.fuse(b, c)


def _sums(sch: s_tir.Schedule, tile, threads):
    """Stage 1 of dweight / dbias laid out like the pass's outputs: the time reduction split into (tile, step,
    thread) and rfactored on the thread, so each thread adds to its own (width+1) sums in registers. Returns
    the rfactored block, its loops (row, tile, step, thread, slot)."""
    blk = sch.get_sblock("partial")
    _, _, _, t = sch.get_loops(blk)
    _, _, tx = split_tile(sch, t, tile, threads)
    rf = sch.rfactor(tx, factor_axis=2)  # loops (batch, channel, kk, tile, step, thread); keeps t < seqlen
    b, c, kk, to, v, tx = sch.get_loops(rf)
    sch.fuse(b, c)
    sch.reorder(to, v, tx, kk)
    sch.set_scope(rf, 0, "local")  # a thread reads back only its own slots (the tree shuffles them)
    sch.unroll(kk)  # the slots stay in registers: every index into them a constant
    return rf


def _ring(sch: s_tir.Schedule, block, window: int) -> None:
    """The shared buffer ``block`` writes indexed by time mod ``window`` (see _stage)."""
    sch.transform_layout(block, ("write", 0), lambda *idx: (tvm.tirx.floormod(idx[-1], window),),
                         assume_injective_transform=True)


def _cooperative(sch: s_tir.Schedule, block, at, threads) -> None:
    """``block``'s loops under ``at`` fused and split over ``threads`` (consecutive threads on consecutive
    steps). A one-element copy (the bias) gets a unit loop first, so that thread 0 alone writes it: without a
    loop to bind, every thread would store the same word (a write-write race, racecheck's and the harness's)."""
    loops = sch.get_loops(block)
    depth = next(j for j, lp in enumerate(loops) if sch.get(lp).same_as(sch.get(at)))
    loops = loops[depth + 1:]
    if not loops:
        loops = [sch.add_unit_loop(block)]
    threads_inner(sch, sch.fuse(*loops) if len(loops) > 1 else loops[0], threads)


def _stage_shared(sch: s_tir.Schedule, consumers: list, name: str, at, threads, window: int) -> None:
    """One shared copy of the global input ``name`` at loop ``at`` for every block in ``consumers`` that
    reads it (a ring of ``window`` when its last axis is symbolic), loaded cooperatively."""
    readers = [b for b in consumers if any(rg.source.name == name for rg in sch.get(b).reads)]
    if not readers:
        return
    idx = next(i for i, rg in enumerate(sch.get(readers[0]).reads) if rg.source.name == name)
    buf = sch.get(readers[0]).reads[idx].source
    cache = sch.cache_read(readers[0], idx, "shared", consumer_blocks=readers)
    sch.compute_at(cache, at)
    if not isinstance(buf.shape[-1], tvm.tirx.IntImm):
        _ring(sch, cache, window)
    else:
        sch.transform_layout(cache, ("write", 0), lambda *idx: (idx[-1],), assume_injective_transform=True)
    _cooperative(sch, cache, at, threads)


def _small(sch: s_tir.Schedule, threads: int) -> None:
    """dinit, dweight, dbias (and their register accumulators): one thread per element."""
    for name in ("dinit", "dweight", "dbias"):
        blk = sch.get_sblock(name)
        tx = bind_flat(sch, blk, threads)
        for producer in sch.get_producers(blk):
            if sch.get(producer).name_hint.endswith("_acc"):
                sch.compute_at(producer, tx)
                sch.set_scope(producer, 0, "local")


def _bwd(sch: s_tir.Schedule, threads, tile, window: int) -> None:
    """One pass per (batch, channel) row: a block walks the row in tiles and, per tile, stages x (with both
    width-1 halos), computes grad = dout * act'(pre) for the tile and the width-1 steps after it into a shared
    ring (pre in a register, from the staged x), writes the tile's g (the workspace output), dx from the
    staged grad, and adds g * x and g to each thread's (width+1) register sums (stage 1 of dweight / dbias).
    The three loop nests (g, dx, the sums) are merged row by row and tile by tile, grad computed at the merged
    tile loop. After the row, a fixed shuffle tree sums the thread slots; stage 2 sums rows over batch in order.
    x, dout, g and dx move once each (plus the halos); no atomics."""
    rows = [_row_tiles(sch, sch.get_sblock(n), tile, threads) for n in ("g", "dx")]
    rf = _sums(sch, tile, threads)
    row = sch.merge(*rows, sch.get_loops(rf)[0])
    blocks = [sch.get_sblock("g"), sch.get_sblock("dx"), rf]
    tile_loop = sch.merge(*[sch.get_loops(b)[1] for b in blocks])
    sch.bind(row, "blockIdx.x")
    for blk in blocks:
        sch.bind(sch.get_loops(blk)[3], "threadIdx.x")
    dx_acc = sch.get_sblock("dx_acc")
    sch.compute_at(dx_acc, sch.get_loops(sch.get_sblock("dx"))[3])
    sch.set_scope(dx_acc, 0, "local")
    grad = sch.get_sblock("grad")
    sch.compute_at(grad, tile_loop)  # the tile's steps and the width-1 after it (dx's forward halo)
    sch.set_scope(grad, 0, "shared")
    _ring(sch, grad, window)
    _cooperative(sch, grad, tile_loop, threads)
    readers = [rf, dx_acc, grad]
    if any(rg.source.name == "pre_acc" for rg in sch.get(grad).reads):  # (no pre-activation without SiLU)
        pre = sch.get_sblock("pre_acc")
        sch.compute_at(pre, sch.get_loops(grad)[-1])
        sch.set_scope(pre, 0, "local")
        readers.append(pre)
    for name in ("weight", "bias", "initial_states"):  # once per row
        _stage_shared(sch, readers, name, row, threads, window)
    _stage_shared(sch, readers, "x", tile_loop, threads, window)  # once per tile, for pre and the sums
    init = sch.decompose_reduction(rf, tile_loop)  # every slot zeroed before the tiles
    sch.unroll(sch.get_loops(init)[-1])
    blk = sch.get_sblock("partial")
    sch.reverse_compute_at(blk, row)  # the cross-thread sum over the thread slots, in a fixed tree order
    tx, kk = sorted(sch.get_loops(blk)[1:], key=lambda lp: -int(sch.get(lp).extent))
    sch.reorder(kk, tx)
    sch.bind(tx, "threadIdx.x")
    _small(sch, threads)


def lay_out(kernel: str, dims, target, decisions: Decisions):
    """The TE kernels scheduled (fwd, bwd: the tiles above; varlen_states: a thread per output), the decode
    step a template; None for another kernel or target."""
    if "gpu" not in target.keys or kernel not in KERNELS:
        return None
    name = f"causal_conv1d_{kernel}"
    caps = GpuCaps.of(target)
    dims = caps.storable(dims)  # 32-bit buffers where the target has no others (WebGPU)
    threads = decisions.pick("threads", caps.threads(THREADS), 256)
    if kernel == "update":  # a loop-nest template: one thread per (batch, channel) row
        return schedule_of(update_template(dims, GpuStrategy(threads)), name)
    sch = schedule_compute(KERNELS[kernel](dims), name)
    if kernel in ("fwd", "bwd"):
        layout = _fwd if kernel == "fwd" else _bwd
        # the backward's x and grad rings: 2 x 8 KB at tile 1024, over WebGPU's default 16 KB with the row's
        # weights; 512 where the target has less than CUDA's 48 KB
        tile = decisions.pick("tile", TILES, 1024 if caps.shared_bytes >= CUDA_SHARED_BYTES else 512)
        # the ring holds the tile and its halos; a MetaSchedule sample (ExprRV) may replay with any tile
        window = _window(tile if isinstance(tile, int) else max(TILES), dims.width)
        layout(sch, threads, tile, window)
    else:
        schedule_acc_chain(sch, threads)
    return sch
