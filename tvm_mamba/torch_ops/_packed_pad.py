"""Packed sequences (batch 1, cu_seqlens) <-> a left-padded batch: a row per sequence, each ending at its own
last position, so that "the state after the last position of row j" is sequence j's final state.

The Mamba-3 chunked op uses it where its packed kernels stop: per-sequence input states and a gradient through
the per-sequence final ssm states (torch_ops/mamba3.py). Padding positions are given zeros, which for Mamba-3
are identity steps: ADT = 0 (decay 1), DT = 0 (no angle change, no trapezoid weight), V = 0 (no input), so
each row's state passes through its padding unchanged. Left padding keeps each sequence's last position at
the row's end, where the batched op reads the final k and v states.
"""
from __future__ import annotations

import torch
from torch import Tensor


class PackedPad:
    """cu_seqlens (nseq + 1,) of T packed positions -> nseq rows of ``width`` = max(1, longest sequence)
    positions. ``dst`` (T,) int64: each packed position's row-major index in the (nseq, width) padded grid;
    ``first`` (nseq,): each sequence's first packed position (clamped into range for an empty one);
    ``nonempty`` (nseq,) bool. Both directions are differentiable (index_copy / index_select)."""

    def __init__(self, cu_seqlens: Tensor, T: int):
        cu = cu_seqlens.long()
        lens = cu[1:] - cu[:-1]
        self.nseq = int(lens.numel())
        self.width = max(1, int(lens.max()))
        seq = torch.repeat_interleave(torch.arange(self.nseq, device=cu.device), lens, output_size=T)
        pos = torch.arange(T, device=cu.device) - cu[:-1][seq]
        self.dst = seq * self.width + (self.width - lens[seq]) + pos
        self.first = cu[:-1].clamp(max=T - 1)
        self.nonempty = lens > 0

    def pad(self, x: Tensor, time_dim: int) -> Tensor:
        """x with batch 1 and T positions on ``time_dim`` -> (nseq, ..., width on time_dim, ...), zeros at
        the padding."""
        xt = x[0].movedim(time_dim - 1, 0)
        grid = xt.new_zeros((self.nseq * self.width, *xt.shape[1:])).index_copy(0, self.dst, xt)
        return grid.view(self.nseq, self.width, *xt.shape[1:]).movedim(1, time_dim)

    def unpad(self, x: Tensor, time_dim: int) -> Tensor:
        """The inverse of ``pad``: the packed positions' rows of a padded tensor, batch 1 again."""
        xt = x.movedim(time_dim, 1)
        rows = xt.reshape(self.nseq * self.width, *xt.shape[2:]).index_select(0, self.dst)
        return rows.movedim(0, time_dim - 1)[None]

    def at_first(self, x: Tensor, time_dim: int) -> Tensor:
        """Each sequence's first position of a batch-1 tensor: (nseq, ...) without the time axis."""
        return x[0].index_select(time_dim - 1, self.first).movedim(time_dim - 1, 0)
