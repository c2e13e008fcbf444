"""sim-check of the selective scan: ``fwd`` / ``bwd`` through ``selective_scan_fn`` (+ autograd), ``update``
through ``selective_state_update``, on the CUDA execution harness against the float64 references.

Inputs keep the configuration's model dims (dim, dstate, groups, flags) and use batch 1-2 and a seqlen
that crosses a checkpoint-chunk boundary and ends in a partial chunk (``chunk + 3`` steps): the
backward's chunk-by-chunk recompute and the forward's checkpoint writes both see a chunk edge.
"""
from __future__ import annotations

import torch

from . import WEBGPU, CheckFailed, compare, ran, recording, tolerance, extent, generator, size, target
from ...compute.selective_scan.dims import WEBGPU_BLOCK, WEBGPU_PRIVATE_FLOATS, block_size, chunk_size

OP = "selective_scan"
_TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def _dtype(name: str) -> torch.dtype:
    if name not in _TORCH:
        raise CheckFailed(f"{OP}: unknown dtype {name!r}")
    return _TORCH[name]


def _bc(groups: int, batch: int, dim: int, dstate: int, seqlen: int, dtype, g) -> torch.Tensor:
    """B or C in the user layout for ``groups``: 0 -> (dim, dstate); 1 -> (batch, dstate, seqlen) (Mamba-1);
    g > 1 -> (batch, g, dstate, seqlen)."""
    if groups == 0:
        return torch.randn(dim, dstate, generator=g).to(dtype)
    if groups == 1:
        return torch.randn(batch, dstate, seqlen, generator=g).to(dtype)
    return torch.randn(batch, groups, dstate, seqlen, generator=g).to(dtype)


def _complex(t: torch.Tensor, acc) -> torch.Tensor:
    """Pairs (..., 2) of a real tensor as complex64/128."""
    return torch.view_as_complex(t.to(acc).contiguous())


def scan_inputs(static: dict, dtypes: dict, batch: int, seqlen: int, seed: int = 0, complex_A: bool = False) -> dict:
    """selective_scan_fn keyword arguments with ``static``'s dims and flags (A in [-1.2, -0.2], small dt).
    complex_A: A with imaginary parts in [-pi, pi]; time-invariant B/C, initial_state complex; varying B/C
    real (batch, [groups,] dstate, 2 seqlen) ((re, im) interleaved in time, mamba_ssm's layout)."""
    g = generator(seed)
    dim, dstate = static["dim"], static["dstate"]
    u_dt = _dtype(dtypes["u"])
    acc = torch.float64 if u_dt == torch.float64 else torch.float32
    sp = bool(static["delta_softplus"])
    delta = 0.5 * torch.randn(batch, dim, seqlen, generator=g)
    A = (-0.2 - torch.rand(dim, dstate, generator=g)).to(acc)
    L_bc = 2 * seqlen if complex_A else seqlen
    B = _bc(static["b_groups"], batch, dim, dstate, L_bc, _dtype(dtypes["B"]), g)
    C = _bc(static["c_groups"], batch, dim, dstate, L_bc, _dtype(dtypes["C"]), g)
    init = torch.randn(batch, dim, dstate, generator=g).to(acc) if static["has_init"] else None
    if complex_A:
        A = _complex(torch.stack([A, torch.pi * (2 * torch.rand(dim, dstate, generator=g) - 1)], -1), acc)
        B, C = (_complex(torch.stack([M, torch.randn(dim, dstate, generator=g).to(M.dtype)], -1), acc)
                if M.dim() == 2 else M for M in (B, C))
        if init is not None:
            init = _complex(torch.stack([init, torch.randn(batch, dim, dstate, generator=g)], -1), acc)
    return dict(
        u=torch.randn(batch, dim, seqlen, generator=g).to(u_dt),
        delta=(delta if sp else delta.abs()).to(u_dt),
        A=A, B=B, C=C,
        D=torch.randn(dim, generator=g).to(acc) if static["has_D"] else None,
        z=torch.randn(batch, dim, seqlen, generator=g).to(u_dt) if static["has_z"] else None,
        delta_bias=(0.1 * torch.randn(dim, generator=g)).to(acc) if static["has_delta_bias"] else None,
        delta_softplus=sp,
        initial_state=init,
    )


def _to64(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.complex128 if v.is_complex() else torch.float64)


def _real(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t) if t.is_complex() else t


TENSORS = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial_state")


def scan_results(inputs: dict, grads: bool, arch: str, grad_seed: int = 1, **sim) -> tuple[dict, list]:
    """{name: (simulated, float64 reference)} for out, last_state and (grads) d<every tensor input>, and the
    keys the simulated calls ran. dout / dlast are random (the backward sees both gradient paths); ``sim``:
    simulate_cuda's order / seed."""
    import tvm_mamba
    from ...reference.selective_scan import selective_scan_ref

    ours = {k: (v.clone().requires_grad_(grads) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
    ref = {k: (_to64(v).requires_grad_(grads) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
    with recording() as keys, target(arch, **sim):
        out, last = tvm_mamba.selective_scan_fn(**ours, return_last_state=True)
        if grads:
            g = generator(grad_seed)
            dout = torch.randn(out.shape, generator=g).to(out.dtype)
            dlast = torch.randn(last.shape, generator=g, dtype=last.dtype)
            torch.autograd.backward([out, last], [dout, dlast])
    rout, rlast = selective_scan_ref(**ref, return_last_state=True)
    res = {"out": (out, rout), "last_state": (_real(last), _real(rlast))}
    if grads:
        torch.autograd.backward([rout, rlast], [dout.double(), _to64(dlast)])
        for k in TENSORS:
            if isinstance(ours[k], torch.Tensor):
                if ours[k].grad is None:
                    raise CheckFailed(f"{OP}: no gradient for {k}")
                res["d" + k] = (_real(ours[k].grad), _real(ref[k].grad))
    return res, keys


def compare_all(res: dict, label: str) -> None:
    """compare() every entry at its dtype's tolerance, atol scaled by the reference's magnitude (the
    gradients of A, B, D, delta_bias are sums over batch x seqlen x channels)."""
    for name, (got, want) in res.items():
        rtol, atol = tolerance(got.dtype)
        compare(f"{label}: {name}", got, want, rtol, atol * max(1.0, want.abs().max().item()))


def _check_scan(direction: str, static: dict, dtypes: dict, arch: str) -> None:
    """fwd / bwd, or fwd_complex / bwd_complex (complex A, chunk sized for 2 x dstate real values). On WebGPU
    the configuration at the torch op's WebGPU chunk (a lane's 8 KB of private memory: ``chunk_size``)."""
    cplx = direction.endswith("_complex")
    states = 2 * static["dstate"] if cplx else static["dstate"]
    if static["chunk"] != chunk_size(states):
        raise CheckFailed(f"{OP}: chunk={static['chunk']} is not the torch op's choice {chunk_size(states)}")
    if arch == WEBGPU:  # the torch op's WebGPU chunk and block
        static = dict(static, chunk=chunk_size(states, WEBGPU_PRIVATE_FLOATS))
        if direction.startswith("bwd"):
            static["block"] = block_size(static["dim"], static["b_groups"], static["c_groups"], WEBGPU_BLOCK)
    want_chunk = static["chunk"]
    if direction.startswith("bwd") and arch != WEBGPU:
        want_block = block_size(static["dim"], static["b_groups"], static["c_groups"])
        if static.get("block") != want_block:
            raise CheckFailed(f"{OP}: block={static.get('block')} is not the torch op's choice {want_block}")
    inputs = scan_inputs(static, dtypes, batch=size("batch", 2 if static["dim"] <= 256 else 1),
                         seqlen=size("seqlen", extent(want_chunk + 3, want_chunk)),
                         complex_A=cplx)
    res, keys = scan_results(inputs, grads=direction.startswith("bwd"), arch=arch)
    ran(keys, OP, direction, static, dtypes)
    compare_all(res, f"{OP}.{direction} {arch}")


def update_inputs(static: dict, dtypes: dict, batch: int, seed: int = 0) -> dict:
    """selective_state_update keyword arguments: the Mamba-1 layout ((batch, dim, dstate) state) when
    headdim == 1, with B / C (batch, dstate) under ``mamba1_layout`` (the kernel that takes Mamba-1's tensors
    as they are), else (batch, ngroups, dstate); else the Mamba-2 head layout. Optional dtype keys as in the kernel key: ``state`` (a 16-bit
    state), ``dt``, ``z``, and ``idx``: a pool of batch + 2 state slots, rows mapped to them in reverse
    order, the second row (when batch > 1) a padding row (index -1). ``tie_hdim``: A, dt, D, dt_bias one value
    per head, passed as expanded stride-0 views (Mamba2.step's call)."""
    g = generator(seed)
    H, P, N, G = static["nheads"], static["headdim"], static["dstate"], static["ngroups"]
    x_dt = _dtype(dtypes["x"])
    acc = torch.float64 if x_dt == torch.float64 else torch.float32
    st_dt, dt_dt, z_dt = (_dtype(dtypes[k]) if k in dtypes else d for k, d in
                          (("state", acc), ("dt", x_dt), ("z", x_dt)))
    lead = (H,) if P == 1 else (H, P)
    bc_shape = (batch, N) if static.get("mamba1_layout") else (batch, G, N)
    sp = bool(static["dt_softplus"])
    dt = 0.5 * torch.randn(batch, *lead, generator=g)
    nslots = batch + 2 if "idx" in dtypes else batch
    inp = dict(
        state=torch.randn(nslots, *lead, N, generator=g).to(st_dt),
        x=torch.randn(batch, *lead, generator=g).to(x_dt),
        dt=(dt if sp else dt.abs()).to(dt_dt),
        A=(-0.2 - torch.rand(*lead, N, generator=g)).to(acc),
        B=torch.randn(*bc_shape, generator=g).to(_dtype(dtypes["B"])),
        C=torch.randn(*bc_shape, generator=g).to(_dtype(dtypes["C"])),
        D=torch.randn(*lead, generator=g).to(acc) if static["has_D"] else None,
        z=torch.randn(batch, *lead, generator=g).to(z_dt) if static["has_z"] else None,
        dt_bias=(0.1 * torch.randn(*lead, generator=g)).to(acc) if static["has_dt_bias"] else None,
        dt_softplus=sp,
    )
    if static.get("tie_hdim"):
        _tie_heads(inp, batch, H, P, N, g)
    if "idx" in dtypes:
        idx = torch.arange(nslots - 1, nslots - 1 - batch, -1)
        if batch > 1:
            idx[1] = -1
        inp["state_batch_indices"] = idx.to(_INDEX[dtypes["idx"]])
    return inp


def _tie_heads(inp: dict, batch: int, H: int, P: int, N: int, g) -> None:
    """Replace A, dt, D, dt_bias of ``inp`` by one value per head, expanded over headdim (A also over dstate)."""
    A, dt = inp["A"], inp["dt"]
    inp["A"] = (-0.2 - torch.rand(H, generator=g)).to(A.dtype)[:, None, None].expand(H, P, N)
    inp["dt"] = (0.5 * torch.randn(batch, H, generator=g)).to(dt.dtype)[:, :, None].expand(batch, H, P)
    if not inp["dt_softplus"]:
        inp["dt"] = inp["dt"].abs()
    for name in ("D", "dt_bias"):
        if inp[name] is not None:
            inp[name] = inp[name][:, :1].expand(H, P)


_INDEX = {"int32": torch.int32, "int64": torch.int64}


def update_results(inputs: dict, arch: str, steps: int = 2, **sim) -> tuple[dict, list]:
    """``steps`` decode steps on one state (the in-place update is read back by the next step):
    {out_i, state: (simulated, float64 reference)} and the keys run. x/dt/z are reused each step; the
    reference rounds a 16-bit state to its dtype after each step, as the kernel stores it."""
    import tvm_mamba
    from ...reference.selective_scan import selective_state_update_ref

    state = inputs["state"].clone()
    ref_state = inputs["state"].double()
    low = inputs["state"].dtype in (torch.float16, torch.bfloat16)
    rest = {k: v for k, v in inputs.items() if k != "state"}
    res = {}
    with recording() as keys, target(arch, **sim):
        outs = [tvm_mamba.selective_state_update(state, **rest) for _ in range(steps)]
    for i, out in enumerate(outs):
        ref_out, ref_state = selective_state_update_ref(ref_state, **rest,
                                                        state_dtype=inputs["state"].dtype if low else None)
        res[f"out[{i}]"] = (out, ref_out)
    res["state"] = (state, ref_state)
    return res, keys


def _check_update(static: dict, dtypes: dict, arch: str) -> None:
    res, keys = update_results(update_inputs(static, dtypes, batch=size("batch", 2)), arch)
    ran(keys, OP, "update", static, dtypes)
    compare_all(res, f"{OP}.update {arch}")


def check(direction: str, static: dict, dtypes: dict, arch: str) -> None:
    """Run one build-check configuration of the selective scan in the harness (module docstring).
    "fwd_chunked" is a CPU-only algorithm (CUDA serves every forward with "fwd"): not checkable here;
    "fwd_complex" / "bwd_complex" are the complex-A kernels."""
    if direction in ("fwd", "bwd", "fwd_complex", "bwd_complex"):
        _check_scan(direction, static, dtypes, arch)
    elif direction == "update":
        _check_update(static, dtypes, arch)
    else:
        raise CheckFailed(f"{OP}: unknown direction {direction!r} (CUDA runs fwd, bwd, update, fwd_complex, "
                          "bwd_complex)")
