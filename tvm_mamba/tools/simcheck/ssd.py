"""sim-check for ssd: every build-check configuration of the Mamba-2 chunked scan run through the CUDA execution
harness via ``mamba_chunk_scan_combined`` (forward, and autograd for the backward kernels), against the
float64 step-by-step recurrence (reference/ssd.py).

Each configuration names one kernel and only the static dims / flags that kernel is keyed by; the rest of the
call is filled in here (:func:`case_of`): dims the kernel does not see are small (headdim 8, dstate 16, one
group, chunk 32), flags it does not see are off, and every optional input the flags turn on is passed
(dt_bias, softplus, dt_limit, seq_idx, initial_states, a loss on final_states, D, z).

Sequence: batch 1, seqlen 13, ragged and shorter than the chunk (one partial chunk at chunk 256), seq_idx
switching sequence at position 6. One partial chunk because (a) the ``head_sum`` configuration (nheads 80 =
one dB / dC partial per head) is what ``head_parts`` picks only when batch x nchunks = 1, and (b) the CUDA
chunk-scan kernels cost O(seqlen x chunk x headdim) per thread in the harness: at the Mamba-2 2.7B dims a
second (full) chunk takes a minute per call, seqlen 13 a few seconds. Several chunks (state passing between
chunks, seq_idx across a chunk boundary, several batches) are tested at small dims in tests/cudasim/test_ssd.py.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from . import CheckFailed, compare, ran, recording, tolerance, extent, generator, size, target

OP = "ssd"
FORWARD = ("chunk_cumsum", "bmm_chunk", "chunk_state", "state_passing", "chunk_scan", "chunk_state_varlen")
BACKWARD = ("chunk_cumsum_bwd", "state_passing_bwd", "chunk_scan_bwd_dstates", "chunk_scan_bwd", "head_sum")
FLAGS = ("has_dt_bias", "dt_softplus", "has_dt_limit", "has_seq_idx", "has_init", "has_dfinal", "has_D",
         "D_has_hdim", "has_z")
FILL = dict(ngroups=1, headdim=8, dstate=16, chunk_size=32)  # dims a configuration's kernel is not keyed by
BATCH, SEQLEN, SEQ_SPLIT = 1, 13, 6
DT_LIMIT = (0.05, 1.0)  # clamps both ends of softplus(dt + dt_bias) for some positions
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
NAMES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")


@dataclasses.dataclass(frozen=True)
class Case:
    """One call of mamba_chunk_scan_combined: model dims, which optional inputs are on, dtypes, lengths."""

    nheads: int
    ngroups: int
    headdim: int
    dstate: int
    chunk_size: int
    flags: tuple  # the FLAGS that are on
    x_dtype: str = "float32"  # x, z (and y)
    bc_dtype: str = "float32"  # B, C
    batch: int = BATCH
    seqlen: int = SEQLEN
    backward: bool = True
    varlen: bool = False  # cu_seqlens + return_varlen_states (batch 1: cu_seqlens [0, SEQ_SPLIT, seqlen])
    state_dtype: str | None = None  # the call's state_dtype (None: the default)

    def on(self, flag: str) -> bool:
        return flag in self.flags


def case_of(direction: str, static: dict, dtypes: dict) -> Case:
    """The call that runs configuration (direction, static, dtypes): its dims and flags, FILL for the rest.
    head_sum's ``nheads`` is the number of dB / dC partials (groups x parts): one partial per head here."""
    if direction not in FORWARD + BACKWARD:
        raise CheckFailed(f"ssd: unknown direction {direction!r} (expected one of {sorted(FORWARD + BACKWARD)})")
    dims = dict(FILL, **{k: static[k] for k in ("nheads", "ngroups", "headdim", "dstate", "chunk_size")
                         if k in static})
    dims.setdefault("nheads", 2 * dims["ngroups"])  # bmm_chunk: keyed by groups only
    xd = dtypes.get("x", dtypes.get("bc", dtypes.get("out", "float32")))
    bcd = dtypes.get("bc", dtypes.get("out", xd))
    flags = tuple(f for f in FLAGS if static.get(f, False))
    varlen = direction == "chunk_state_varlen"
    state = dtypes.get("state")  # chunk states in another dtype than float32 (state_passing / chunk_scan / varlen)
    if varlen and state is None and dtypes.get("out", bcd) != bcd:  # varlen states out in state_dtype, else C's
        state = dtypes["out"]
    return Case(**dims, flags=flags, batch=size("batch", BATCH), seqlen=size("seqlen", SEQLEN), x_dtype=xd, bc_dtype=bcd, backward=direction in BACKWARD, varlen=varlen,
                state_dtype=state)


def make_inputs(case: Case, seed: int = 0) -> dict:
    """The call's tensors, in their dtypes (None where the case has the input off): x, z (batch, seqlen,
    nheads, headdim); dt (batch, seqlen, nheads) f32; A, dt_bias (nheads,) f32; B, C (batch, seqlen, ngroups,
    dstate); D (nheads,) or (nheads, headdim) f32; initial_states (batch, nheads, headdim, dstate) f32;
    seq_idx (batch, seqlen) int32; and the loss weights gy (like y, exact in x's dtype) and gf (like the
    final states), so that the kernel and the reference see the same cotangents."""
    g = generator(seed)
    b, L, H, G, P, N = case.batch, case.seqlen, case.nheads, case.ngroups, case.headdim, case.dstate
    xd, bcd = DTYPES[case.x_dtype], DTYPES[case.bc_dtype]

    def r(*shape, scale=1.0, dtype=torch.float32):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    t = dict(x=r(b, L, H, P, dtype=xd), dt=r(b, L, H) - 1.0, A=-(torch.rand(H, generator=g) + 0.5),
             B=r(b, L, G, N, scale=0.5, dtype=bcd), C=r(b, L, G, N, scale=0.5, dtype=bcd))
    on = case.on
    t["D"] = (r(H, P) if on("D_has_hdim") else r(H)) if on("has_D") else None
    t["z"] = r(b, L, H, P, dtype=xd) if on("has_z") else None
    t["dt_bias"] = r(H, scale=0.5) if on("has_dt_bias") else None
    t["initial_states"] = r(b, H, P, N, scale=0.5) if on("has_init") else None
    t["seq_idx"] = seq_idx_of(b, L) if on("has_seq_idx") else None
    t["gy"] = r(b, L, H, P, dtype=xd).double()
    t["gf"] = r(b, H, P, N).double() if on("has_dfinal") else None
    t["cu_seqlens"] = torch.tensor([0, min(SEQ_SPLIT, L), L], dtype=torch.int32) if case.varlen else None
    return t


def seq_idx_of(batch: int, seqlen: int, split: int = SEQ_SPLIT) -> torch.Tensor:
    """(batch, seqlen) int32: sequence 0 up to ``split`` (exclusive), then row r's sequence id is r + 1 (the
    rows differ, and an id other than 1 follows 0)."""
    s = torch.zeros(batch, seqlen, dtype=torch.int32)
    s[:, split:] = torch.arange(1, batch + 1, dtype=torch.int32)[:, None]
    return s


def call_kwargs(case: Case) -> dict:
    """The flag arguments of the call (softplus, dt_limit)."""
    return dict(dt_softplus=case.on("dt_softplus"),
                dt_limit=DT_LIMIT if case.on("has_dt_limit") else (0.0, math.inf))


def varlen_kwargs(case: Case, t: dict) -> dict:
    """cu_seqlens / return_varlen_states / state_dtype of the call (empty where the case has them off)."""
    kw = dict(cu_seqlens=t["cu_seqlens"], return_varlen_states=True) if case.varlen else {}
    if case.state_dtype is not None:
        kw["state_dtype"] = DTYPES[case.state_dtype]
    return kw


def run(fn, case: Case, t: dict, dtype=None, **kw) -> dict:
    """``fn`` (mamba_chunk_scan_combined or the reference, with mamba_ssm's signature) on copies of ``t``
    (cast to ``dtype`` if given) -> {"y", "final_states" (None unless it takes a loss), "d<name>" for each
    differentiable input present}; the gradients of sum(y * gy) + sum(final * gf) when case.backward."""
    leaves = {}
    for k in NAMES:
        v = t[k]
        if v is not None:
            v = v.detach().to(dtype or v.dtype).clone().requires_grad_(case.backward)
        leaves[k] = v
    rest = {k: leaves[k] for k in NAMES[5:]}
    out = fn(leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], case.chunk_size, **rest,
             seq_idx=t["seq_idx"], return_final_states=True, **call_kwargs(case), **varlen_kwargs(case, t), **kw)
    y, final = out[:2]
    res = {"y": y.detach(), "final_states": final.detach() if t["gf"] is not None else None}
    if case.varlen:
        res["varlen_states"] = out[2].detach()
    if case.backward:
        loss = (y.double() * t["gy"]).sum()
        if t["gf"] is not None:
            loss = loss + (final.double() * t["gf"]).sum()
        loss.backward()
        res.update({"d" + k: v.grad for k, v in leaves.items() if v is not None})
    return res


def reference(case: Case, t: dict) -> dict:
    """:func:`run` of the float64 recurrence on the same inputs."""
    from ...reference.ssd import ssd_recurrence_ref, ssd_varlen_states_ref

    def ref(x, dt, A, B, C, chunk_size, cu_seqlens=None, return_varlen_states=False, state_dtype=None, **kw):
        out = ssd_recurrence_ref(x, dt, A, B, C, **kw)
        if not return_varlen_states:
            return out
        v = ssd_varlen_states_ref(x, dt, A, B, C, chunk_size, cu_seqlens, dt_bias=kw["dt_bias"],
                                  initial_states=kw["initial_states"], seq_idx=kw["seq_idx"],
                                  dt_softplus=kw["dt_softplus"], dt_limit=kw["dt_limit"])
        return (*out, v)

    return run(ref, case, t, dtype=torch.float64)


def compare_all(got: dict, ref: dict, state_dtype: str | None = None) -> None:
    """CheckFailed naming the first output or gradient off its reference. Tolerances: the output dtype's
    (simcheck.tolerance; the state dtype's where chunk states are stored in a lower precision), atol scaled by
    the reference's largest magnitude (these are sums over up to seqlen x heads x headdim terms: the rounding
    grows with the sum)."""
    for name, r in ref.items():
        v = got.get(name)
        if r is None:
            continue
        if v is None:
            raise CheckFailed(f"{name}: missing (the reference has it)")
        rtol, atol = max(tolerance(v.dtype), tolerance(state_dtype or "float32"))
        compare(name, v, r, rtol, atol * max(1.0, r.abs().max().item()))


def run_simulated(case: Case, t: dict, arch: str) -> tuple[dict, list]:
    """:func:`run` of mamba_chunk_scan_combined inside simulate_cuda(arch) -> (results, kernel keys run)."""
    import tvm_mamba

    with recording() as keys, target(arch):
        got = run(tvm_mamba.mamba_chunk_scan_combined, case, t)
    return got, keys


def check(direction: str, static: dict, dtypes: dict, arch: str) -> None:
    """Run one build-check configuration of ssd through the harness (see the module docstring); the chunk scan
    with ``diag_skip`` runs through Mamba-3's chunked forward (simcheck/mamba3.py), its only caller, and its
    backward kernel is called directly (:func:`check_scan_bwd`)."""
    if static.get("diag_skip") and direction == "chunk_scan_bwd":
        return check_scan_bwd(static, dtypes, arch)
    if static.get("step_group", 1) > 1:  # Mamba-3 MIMO's grouped chunk scan: its kernel called directly
        return check_scan_fwd(static, dtypes, arch)
    if static.get("diag_skip"):
        from .mamba3 import check_scan

        return check_scan(static, dtypes, arch)
    case = case_of(direction, static, dtypes)
    if direction != "head_sum":  # head_sum's configuration runs only at batch x nchunks = 1 (module docstring)
        case = dataclasses.replace(case, seqlen=extent(case.seqlen, case.chunk_size))
    t = make_inputs(case)
    got, keys = run_simulated(case, t, arch)
    ran(keys, OP, direction, static, dtypes)
    compare_all(got, reference(case, t), case.state_dtype)


# Mamba-3's chunk-scan backward (ssd_chunk_scan_bwd with diag_skip), its kernel called directly as
# torch_ops/ssd.py's ssd_bwd calls the Mamba-2 one, against autograd of the float64 strict chunk scan
# (reference/ssd.py ssd_chunk_scan_strict_ref). Also the CPU kernel's test (tests/compute/test_ssd.py).
SCAN_BWD_GRADS = ("x", "B", "C", "dt", "dA_step", "D")  # the leaves whose gradients the kernel computes


def scan_bwd_inputs(dims, batch: int, seqlen: int, seed: int = 0) -> dict:
    """Inputs of ssd_chunk_scan_bwd with diag_skip at ScanBwdDims ``dims``: x, z, dy (batch, seqlen, nheads,
    headdim) in x_dtype (z None without has_z); B, C (batch, seqlen, ngroups, dstate) in bc_dtype; dt, dA_step
    (dt' times an A in [-1.5, -0.5)), D: (batch, nheads, nchunks, chunk_size) f32, dt and the steps 0 past
    seqlen; Sin, dSo (the state entering each chunk and the gradient of the one leaving it): (batch, nchunks,
    nheads, headdim, dstate) f32."""
    g = generator(seed)
    H, G, P, N, Q = dims.nheads, dims.ngroups, dims.headdim, dims.dstate, dims.chunk_size
    nc = -(-seqlen // Q)
    xd, bcd = DTYPES[dims.x_dtype], DTYPES[dims.bc_dtype]
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    live = (torch.arange(nc * Q) < seqlen).float().view(nc, Q)
    dt = torch.nn.functional.softplus(r(batch, H, nc, Q)) * 0.5 * live
    A = -(torch.rand(H, generator=g) + 0.5)
    return dict(x=r(batch, seqlen, H, P).to(xd), z=r(batch, seqlen, H, P).to(xd) if dims.has_z else None,
                dy=r(batch, seqlen, H, P).to(xd), B=(0.5 * r(batch, seqlen, G, N)).to(bcd),
                C=(0.5 * r(batch, seqlen, G, N)).to(bcd), dt=dt, dA_step=dt * A[:, None, None], D=r(batch, H, nc, Q),
                Sin=0.5 * r(batch, nc, H, P, N), dSo=0.5 * r(batch, nc, H, P, N))


def scan_bwd_run(dims, t: dict) -> dict:
    """ssd_chunk_scan_bwd on ``t`` (the CPU kernel, or the CUDA one inside simulate_cuda) -> {"dx", "dB", "dC",
    "ddt", "ddA_step", "dD"}: dB / dC its per-part partials summed over each group's parts, dD per position."""
    from ...compute.ssd.dims import head_parts
    from ...torch_ops._dlpack import dummy, kernel_for, prepare

    x, B, C = t["x"], t["B"], t["C"]
    b, L, H, P = x.shape
    G, N, nc, Q = B.shape[2], B.shape[3], t["dt"].shape[2], t["dt"].shape[3]
    Bp, Cp = (torch.nn.functional.pad(v.double(), (0, 0, 0, 0, 0, nc * Q - L)).view(b, nc, Q, G, N) for v in (B, C))
    cb = torch.einsum("bclgn,bcsgn->bcgls", Cp, Bp).float()  # ssd_bmm_chunk's C_l . B_s
    dA_cs = torch.cumsum(t["dA_step"].double(), -1).float()
    parts = head_parts(b, nc, H, G)
    dx = torch.empty_like(x)
    dBp, dCp = (torch.empty(b, L, G * parts, N) for _ in range(2))
    ddt, ddA, dD = (torch.empty(b, H, nc, Q) for _ in range(3))
    z = prepare(t["z"]) if t["z"] is not None else dummy(x.device, x.dtype, 4)
    kern = kernel_for("ssd", "chunk_scan_bwd", x.device, dims, batch=b, seqlen=L)
    kern(prepare(x), z, prepare(t["dy"]), prepare(B), prepare(C), cb, t["dt"], dA_cs, t["Sin"], t["dSo"], t["D"],
         dummy(x.device, torch.int32, 2), dx, dBp, dCp, ddt, ddA, dD, torch.empty(b, nc, G * parts, Q, Q))
    return dict(dx=dx, dB=dBp.view(b, L, G, parts, N).sum(3), dC=dCp.view(b, L, G, parts, N).sum(3), ddt=ddt,
                ddA_step=ddA, dD=dD)


def scan_bwd_reference(t: dict, dtype=torch.float64, step_group: int = 1) -> dict:
    """The gradients :func:`scan_bwd_run` returns, by autograd of L = <dy, y> + <dSo, S> through
    ssd_chunk_scan_strict_ref (grouped by ``step_group``) run in ``dtype`` (float64: the oracle; bf16: its
    drift, mamba_ssm's rule)."""
    from ...reference.ssd import ssd_chunk_scan_strict_ref

    leaves = {k: t[k].detach().to(dtype).requires_grad_() for k in SCAN_BWD_GRADS}
    z = t["z"].to(dtype) if t["z"] is not None else None
    y, states = ssd_chunk_scan_strict_ref(**leaves, states_in=t["Sin"].to(dtype), z=z, step_group=step_group)
    loss = (y.double() * t["dy"].double()).sum() + (states.double() * t["dSo"].double()).sum()
    loss.backward()
    g = {k: v.grad for k, v in leaves.items()}
    return dict(dx=g["x"], dB=g["B"], dC=g["C"], ddt=g["dt"], ddA_step=g["dA_step"], dD=g["D"])


def scan_fwd_run(dims, t: dict) -> torch.Tensor:
    """ssd_chunk_scan with diag_skip (ScanDims ``dims``, has_init: t's Sin enters chunk 0) on ``t``
    (:func:`scan_bwd_inputs`) -> y (batch, seqlen, nheads, headdim) in x's dtype, z-gated with has_z."""
    from ...torch_ops._dlpack import dummy, kernel_for, prepare

    x, B, C = t["x"], t["B"], t["C"]
    b, L, H, P = x.shape
    G, N, nc, Q = B.shape[2], B.shape[3], t["dt"].shape[2], t["dt"].shape[3]
    Bp, Cp = (torch.nn.functional.pad(v.double(), (0, 0, 0, 0, 0, nc * Q - L)).view(b, nc, Q, G, N) for v in (B, C))
    cb = torch.einsum("bclgn,bcsgn->bcgls", Cp, Bp).float()
    dA_cs = torch.cumsum(t["dA_step"].double(), -1).float()
    y = torch.empty_like(x)
    z = prepare(t["z"]) if t["z"] is not None else dummy(x.device, x.dtype, 4)
    kern = kernel_for("ssd", "chunk_scan", x.device, dims, batch=b, seqlen=L)
    kern(prepare(x), z, cb, prepare(C), t["dt"], dA_cs, t["Sin"].to(DTYPES[dims.state_dtype]), t["D"],
         dummy(x.device, torch.int32, 2), y, torch.empty_like(x) if t["z"] is not None else dummy(x.device, x.dtype, 4))
    return y


def check_scan_fwd(static: dict, dtypes: dict, arch: str) -> None:
    """An ssd_chunk_scan configuration with diag_skip (and step_group) called directly: batch 1, two chunks
    (the second ragged, 3 long), against the float64 strict (grouped) chunk scan."""
    from ...compute.ssd.dims import ScanDims
    from ...reference.ssd import ssd_chunk_scan_strict_ref

    dims = ScanDims.from_key(static, dtypes)
    t = scan_bwd_inputs(dims, size("batch", 1), size("seqlen", dims.chunk_size + 3))
    if not dims.has_init:
        t["Sin"][:, 0] = 0  # no state enters chunk 0 (the kernel does not read it)
    with recording() as keys, target(arch):
        got = scan_fwd_run(dims, t)
    ran(keys, OP, "chunk_scan", static, dtypes)
    d64 = {k: t[k].double() for k in SCAN_BWD_GRADS}
    want, _ = ssd_chunk_scan_strict_ref(**d64, states_in=t["Sin"].double(), step_group=dims.step_group,
                                        z=t["z"].double() if t["z"] is not None else None)
    rtol, atol = tolerance(got.dtype)
    compare(f"ssd.chunk_scan {arch}: y", got, want, rtol, atol * max(1.0, want.abs().max().item()))


def check_scan_bwd(static: dict, dtypes: dict, arch: str) -> None:
    """The ssd_chunk_scan_bwd configuration with diag_skip: batch 1, two chunks (the second ragged, 3 long)."""
    from ...compute.ssd.dims import ScanBwdDims

    dims = ScanBwdDims.from_key(static, dtypes)
    t = scan_bwd_inputs(dims, size("batch", 1), size("seqlen", dims.chunk_size + 3))
    with recording() as keys, target(arch):
        got = scan_bwd_run(dims, t)
    ran(keys, OP, "chunk_scan_bwd", static, dtypes)
    for name, r in scan_bwd_reference(t, step_group=dims.step_group).items():
        rtol, atol = tolerance(got[name].dtype)
        compare(f"ssd.chunk_scan_bwd {arch}: {name}", got[name], r, rtol, atol * max(1.0, r.abs().max().item()))
