"""How the scan templates' loops land on a machine: the scans' vocabulary on the strategy protocol, and the
serial layout.

A template writes each kernel once over abstract loops and asks its ``Layout`` how to lay them out. The
protocol's part (compute/strategy.py: tasks in ``outer`` x ``inner`` loops of ``threads`` a block, ``vloop``,
``scope``, ``math``, ``serial_work``) is every strategy's; a scan adds:

- **lanes** (a lane is a task: one (batch, channel), or (batch, channel block) in the backward): the
  protocol's ``outer(total)`` / ``inner()`` are the two loops, ``lane_guard`` the bounds test wrapping the
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
- **time threads** (the parallel-in-time forward, timescan.py): ``time_threads`` P threads share a lane's
  time, each ``items`` K consecutive steps (visited by ``item_loop(K)``), ``block_chans`` lanes (channels of
  one batch row) per group of lanes; ``pair_scan(pr, p)`` turns thread p's pair (pr[0], pr[1]) into the
  exclusive prefix over threads < p (the identity (1, 0) at p = 0) and puts the total over all P threads in
  (pr[2], pr[3]) (pr[4], pr[5]: scratch), where (a1, b1) then (a2, b2) = (a2 a1, a2 b1 + b2);
  ``stage_states`` NS (0: none) stages a time block's time-varying B / C, NS states at a time, in
  ``stage_scope`` buffers shared by the group's lanes; per-state values of a lane (A[d, n], the carried
  state) are *lane-held*: ``held_regs(N)`` slots, slot k holding state ``held_state(k, p)`` on time thread p,
  read by ``held_get(buf, n)`` (any thread), written by the macros ``held_set(buf, n, value, p)`` and
  ``held_add(buf, n, value, p)`` (value the same on every time thread); the backward (timescan_bwd.py) adds
  ``pair_scan_rev`` (the same over threads > p, total over all), ``time_sum(buf, i)`` (buf[i] summed over the
  lane's time threads, on each) and ``reduce_layout`` (the layout of its stage-2 sums; None: this one);
- ``nchunk(seqlen, chunk)`` (the checkpoint count: an expression, or a free var bound by the buffer).

``Layout`` itself is the serial layout (tests and tools read the definition it gives); the CPU layout
(the CPU mixin's parallel lanes and vectorized loops) and the CUDA ones (the GPU mixin's blocks x threads,
warp-split dstate, shuffle sums) live with their rules in schedules/cpu/selective_scan.py and
schedules/cuda/selective_scan.py.
"""
from __future__ import annotations

from tvm.script import tirx as T

from .._math import Math
from ..strategy import Strategy


class Layout(Strategy):
    """The scans' vocabulary on the strategy protocol (compute/strategy.py; a lane is a task, ``threads`` lanes
    a block): serial lanes, serial dstate loop of ``vec`` (1: scalar) per step, lane-local buffers in
    ``scope``."""

    time_batched = True
    chans = 1  # channels per forward lane (the CPU's channels layout: a vector of them)
    stage_params = False  # forward: copy A and a time-invariant B / C into the lane once (transposed)
    y_from_skip = False  # forward: y's partial starts from D u (one partial per channel), not 0 + D u after
    head_rows = None  # tied decode step: rows of one head per lane, sharing its softplus / exp (None: all)
    stage_bc = False  # decode step: a lane loads its B / C states once into lane-local buffers (its rows reuse them)
    time_threads = 1  # parallel-in-time forward: threads sharing a lane's time (the serial layout: one)
    items = 16  # ... consecutive steps per thread
    block_chans = 1  # ... lanes per group of lanes (a CUDA block)
    stage_states = 0  # ... states of B / C staged per time block (0: read from the inputs)
    stage_scope = "local"
    min_blocks = 0  # ... blocks per SM the register budget must allow (0: the compiler's choice)
    vector_bytes = 0  # ... bytes a thread loads at once: u / delta / z steps, staged B / C states (0: elements)
    reduce_layout = None  # parallel-in-time backward: the layout of the stage-2 sums (None: this one)

    def __init__(self, math: Math, vec: int = 1, tvec: int = 16, scope: str = "global", lanes_per_block: int = 1):
        super().__init__(math, threads=lanes_per_block, scope=scope)
        self.V, self.tvec, self.W = vec, tvec, 1
        self._build_reductions()

    # --- loop kinds beyond the protocol's (block_loop, thread_loop, vloop: overridden by the CPU / GPU mixins)
    def item_loop(self, n):
        """Over a time thread's consecutive steps (CUDA: unrolled, registers)."""
        return T.serial(n)

    def chan_loop(self):
        """Over a forward lane's ``chans`` channel slots (one: a loop of one the lowering removes)."""
        return T.serial(self.chans)

    # --- lanes: the protocol's outer(total) x inner() loops, and
    def lane_guard(self, lo, li, total):
        return self.index(lo, li) < total

    def lane_of(self, lo, li, total):
        return self.index(lo, li)

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
        return self.vloop(self.V)

    def state(self, ko, ki, j):
        return ko * self.V + ki

    def reg(self, ko, ki):
        return ko * self.V + ki

    def regs(self, N):
        return N

    # --- lane-held per-state values (the parallel-in-time forward): one thread holds them all
    def held_regs(self, N):
        return N

    def held_state(self, k, p):
        return k

    def held_get(self, buf, n):
        return buf[n]

    @staticmethod
    @T.macro
    def held_set(buf, n, value, p):
        buf[n] = value

    @staticmethod
    @T.macro
    def held_add(buf, n, value, p):
        buf[n] = buf[n] + value

    @staticmethod
    @T.macro
    def time_sum(buf, i):  # one time thread: its own value is the lane's sum
        T.evaluate(0)

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

        @T.macro
        def pair_scan(pr, p):  # one time thread: the prefix is the identity, the total its own pair
            pr[2] = pr[0]
            pr[3] = pr[1]
            pr[0] = self.math.one
            pr[1] = zero

        self.reduce, self.reduce_plus, self.reduce2 = reduce, reduce_plus, reduce2
        self.uniform, self.reduce_plus_lead = uniform, reduce_plus_lead
        self.pair_scan = self.pair_scan_rev = pair_scan
