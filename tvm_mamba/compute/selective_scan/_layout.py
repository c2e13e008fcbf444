"""How the scan templates' loops land on a machine: the strategy contract, and the serial layout.

A template writes each kernel once over abstract loops and asks its ``Layout`` how to lay them out:

- **lanes** (one lane = one (batch, channel), or (batch, channel block) in the backward):
  ``lane_outer(total)`` / ``lane_inner()`` are the two loops, ``lane_guard`` the bounds test wrapping the
  lane's body (Python True when every thread must run it, e.g. to join a warp shuffle), ``lane_of`` the
  lane index, ``lane_ok`` the predicate guarding the lane's writes, ``thread(li)`` this thread's index
  within its lane (0 when a lane is one thread);
- **dstate**: a lane's states n are visited as ``for ko in st_outer(N): for ki in st_inner():`` with
  ``n = state(ko, ki, j)``; lane-local state buffers have ``regs(N)`` entries indexed ``reg(ko, ki)``
  (all N on one thread; N / W on each of W warp threads), vector partials of a dstate sum have ``V`` entries
  indexed ``ki``;
- **channels** (forward): a lane is one batch row and ``chans`` consecutive channels (1, or a vector of
  channels when the layout's vector axis is channels instead of dstate), visited by ``chan_loop()``;
  ``stage_params`` copies A and a time-invariant B / C into the lane, ``y_from_skip`` starts y's partial
  from D u;
- **sums over dstate**: the macros ``reduce(dst, i, parts, row)`` (dst[i] = the sum of the partials
  parts[row, :] over the lane, in the layout's order) and ``reduce_plus(dst, i, parts, row, init)`` (plus ``init``,
  in the order the layout's kernels always used: first on a CPU vector, last after a warp butterfly),
  ``reduce2(dst, i0, i1, parts)`` (dst[i0], dst[i1] = the sums of parts[0, :], parts[1, :], side by side);
  ``reduce_plus_lead(dst, i, parts, row, init, lead)`` (reduce_plus, where only the lane's thread ``lead``
  needs the init added: a warp adds it there alone);
- **lane-uniform values**: ``uniform(dst, i, value, j)`` sets dst[i] = value on every thread of the lane
  (a warp lane: thread 0 computes and loads, a shuffle broadcasts, so a row's scalars are requested once);
- **time**: ``time_batched`` True computes each checkpoint chunk's per-step scalars (softplus, SiLU: two
  exps each) in loops vectorized over ``tvec`` steps into chunk buffers before the serial scan, and the
  outputs after it; False computes them inline in the step (registers are scarce on a GPU thread);
- **heads** (decode step with ``tie_hdim``): a lane runs ``head_rows`` consecutive rows of one head (None:
  all headdim of them) after computing the head's dt' and exp(dt' A) once (an untied lane is one row);
  ``stage_bc`` loads the lane's B / C states once into lane-local buffers for its rows;
- ``math`` (a ``compute._math.Math``: polynomial or native exp), ``scope`` of lane-local buffers,
  ``nchunk(seqlen, chunk)`` (the checkpoint count: an expression, or a free var bound by the buffer).

``Layout`` itself is the serial layout (tests, the unscheduled PrimFunc dispatch gets); the CPU layout
(parallel lanes, vectorized loops) and the CUDA one (blocks x threads, warp-split dstate, shuffle sums)
live with their rules in schedules/cpu/selective_scan.py and schedules/cuda/selective_scan.py.
"""
from __future__ import annotations

from tvm.script import tirx as T

from .._math import Math


class Layout:
    """Serial lanes, serial dstate loop of ``vec`` (1: scalar) per step, lane-local buffers in ``scope``."""

    time_batched = True
    chans = 1  # channels per forward lane (the CPU's channels layout: a vector of them)
    stage_params = False  # forward: copy A and a time-invariant B / C into the lane once (transposed)
    y_from_skip = False  # forward: y's partial starts from D u (one partial per channel), not 0 + D u after
    head_rows = None  # tied decode step: rows of one head per lane, sharing its softplus / exp (None: all)
    stage_bc = False  # decode step: a lane loads its B / C states once into lane-local buffers (its rows reuse them)

    def __init__(self, math: Math, vec: int = 1, tvec: int = 16, scope: str = "global", lanes_per_block: int = 1):
        self.math, self.V, self.tvec, self.scope = math, vec, tvec, scope
        self.TPB = lanes_per_block
        self.W = 1
        self._build_reductions()

    # --- loop kinds (overridden by the CPU and CUDA layouts)
    def outer_loop(self, n):
        """Across lanes (CPU: parallel; CUDA: blocks)."""
        return T.serial(n)

    def lane_loop(self, n):
        """Within a group of lanes (CUDA: threads of a block)."""
        return T.serial(n)

    def vec_loop(self, n):
        return T.serial(n)

    def chan_loop(self):
        """Over a forward lane's ``chans`` channel slots (one: a loop of one the lowering removes)."""
        return T.serial(self.chans)

    # --- lanes
    def lane_outer(self, total):
        return self.outer_loop((total + self.TPB - 1) // self.TPB)

    def lane_inner(self):
        return self.lane_loop(self.TPB)

    def lane_guard(self, lo, li, total):
        return lo * self.TPB + li < total

    def lane_of(self, lo, li, total):
        return lo * self.TPB + li

    def lane_ok(self, lo, li, total):
        return True

    def thread(self, li):
        return 0

    def leader(self, ok, j):
        """Predicate of the lane's single writer (True: the lane is one thread, its guard already holds)."""
        return True

    # --- dstate
    def st_outer(self, N):
        return T.serial(N // self.V)

    def st_inner(self):
        return self.vec_loop(self.V)

    def state(self, ko, ki, j):
        return ko * self.V + ki

    def reg(self, ko, ki):
        return ko * self.V + ki

    def regs(self, N):
        return N

    def nchunk(self, seqlen, chunk):
        return (seqlen + chunk - 1) // chunk

    def _build_reductions(self):
        V, zero = self.V, self.math.zero

        @T.macro
        def reduce(dst, i, parts, row):
            dst[i] = zero
            for ki in range(V):
                dst[i] = dst[i] + parts[row, ki]

        @T.macro
        def reduce_plus(dst, i, parts, row, init):
            dst[i] = init
            for ki in range(V):
                dst[i] = dst[i] + parts[row, ki]

        @T.macro
        def reduce2(dst, i0, i1, parts):
            dst[i0] = zero
            dst[i1] = zero
            for ki in range(V):
                dst[i0] = dst[i0] + parts[0, ki]
                dst[i1] = dst[i1] + parts[1, ki]

        @T.macro
        def uniform(dst, i, value, j):
            dst[i] = value

        @T.macro
        def reduce_plus_lead(dst, i, parts, row, init, lead):
            reduce_plus(dst, i, parts, row, init)

        self.reduce, self.reduce_plus, self.reduce2 = reduce, reduce_plus, reduce2
        self.uniform, self.reduce_plus_lead = uniform, reduce_plus_lead
