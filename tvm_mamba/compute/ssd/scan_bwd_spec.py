"""ssd_chunk_scan_bwd's math, each piece written once (scan_bwd.py): what it sums, over which range, in which
order. The two forms execute these specs: the task form (scan_bwd_task.py) with mm.py's register-blocked
matmuls over a task's staged operands, the launch form (scan_bwd_launch.py) with a loop per output element.

With g = dy * silu(z), K[l, s] = exp(dA_cs[l] - dA_cs[s]) (s <= l, same sequence), CB = C B^T,
GX = g x^T, e[l] = exp(dA_cs[l]) (carried-state mask), w[s] = dt[s] exp(dA_cs[Q-1] - dA_cs[s]) (chunk-state
mask), Sin the state entering the chunk and dSo the gradient of the state leaving it:

    dx[s]    = sum_{l>=s} CB K dt[s] g[l] + w[s] dSo B_s + D g[s]
    dC[l]    = e[l] g_l Sin + sum_{s<=l} GX K dt[s] B_s
    dB[s]    = sum_{l>=s} GX K dt[s] C_l + w[s] x_s dSo
    d dt[s]  = sum_l GX CB K + exp(dA_cs[Q-1]-dA_cs[s]) <x_s, dSo B_s>
    d dA_step[s] = sum_{l>=s>k} G[l, k] + sum_{l>=s} e[l] <g_l, C_l Sin> + sum_{k<s} w[k] dt[k] <x_k, dSo B_k>
    dD       = sum_l g x  (per (batch, chunk) partial)

with G = GX CB K dt: the gradient of the chunk's decay steps dA_step = dt' A themselves (dA_cs[l] is the sum of
the steps s <= l), within the chunk (the state-passing term is added by ssd_chunk_cumsum_bwd). Crossing-pairs
form: step s lies inside the segment from k to l of each pair it sums, so x_k enters only steps s > k and g_l
only steps s <= l -- a non-finite x / dy never reaches another position's step through a cancelling
difference (upstream's rows - columns of G, reverse-cumsummed, did: x_t non-finite made every step of t's
chunk non-finite).

dB / dC are summed over the heads of a *part* of each group (gparts = ngroups * hparts, hparts dividing
nheads / ngroups, compute.ssd.head_parts), in head order. Their intra-chunk terms multiply the group's C / B, so
they run once per part on gsum = the sum over the part's heads of (g x^T) K dt (a workspace the kernel writes
and then reads): two Q x Q x dstate products per part instead of per head.

``diag_skip`` (Mamba-3): every intra-chunk causal sum above runs strictly (s < l, l > s: dx, gsum and so dB / dC,
d dt), D is per position, D[b, h, c, s] (dt_out's layout), so dx[s] gets D[b, h, c, s] g[s], and dD is per
position: dD[b, h, c, l] = sum_p g[l, p] x[l, p]. ``step_group`` G: those sums over s // G < l // G. d dA_step's
crossing pairs (k < s <= l) never hold the diagonal; with step_group they are those of different step groups.

Specs: ``pieces(d)``'s products (``Product``: dx, g x^T, dB, dC) and dots (dD) give summand, range and order
(k ascending from the init); d dt's and d dA_step's summands (``ddt_term``, ``pair_term``, ``xb_term``,
``ddt_state``, ``prefix_term``, ``carried_term``) and ranges (``common.causal_start``; a crossing pair
(l, k) of step q: k < q <= l with l in k's causal range) are here, their order (rows l from the last up, then
columns k ascending, then the chunk-state prefix and the carried-state term) is each form's row pass: running
column sums over the rows done so far (the task form's, and the launch form's ``crossing_pass``).

A reader ``r`` is bound to one (batch, chunk) and to a head (per-head operands) or a head part (gsum); chunk
positions l (the output row, C's side) and s (B's side), channels p < headdim, n < dstate:

    g(l, p), x(s, p), xT(p, s) = x(s, p)     the gate's output gradient dy silu(z) and the input (0 past seqlen)
    B(s, n), C(l, n)                         the group's B / C rows
    dso(p, n), dsoT(n, p), sin(p, n)         dSo, Sin
    cb(l, s), K(l, s), dt(s)                 C_l . B_s (ssd_bmm_chunk), the segment decay, dt'
    cbk(l, s)                                ``cbk`` below: staged by the task form, computed by the launch form
    gsum(l, s)                               the part's workspace (``gsum_term`` summed over its heads)
    wst(s), e(l), skip(s, p, v)              the chunk-state and carried-state decays, D's skip term of v

The task form's reader returns staged rows, the launch form's reads global memory; only the launch form leaves
out the positions past seqlen (zeros there) from a "ge" range.
"""
from __future__ import annotations

from types import SimpleNamespace

from tvm.script import tirx as T

from .common import causal_start, d_per_row


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


def folds_skip(d) -> bool:
    """Whether dx's skip term D g[s] (its main product's init) may be the product's diagonal term instead
    (``cbk_skip``): the same sum without a second read of g. D per head or per position (``diag_skip``), not
    per channel: common.d_per_row; not with ``step_group``, whose range would then hold the group's later
    positions at weight 0: 0 times a non-finite g there would reach dx[s]."""
    return d_per_row(d) and d.step_group == 1


def cbk_skip(d, r, l, s, D):
    """dx's main weight with the skip on its diagonal (``folds_skip``; D at s): cbk(l, s) + D at l == s, or with
    ``diag_skip`` D itself there (the strict sum's range then starts at the diagonal: l >= s either way)."""
    if d.diag_skip:
        return T.Select(l == s, D, cbk(r, l, s))
    return cbk(r, l, s) + T.Select(l == s, D, T.float32(0))


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


def pieces(d) -> SimpleNamespace:
    """The specs for dims ``d`` (ScanBwdDims). dx = out(main, state) = (D g[s, p] + sum_{l>=s} cbk(l, s)
    g[l, p]) + scale(s) (B dSo^T)[s, p], scale = w[s] dt[s]; gx = g x^T per head (gsum: the part's heads' gsum_term, in order);
    dB / dC: the part's heads in order of scale * head, then + intra (dB: gsum^T C over l >= s, dC: gsum B over
    s <= l); dD: dd.term summed over k ascending from 0 (``sizes``: (outputs j, terms k)), per channel p the
    sum over l < Q (0 past seqlen), per position l with diag_skip the sum over p."""
    P, N, Q = d.headdim, d.dstate, d.chunk_size
    dx = SimpleNamespace(
        main=Product(Q, P, Q, lambda r, s, l: r.cbk(l, s), lambda r, l, p: r.g(l, p),
                     init=lambda r, s, p: r.skip(s, p, r.g(s, p)), causal="ge"),
        state=Product(Q, P, N, lambda r, s, n: r.B(s, n), lambda r, n, p: r.dsoT(n, p)),
        scale=lambda r, s: r.wst(s) * r.dt(s),
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
