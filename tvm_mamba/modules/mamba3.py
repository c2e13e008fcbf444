"""Mamba3: mamba_ssm 2.3.2.post1's ``modules/mamba3.Mamba3`` block (SISO and MIMO) on the TVM kernels.

Same constructor, parameter names, shapes and initialisation as upstream, so a mamba_ssm Mamba3 state_dict
loads with strict=True (nheads = expand*d_model/headdim, S = num_rope_angles = floor(d_state *
rope_fraction) rounded down to even, halved; R = mimo_rank with is_mimo, else 1; d_in_proj = 2*d_inner
+ 2*R*ngroups*d_state + 3*nheads + S):

=================  ==============================================
dt_bias            (nheads,) float32            B_bias, C_bias (nheads, R, d_state) float32, ones
D                  (nheads,) float32, ones      in_proj.weight (d_in_proj, d_model), no bias
B_norm.weight      (d_state,)                   C_norm.weight (d_state,)
mimo_x, mimo_o     (nheads, R, headdim), 1 / R  mimo_z (nheads, R, headdim), ones (is_mimo only)
norm.weight        (d_inner,) (is_outproj_norm) out_proj.weight (d_model, d_inner), no bias
=================  ==============================================

Forward (upstream's, docs/mamba3.md): in_proj -> [z, x, B, C, dd_dt, dd_A, trap, angles];
A = clamp(-softplus(dd_A), max=-A_floor), DT = softplus(dd_dt + dt_bias), ADT = A DT; B, C = RMSNorm(B),
RMSNorm(C) over d_state per group; y = mamba3_siso_combined(Q=C, K=B, V=x, ADT, DT, Trap=trap (a logit),
Q_bias=C_bias, K_bias=B_bias, Angles=angles broadcast to every head, D, Z=z) (or Z=None and y =
RMSNormGated(y, z) (group headdim, norm before gate) with is_outproj_norm); out = out_proj(y).
MIMO (is_mimo): B, C carry R ranks (..., R, ngroups, d_state) and the scan is mamba3_mimo (MIMO_V = mimo_x,
MIMO_Z = mimo_z, MIMO_Out = mimo_o; with is_outproj_norm the R outputs are normed per rank against
z * mimo_z, then summed with mimo_o), the step mamba3_mimo_step.
Decoding: ``step`` on mamba3_siso_step / mamba3_mimo_step with upstream's cache layout (angle, ssm, k (batch,
R, nheads, d_state), v states). Training: the forward is differentiable (the chunked scan's backward kernels);
the decode step is not (upstream's step kernel has no backward either). Packed sequences: cu_seqlens.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..torch_ops.mamba3 import mamba3_siso_combined, mamba3_siso_step
from ..torch_ops.mamba3_mimo import mamba3_mimo
from ..torch_ops.mamba3_mimo_step import mamba3_mimo_step
from ..torch_ops.rmsnorm_gated import rmsnorm_fn
from ..torch_ops.ssd import check_seq_idx, validate_cu_seqlens
from ._checks import FLOAT_STATES, check_hidden, check_state, states_from_cache
from .linear import Linear
from .rmsnorm_gated import RMSNormGated

NO_BACKWARD = ("Mamba3.step: the decode step has no backward (as upstream's step kernel); run decoding under "
               "torch.no_grad() / inference_mode (parameters or the input require grad with grad mode on)")


def rope_angles(d_state: int, rope_fraction: float) -> int:
    """Upstream's num_rope_angles: floor(d_state * rope_fraction), rounded down to even, halved (rotary pairs)."""
    split = int(d_state * rope_fraction)
    return (split - split % 2) // 2


def _check_config(d_model, d_state, expand, headdim, ngroups, rope_fraction, chunk_size, is_mimo, mimo_rank,
                  kwargs):
    """TypeError for an unknown keyword; ValueError naming the argument for a configuration the kernels cannot
    run -> (d_inner, nheads)."""
    if is_mimo and (not isinstance(mimo_rank, int) or isinstance(mimo_rank, bool) or mimo_rank < 1):
        raise ValueError(f"mimo_rank: must be an int >= 1 with is_mimo, got {mimo_rank!r}")
    if kwargs:
        raise TypeError(f"Mamba3: unexpected keyword argument(s) {sorted(kwargs)}")
    if rope_fraction not in (0.5, 1.0):
        raise ValueError(f"rope_fraction: must be 0.5 or 1.0, got {rope_fraction!r}")
    if not isinstance(d_state, int) or d_state < 2 or d_state % 2 or d_state > 256:
        raise ValueError(f"d_state: must be an even int in 2..256 (rotary pairs; the kernels' limit), got {d_state!r}")
    if rope_angles(d_state, rope_fraction) < 1:
        raise ValueError(f"d_state: d_state={d_state} with rope_fraction={rope_fraction} leaves no rotary angle")
    d_inner = int(expand * d_model)
    if d_inner < 1:
        raise ValueError(f"expand: expand * d_model must be at least 1, got {expand} * {d_model}")
    if not isinstance(headdim, int) or headdim < 1 or d_inner % headdim or headdim > 256:
        raise ValueError(f"headdim: must divide d_inner={d_inner} and be at most 256, got {headdim!r}")
    nheads = d_inner // headdim
    if not isinstance(ngroups, int) or ngroups < 1 or nheads % ngroups:
        raise ValueError(f"ngroups: must divide nheads={nheads}, got {ngroups!r}")
    if not isinstance(chunk_size, int) or not 1 <= chunk_size <= 256:
        raise ValueError(f"chunk_size: must be an int in 1..256, got {chunk_size!r}")
    return d_inner, nheads


class Mamba3(nn.Module):
    """Mamba-3 block (SISO). forward(u: (batch, seqlen, d_model)) -> (batch, seqlen, d_model).

    Per head h (Q/K group g = h // (nheads / ngroups)): theta_t = theta_{t-1} + pi tanh(angles_t) DT_t;
    q_t, k_t = R(theta_t)(C_t + C_bias_h), R(theta_t)(B_t + B_bias_h); h_t = exp(ADT_t) h_{t-1}
    + exp(ADT_t) DT_t (1 - sigmoid(trap_t)) x_{t-1} k_{t-1}^T + DT_t sigmoid(trap_t) x_t k_t^T;
    y_t = (h_t q_t + D_h x_t) silu(z_t); out = out_proj(y). forward is differentiable; step (decoding) is not.
    """

    def __init__(self, d_model, d_state=128, expand=2, headdim=64, ngroups=1, rope_fraction=0.5, dt_min=0.001,
                 dt_max=0.1, dt_init_floor=1e-4, A_floor=1e-4, is_outproj_norm=False, is_mimo=False, mimo_rank=4,
                 chunk_size=64, dropout=0.0, layer_idx=None, n_layer=None, device=None, dtype=None, **kwargs):
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        self.d_inner, self.nheads = _check_config(d_model, d_state, expand, headdim, ngroups, rope_fraction,
                                                  chunk_size, is_mimo, mimo_rank, kwargs)
        del dropout, n_layer  # absorbed, as upstream
        self.d_model, self.d_state, self.expand, self.headdim = d_model, d_state, expand, headdim
        self.chunk_size, self.layer_idx, self.A_floor = chunk_size, layer_idx, A_floor
        self.is_outproj_norm, self.is_mimo, self.mimo_rank = is_outproj_norm, bool(is_mimo), mimo_rank if is_mimo else 1
        self.num_bc_heads = ngroups
        self.rotary_dim_divisor = int(2 / rope_fraction)
        self.num_rope_angles = rope_angles(d_state, rope_fraction)
        self.split_tensor_size = 2 * self.num_rope_angles
        # order: [z, x, B, C, dd_dt, dd_A, trap, angles]
        R = self.mimo_rank
        d_in_proj = 2 * self.d_inner + 2 * d_state * ngroups * R + 3 * self.nheads + self.num_rope_angles
        self.in_proj = Linear(d_model, d_in_proj, bias=False, **factory_kwargs)
        # dt_bias = softplus^-1(dt), dt log-uniform in [dt_min, dt_max] (upstream's init, float32)
        dt = torch.exp(torch.rand(self.nheads, device=device, dtype=torch.float32)
                       * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dt = torch.clamp(dt, min=dt_init_floor)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self.dt_bias._no_weight_decay = True
        self.B_bias = nn.Parameter(torch.ones(self.nheads, R, d_state, dtype=torch.float32, device=device))
        self.C_bias = nn.Parameter(torch.ones(self.nheads, R, d_state, dtype=torch.float32, device=device))
        self.B_norm = RMSNormGated(d_state, eps=1e-5, **factory_kwargs)
        self.C_norm = RMSNormGated(d_state, eps=1e-5, **factory_kwargs)
        if self.is_mimo:  # the rank-R up / down projections of x, z and the output (upstream's init)
            ones = lambda: torch.ones(self.nheads, R, headdim, device=device)  # noqa: E731
            self.mimo_x = nn.Parameter(ones() / R)
            self.mimo_z = nn.Parameter(ones())
            self.mimo_o = nn.Parameter(ones() / R)
        self.D = nn.Parameter(torch.ones(self.nheads, device=device))
        self.D._no_weight_decay = True
        if is_outproj_norm:
            self.norm = RMSNormGated(self.d_inner, eps=1e-5, norm_before_gate=True, group_size=headdim,
                                     **factory_kwargs)
        self.out_proj = Linear(self.d_inner, d_model, bias=False, **factory_kwargs)

    # ------------------------------------------------------------------------------------------------
    def _refuse_grad(self, u: Tensor) -> None:
        """NotImplementedError before the decode step runs when autograd would need its (missing) backward."""
        if torch.is_grad_enabled() and (u.requires_grad or any(p.requires_grad for p in self.parameters())):
            raise NotImplementedError(NO_BACKWARD)

    def _project(self, u: Tensor):
        """u: (..., d_model) -> in_proj's parts, upstream's order and preprocessing: z, x (..., nheads,
        headdim); B, C (..., R, ngroups, d_state) normed; DT, ADT (..., nheads) float32; trap (..., nheads)
        (the logit); angles (..., nheads, num_rope_angles) float32 (one set broadcast to every head)."""
        lead = u.shape[:-1]
        G, N, R = self.num_bc_heads, self.d_state, self.mimo_rank
        z, x, B, C, dd_dt, dd_A, trap, angles = torch.split(
            self.in_proj(u), [self.d_inner, self.d_inner, R * G * N, R * G * N, self.nheads, self.nheads,
                              self.nheads, self.num_rope_angles], dim=-1)
        A = torch.clamp(-F.softplus(dd_A.to(torch.float32)), max=-self.A_floor)
        DT = F.softplus(dd_dt + self.dt_bias)
        hp = (*lead, self.nheads, self.headdim)
        angles = angles.to(torch.float32).unsqueeze(-2).expand(*lead, self.nheads, self.num_rope_angles)
        return (z.reshape(hp), x.reshape(hp), self.B_norm(B.reshape(*lead, R, G, N)),
                self.C_norm(C.reshape(*lead, R, G, N)), DT, A * DT, trap, angles)

    def _finish(self, y: Tensor, z: Tensor, dtype: torch.dtype) -> Tensor:
        """y: (..., nheads, headdim), or MIMO with is_outproj_norm (..., R, nheads, headdim) -> out_proj(y)
        (after the gated norm with is_outproj_norm: per rank against z * mimo_z, then summed with mimo_o)."""
        if self.is_mimo and self.is_outproj_norm:
            lead = y.shape[:-3]
            zr = torch.einsum("...hp,hrp->...rhp", z.float(), self.mimo_z).reshape(*lead, self.mimo_rank, -1)
            n = self.norm  # in float32 (as upstream: y.float(), z.float()), the weight widened to match
            y = rmsnorm_fn(y.float().reshape(zr.shape), n.weight.float(), None, z=zr, eps=n.eps,
                           group_size=n.group_size, norm_before_gate=True).reshape(y.shape)
            y = torch.einsum("...rhp,hrp->...hp", y, self.mimo_o)
        y = y.reshape(*y.shape[:-2], self.d_inner)
        if self.is_outproj_norm and not self.is_mimo:
            y = self.norm(y, z.reshape(y.shape))
        return self.out_proj(y.to(dtype))

    def _mimo_args(self):
        """mamba3_mimo / mamba3_mimo_step's projection arguments: MIMO_V, MIMO_Z, MIMO_Out (None with
        is_outproj_norm: the norm comes between the rank outputs and mimo_o)."""
        return self.mimo_x, self.mimo_z, None if self.is_outproj_norm else self.mimo_o

    def forward(self, u, seq_idx=None, cu_seqlens=None, inference_params=None):
        """u: (batch, seqlen, d_model) -> (batch, seqlen, d_model).

        ``inference_params`` as mamba_ssm: at seqlen_offset == 0 (prefill) the chunked forward also writes
        the final (angle, ssm, k, v) states into the layer's cache (rows :batch, or :nseq with cu_seqlens);
        later, one :meth:`step`. cu_seqlens (nseq + 1,) with batch 1: packed sequences, each from zero states
        (seq_idx may come with it and must agree). seq_idx (batch, seqlen) int32 alone (Mamba-2's convention,
        any batch): each row's runs of equal ids are sequences from zero states, run as packed sequences
        (``_forward_seq_idx``; upstream ignores seq_idx, which mixes the sequences); not with
        ``inference_params`` (the cache's rows would be ambiguous: pass cu_seqlens)."""
        check_hidden("u", u, self.d_model)
        if cu_seqlens is not None:
            cu_seqlens = validate_cu_seqlens(cu_seqlens, seq_idx, u)
        elif seq_idx is not None:
            return self._forward_seq_idx(u, seq_idx, inference_params)
        batch = u.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1  # rows of the states
        states = None
        if inference_params is not None:
            states = self._get_states_from_cache(inference_params, batch)
            self._check_states(states, batch, u.device)
            if inference_params.seqlen_offset > 0:
                return self.step(u, *states)[0]
        z, x, B, C, DT, ADT, trap, angles = self._project(u)
        ADT, DT, trap = ADT.transpose(1, 2), DT.transpose(1, 2), trap.transpose(1, 2)
        Z = None if self.is_outproj_norm else z
        if self.is_mimo:
            y = mamba3_mimo(C, B, x, ADT, DT, trap, self.C_bias, self.B_bias, *self._mimo_args(), angles, self.D, Z,
                            self.chunk_size, self.rotary_dim_divisor, x.dtype, return_state=states is not None,
                            cu_seqlens=cu_seqlens)
        else:
            y = mamba3_siso_combined(
                C[:, :, 0], B[:, :, 0], x, ADT, DT, trap, self.C_bias[:, 0], self.B_bias[:, 0], angles, D=self.D,
                Z=Z, chunk_size=self.chunk_size, return_final_states=states is not None, cu_seqlens=cu_seqlens)
        if states is not None:
            y, *final = y
            self._store(states, batch, *final)
        return self._finish(y, z, x.dtype)

    def _forward_seq_idx(self, u: Tensor, seq_idx: Tensor, inference_params) -> Tensor:
        """forward with seq_idx alone: the rows laid end to end as one packed row, a sequence starting at each
        row's start and wherever seq_idx changes, so no state crosses a row or an id change."""
        batch, seqlen = u.shape[:2]
        check_seq_idx(seq_idx, batch, seqlen, u.device)
        if inference_params is not None:
            raise ValueError("seq_idx: not with inference_params (the cache's rows would be ambiguous); pass "
                             "cu_seqlens with batch 1")
        starts = torch.ones(batch, seqlen, dtype=torch.bool, device=u.device)
        starts[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
        bounds = starts.flatten().nonzero()[:, 0]
        cu = torch.cat([bounds, bounds.new_full((1,), batch * seqlen)]).to(torch.int32)
        return self(u.reshape(1, batch * seqlen, -1), cu_seqlens=cu).view(u.shape)

    @staticmethod
    def _store(states, batch: int, angle: Tensor, ssm: Tensor, k: Tensor, v: Tensor) -> None:
        """Copy new (angle, ssm, k (batch, nheads, d_state) SISO / (batch, R, nheads, d_state) MIMO, v) states
        into the cache's rows :batch."""
        angle_state, ssm_state, k_state, v_state = states
        angle_state[:batch].copy_(angle)
        ssm_state[:batch].copy_(ssm)
        k_state[:batch].copy_(k.view(k_state[:batch].shape))
        v_state[:batch].copy_(v)

    def _check_states(self, states, batch: int, device) -> None:
        """The four cache tensors: (>= batch, ...) upstream's shapes, float dtypes, on u's device."""
        if not isinstance(states, (tuple, list)) or len(states) != 4:
            raise TypeError("states: expected (angle_state, ssm_state, k_state, v_state)")
        H, P, N = self.nheads, self.headdim, self.d_state
        tails = ((H, self.num_rope_angles), (H, P, N), (self.mimo_rank, H, N), (H, P))
        for name, state, tail in zip(("angle_state", "ssm_state", "k_state", "v_state"), states, tails):
            check_state(name, state, batch, tail, FLOAT_STATES, device)

    def step(self, u, angle_state, ssm_state, k_state, v_state, **kwargs):
        """One decode token. u: (batch, 1, d_model) (or upstream's (batch, d_model)); states as
        :meth:`allocate_inference_cache` makes them, batch' >= batch, updated in place (rows :batch)
        -> (out shaped like u, angle_state, ssm_state, k_state, v_state). ``kwargs`` ignored, as upstream."""
        if isinstance(u, Tensor) and u.dim() == 2:
            return (self.step(u[:, None], angle_state, ssm_state, k_state, v_state)[0][:, 0],
                    angle_state, ssm_state, k_state, v_state)
        check_hidden("u", u, self.d_model, seqlen_one=True)
        self._refuse_grad(u)
        batch = u.shape[0]
        states = (angle_state, ssm_state, k_state, v_state)
        self._check_states(states, batch, u.device)
        z, x, B, C, DT, ADT, trap, angles = self._project(u[:, 0])
        Z, rows = None if self.is_outproj_norm else z, (angle_state[:batch], ssm_state[:batch], v_state[:batch])
        if self.is_mimo:
            y, new = mamba3_mimo_step(C, B, x, ADT, DT, trap, self.C_bias, self.B_bias, *self._mimo_args(), angles,
                                      D=self.D, Z=Z, Input_States=(*rows[:2], k_state[:batch], rows[2]))
        else:
            y, new = mamba3_siso_step(C[:, 0], B[:, 0], x, ADT, DT, trap, self.C_bias[:, 0], self.B_bias[:, 0],
                                      angles, D=self.D, Z=Z, Input_States=(*rows[:2], k_state[:batch, 0], rows[2]))
        self._store(states, batch, *new)
        return self._finish(y, z, x.dtype)[:, None], angle_state, ssm_state, k_state, v_state

    def allocate_inference_cache(self, batch_size, max_seqlen, device=None, dtype=None, inplace_state=None,
                                 **kwargs):
        """-> (angle_state (batch_size, nheads, num_rope_angles) float32, ssm_state (batch_size, nheads,
        headdim, d_state) float32, k_state (batch_size, R, nheads, d_state) (R = 1 without MIMO) and v_state
        (batch_size, nheads, headdim) in dtype (default in_proj.weight's)): upstream's layout."""
        device = self.in_proj.weight.device if device is None else device
        dtype = self.in_proj.weight.dtype if dtype is None else dtype
        H, P, N, f32 = self.nheads, self.headdim, self.d_state, torch.float32
        return (torch.zeros(batch_size, H, self.num_rope_angles, device=device, dtype=f32),
                torch.zeros(batch_size, H, P, N, device=device, dtype=f32),
                torch.zeros(batch_size, self.mimo_rank, H, N, device=device, dtype=dtype),
                torch.zeros(batch_size, H, P, device=device, dtype=dtype))

    def _get_states_from_cache(self, inference_params, batch_size, initialize_states=False):
        return states_from_cache(self, inference_params, batch_size, initialize_states)
