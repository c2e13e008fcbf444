"""What the CUDA templates of the SSD chunk-matmul kernels share (schedules/cuda/ssd.py is the rule; the
kernels with one template for every target live in tvm_mamba/compute/ssd/): index helpers, masks and decays
with CUDA-native math."""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from ...compute._math import Math
from ...compute.ssd.common import F32, I32, NEG, Z4  # noqa: F401 (re-exported to the templates)

# CUDA-native math (expf, log1pf), not the CPU polynomials: nested in softplus they made expression
# trees that spilled in ssd_chunk_cumsum_bwd.
_math = Math(F32, native=True)


def _c(v):
    return tirx.const(v, F32)


class _Ctx:
    """Index helpers shared by the templates (all loads are float32)."""

    def __init__(self, s):
        self.s = s
        self.G = s.get("ngroups", 1)
        self.H, self.Q = s.get("nheads", self.G), s.get("chunk_size", 1)  # head_sum: no chunk; bmm_chunk: no heads
        self.R = self.H // self.G
        self.seq = s.get("has_seq_idx", False)
        # serial=True: the same template with serial loops instead of thread bindings, so tests can run
        # the CUDA kernels' arithmetic on the CPU
        self.serial = s.get("_serial", False)
        self.scope = "global" if self.serial else "local"

    def loop(self, extent, thread):
        return T.serial(extent) if self.serial else T.thread_binding(extent, thread=thread)

    def ld(self, buf, idx, L, t):
        return tirx.if_then_else(t < L, buf[idx].astype(F32), _c(0.0))

    def seg(self, dA_cs, seq_idx, b, h, c, l, s, L):
        """exp(dA_cs[l] - dA_cs[s]) for s <= l (same sequence), else 0."""
        ok = s <= l
        if self.seq:
            Q = self.Q
            ok = tirx.all(ok, seq_idx[b, tirx.min(c * Q + l, L - 1)] == seq_idx[b, tirx.min(c * Q + s, L - 1)])
        return _math.exp(tirx.Select(ok, dA_cs[b, h, c, l] - dA_cs[b, h, c, s], _c(NEG)))

    def e(self, dA_cs, seq_idx, b, h, c, l, L):
        """exp(dA_cs[l]), zero where the carried state belongs to another sequence."""
        v = _math.exp(dA_cs[b, h, c, l])
        if not self.seq:
            return v
        Q = self.Q
        prev = tirx.if_then_else(c > 0, seq_idx[b, tirx.max(c * Q, 1) - 1], tirx.const(0, I32))
        return tirx.Select(seq_idx[b, tirx.min(c * Q + l, L - 1)] == prev, v, _c(0.0))

    def w(self, dA_cs, seq_idx, b, h, c, s, L):
        """exp(dA_cs[Q-1] - dA_cs[s]), zero where s is not in the chunk's last sequence."""
        Q = self.Q
        v = _math.exp(dA_cs[b, h, c, Q - 1] - dA_cs[b, h, c, s])
        if not self.seq:
            return v
        return tirx.Select(seq_idx[b, tirx.min(c * Q + s, L - 1)] == seq_idx[b, tirx.min(c * Q + Q, L) - 1], v,
                           _c(0.0))

    def scale(self, dA_cs, seq_idx, b, h, c, L):
        Q = self.Q
        a = _math.exp(dA_cs[b, h, c, Q - 1])
        if not self.seq:
            return a
        cur = seq_idx[b, tirx.min(c * Q + Q, L) - 1]
        prev = tirx.if_then_else(c > 0, seq_idx[b, tirx.max(c * Q, 1) - 1], tirx.const(0, I32))
        return tirx.Select(cur == prev, a, _c(0.0))

    def g(self, dy, z, b, t, h, p, L, has_z):
        v = self.ld(dy, (b, tirx.min(t, L - 1), h, p), L, t)
        if has_z:
            v = v * _math.silu(self.ld(z, (b, tirx.min(t, L - 1), h, p), L, t))
        return v
