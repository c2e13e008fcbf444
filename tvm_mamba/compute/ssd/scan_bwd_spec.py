"""ssd_chunk_scan_bwd's reductions, each written once (scan_bwd.py): what a piece sums (its summand, as operands
read through a *reader*), over which range and in which order. The two forms execute these specs: the task form
(scan_bwd_task.py) with mm.py's register-blocked matmuls over a task's staged operands, the launch form
(scan_bwd_launch.py) with a loop per output element over the operands where they lie.

A reader ``r`` is bound to one (batch, chunk) and to a head (per-head operands) or a head part (gsum); chunk
positions l (the output row, C's side) and s (B's side), channels p < headdim, n < dstate:

    g(l, p), x(s, p), xT(p, s) = x(s, p)     the gate's output gradient dy silu(z) and the input (0 past seqlen)
    B(s, n), C(l, n)                         the group's B / C rows
    dso(p, n), dsoT(n, p), sin(p, n)         dSo (the gradient of the state leaving the chunk), Sin (entering)
    cb(l, s), K(l, s), dt(s)                 C_l . B_s (ssd_bmm_chunk), the segment decay, dt'
    cbk(l, s)                                ``cbk`` below: staged by the task form, computed by the launch form
    gsum(l, s)                               the part's workspace (``gsum_term`` summed over its heads)
    wst(s), e(l), skip(s, p, v)              the chunk-state and carried-state decays, D's skip term of v

The task form's reader returns staged rows (K(l, s): row l's, staged by its row pass), the launch form's reads
global memory; only the launch form leaves out the positions past seqlen (zeros there) from a "ge" range.
"""
from __future__ import annotations

from types import SimpleNamespace

from tvm.script import tirx as T

from .common import causal_start


class Product:
    """out[i, j] = init(r, i, j) + sum_k a(r, i, k) b(r, k, j) for an M x W output, k ascending over row i's
    range: ``causal`` None: [0, K); "ge": the positions l of column i's causal range, [causal_start(i), Q)
    (common.causal_start: strict with diag_skip, past the step group with step_group); "le": row i's,
    [0, causal_end(i)). ``lower``: only the causal part (k <= i) of the output is read (the task form writes the
    blocks that hold it). The executors may start from another init (a running sum of the earlier terms)."""

    def __init__(self, M: int, W: int, K: int, a, b, init=None, causal=None, lower: bool = False):
        self.M, self.W, self.K, self.a, self.b, self.causal, self.lower = M, W, K, a, b, causal, lower
        self.init = init or (lambda r, i, j: T.float32(0))

    def term(self, r, i, k, j):
        """The summand a(r, i, k) b(r, k, j)."""
        return self.a(r, i, k) * self.b(r, k, j)


def cbk(r, l, s):
    """(C_l . B_s) K[l, s] dt[s]: dx's causal weight (the task form stages it per row)."""
    return r.cb(l, s) * r.K(l, s) * r.dt(s)


def gsum_term(r, l, s, gx):
    """A head's term of gsum[l, s] (causal pairs only): (g_l . x_s) K[l, s] dt[s]."""
    return gx * r.K(l, s) * r.dt(s)


def ddt_term(r, l, s, gx):
    """Row l's term of d dt[s] (causal pairs; gx = g_l . x_s): (g_l . x_s)(C_l . B_s) K[l, s]."""
    return gx * r.cb(l, s) * r.K(l, s)


def pair_term(r, k, t):
    """G[l, k] from row l's d dt term t of column k: t dt[k] (a crossing pair of the steps k < q <= l)."""
    return t * r.dt(k)


def xb_term(r, s, p, state):
    """Channel p's term of XB[s] = <x_s, dSo B_s> (state: dx's state product at (s, p))."""
    return r.x(s, p) * state


def ddt_state(r, s, xb):
    """d dt[s]'s chunk-state term: exp(dA_cs[Q-1] - dA_cs[s]) XB[s]."""
    return r.wst(s) * xb


def prefix_term(r, k, xb):
    """Step k's term of d dA_step's chunk-state prefix (reaching the steps q > k): w[k] dt[k] XB[k]."""
    return r.wst(k) * r.dt(k) * xb


def carried_term(r, l, n, gsin):
    """dstate n's term of <g_l, C_l Sin> (gsin: dC's head product at (l, n))."""
    return r.C(l, n) * gsin


def pair_start(d, q, k):
    """The first row l of the crossing pairs (l, k) of step q (k < q): l >= q (k < q <= l never holds the
    diagonal), and with step_group l past k's step group (causal: k // G < l // G)."""
    return T.max(q, causal_start(d, k)) if d.step_group > 1 else q


def pieces(d) -> SimpleNamespace:
    """The specs of the pieces written once (dims ``d``: ScanBwdDims):

    dx:  dx[s, p] = out(main[s, p], state[s, p]) = (D g[s, p] + sum_{l>=s} cbk(l, s) g[l, p])
                    + w[s] dt[s] sum_n B[s, n] dSo[p, n]
    gx:  gx[l, s] = sum_p g[l, p] x[s, p] (per head), gsum[l, s] = sum over the part's heads of gsum_term
    dB:  dB[s, n] = sum over the part's heads of scale(s) head[s, n] = w[s] dt[s] (x_s dSo)[n], then
                    + sum_{l>=s} gsum[l, s] C[l, n] (intra)
    dC:  dC[l, n] = sum over the part's heads of e[l] (g_l Sin)[n], then + sum_{s<=l} gsum[l, s] B[s, n]
    dD:  dD[j] = sum_k dd_term(j, k), k ascending from 0: per channel p, sum over l < Q (0 past seqlen) of
         g[l, p] x[l, p]; per position l with diag_skip, sum over p (``dd``: (rows j, reduced k) sizes)."""
    P, N, Q = d.headdim, d.dstate, d.chunk_size
    dx = SimpleNamespace(
        main=Product(Q, P, Q, lambda r, s, l: r.cbk(l, s), lambda r, l, p: r.g(l, p),
                     init=lambda r, s, p: r.skip(s, p, r.g(s, p)), causal="ge"),
        state=Product(Q, P, N, lambda r, s, n: r.B(s, n), lambda r, n, p: r.dsoT(n, p)),
        out=lambda r, s, main, state: main + r.wst(s) * r.dt(s) * state)
    gx = Product(Q, Q, P, lambda r, l, p: r.g(l, p), lambda r, p, s: r.xT(p, s), lower=True)
    dB = SimpleNamespace(head=Product(Q, N, P, lambda r, s, p: r.x(s, p), lambda r, p, n: r.dso(p, n)),
                         scale=lambda r, s: r.wst(s) * r.dt(s),
                         intra=Product(Q, N, Q, lambda r, s, l: r.gsum(l, s), lambda r, l, n: r.C(l, n), causal="ge"))
    dC = SimpleNamespace(head=Product(Q, N, P, lambda r, l, p: r.g(l, p), lambda r, p, n: r.sin(p, n)),
                         scale=lambda r, l: r.e(l),
                         intra=Product(Q, N, Q, lambda r, l, s: r.gsum(l, s), lambda r, s, n: r.B(s, n), causal="le"))
    dd = SimpleNamespace(sizes=(Q, P) if d.diag_skip else (P, Q), term=_dd_term(d))
    return SimpleNamespace(dx=dx, gx=gx, dB=dB, dC=dC, dd=dd)


def _dd_term(d):
    def term(r, j, k):  # g[l, p] x[l, p] of output j, term k
        l, p = (j, k) if d.diag_skip else (k, j)
        return r.g(l, p) * r.x(l, p)

    return term
