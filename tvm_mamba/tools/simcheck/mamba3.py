"""sim-check of Mamba-3 on the CUDA execution harness against the float64 reference (tvm_mamba/reference/mamba3.py):
``siso_step`` through ``mamba3_siso_step`` (``mimo_step`` through ``mamba3_mimo_step``, against
reference/mamba3_mimo.py), two decode steps chained through the returned states;
``siso_preprocess`` through ``mamba3_siso_combined`` (the preprocess and the four SSD pieces it feeds, each
checked to have run): batch 2, seqlen chunk_size + 3 (two chunks, the second ragged), out and final states;
``siso_preprocess_bwd``, the kernel itself against torch.autograd of ``mamba3_siso_preprocess_ref`` at the
same sizes (every gradient it returns); packed-sequence (``has_seq_idx``) preprocess configurations, forward
and backward, as the kernel alone (batch 1, three sequences) against the reference; ``backward_results``
runs a whole mamba3_siso_combined forward + backward in the harness (tests/cudasim/test_mamba3.py, at small
sizes).
The SSD configuration ``chunk_scan`` with ``diag_skip`` (compute/ssd's build-check list) is checked here too
(``check_scan``, from simcheck/ssd.py): only the Mamba-3 forward calls it."""
from __future__ import annotations

import math

import torch

from . import CheckFailed, compare, ran, recording, tolerance, extent, generator, size, target

OP = "mamba3"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def step_inputs(static: dict, dtypes: dict, batch: int, seed: int = 0) -> tuple[dict, list]:
    """(mamba3_siso_step keyword arguments without Input_States, [angle, ssm, k, v] states) of a
    configuration: Q / K in ``qk``, V in ``v``, Z / K state / V state in their key dtypes (defaults: v's,
    the accumulation dtype, v's), the rest in the accumulation dtype; Trap as logits, ADT = A DT < 0."""
    g = generator(seed)
    H, HQ, N, P, S = (static[k] for k in ("nheads", "nheads_qk", "headdim_qk", "headdim_v", "headdim_angles"))
    qk, v = _DTYPES[dtypes["qk"]], _DTYPES[dtypes["v"]]
    acc = torch.float64 if v == torch.float64 else torch.float32
    z, ks, vs = (_DTYPES[dtypes[k]] if k in dtypes else d for k, d in (("z", v), ("kstate", acc), ("vstate", v)))
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    dt = torch.nn.functional.softplus(r(batch, H)) * 0.5
    args = dict(Q=r(batch, HQ, N).to(qk), K=r(batch, HQ, N).to(qk), V=r(batch, H, P).to(v),
                ADT=(-(torch.rand(H, generator=g) + 0.1) * dt).to(acc), DT=dt.to(acc), Trap=r(batch, H).to(acc),
                Q_bias=(0.3 * r(H, N)).to(acc), K_bias=(0.3 * r(H, N)).to(acc), Angles=(2 * r(batch, H, S)).to(acc),
                D=r(H).to(acc) if static["has_D"] else None, Z=r(batch, H, P).to(z) if static["has_z"] else None)
    states = [(torch.rand(batch, H, S, generator=g) * 2 * math.pi).to(acc), (0.5 * r(batch, H, P, N)).to(acc),
              r(batch, H, N).to(ks), r(batch, H, P).to(vs)]
    return args, states


def mimo_step_inputs(static: dict, dtypes: dict, batch: int, seed: int = 0) -> tuple[dict, list]:
    """``step_inputs`` at MIMO dims (MimoStepDims' fields: mimo_rank R, has_outproj) in mamba3_mimo_step's
    layouts: Q / K (batch, R, nheads_qk, headdim_qk), the biases (nheads, R, headdim_qk), MIMO_V / MIMO_Z /
    MIMO_Out (nheads, R, headdim_v) around upstream's init (1 / R, 1, 1 / R; MIMO_Z None without has_z, MIMO_Out
    None without has_outproj), the K state (batch, R, nheads, headdim_qk); the rest as ``step_inputs``."""
    args, states = step_inputs(static, dtypes, batch, seed)
    g = generator(seed + 7919)
    R, H, P = static["mimo_rank"], static["nheads"], static["headdim_v"]
    (_, HQ, N), acc = args["Q"].shape, args["DT"].dtype
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    args.update(Q=r(batch, R, HQ, N).to(args["Q"].dtype), K=r(batch, R, HQ, N).to(args["K"].dtype),
                Q_bias=(0.3 * r(H, R, N)).to(acc), K_bias=(0.3 * r(H, R, N)).to(acc),
                MIMO_V=((1 + 0.5 * r(H, R, P)) / R).to(acc),
                MIMO_Z=(1 + 0.5 * r(H, R, P)).to(acc) if static["has_z"] else None,
                MIMO_Out=((1 + 0.5 * r(H, R, P)) / R).to(acc) if static.get("has_outproj", True) else None)
    states[2] = r(batch, R, H, N).to(states[2].dtype)
    return args, states


def step_results(static: dict, dtypes: dict, arch: str, batch: int = 2, steps: int = 2, **sim) -> tuple[dict, list]:
    """``steps`` decode steps (SISO, or MIMO for dims with a ``mimo_rank``), each fed the previous step's
    returned states (cast to the configuration's state dtypes, as Mamba3's inference cache copies them):
    {name: (simulated, float64 reference of that step on the same inputs)} and the keys run."""
    import tvm_mamba
    from ...reference.mamba3 import mamba3_siso_step_ref
    from ...reference.mamba3_mimo import mamba3_mimo_step_ref

    mimo = "mimo_rank" in static
    step, ref_step = ((tvm_mamba.mamba3_mimo_step, mamba3_mimo_step_ref) if mimo else
                      (tvm_mamba.mamba3_siso_step, mamba3_siso_step_ref))
    args, states = (mimo_step_inputs if mimo else step_inputs)(static, dtypes, batch)
    res = {}
    with recording() as keys:
        for i in range(steps):
            with target(arch, **sim):
                out, new = step(**args, Input_States=states)
            ref, ref_new = ref_step(**args, Input_States=states)
            res[f"out[{i}]"] = (out, ref)
            for name, got, want in zip(("angle_state", "ssm_state", "k_state"), new, ref_new):
                res[f"{name}[{i}]"] = (got, want)
            states = [s.to(old.dtype) for s, old in zip(new, states[:3])] + [new[3].to(states[3].dtype)]
    return res, keys


def combined_inputs(static: dict, dtypes: dict, batch: int, seqlen: int, has_z: bool, seed: int = 0) -> dict:
    """mamba3_siso_combined keyword arguments for preprocess dims ``static`` (PreDims' fields): Q / K in ``qk``,
    V and Z in ``vstate`` (V's dtype is the V state's), the K state in ``kstate`` (default float32), the rest
    float32; Trap as logits, ADT = A DT < 0, input states with ``has_init``."""
    g = generator(seed)
    H, HQ, N, P, S = (static[k] for k in ("nheads", "nheads_qk", "headdim_qk", "headdim_v", "headdim_angles"))
    qk, v, ks = (_DTYPES[dtypes.get(k, "float32")] for k in ("qk", "vstate", "kstate"))
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    dt = torch.nn.functional.softplus(r(batch, H, seqlen)) * 0.5
    args = dict(Q=r(batch, seqlen, HQ, N).to(qk), K=r(batch, seqlen, HQ, N).to(qk), V=r(batch, seqlen, H, P).to(v),
                ADT=-(torch.rand(H, 1, generator=g) + 0.1) * dt, DT=dt, Trap=r(batch, H, seqlen),
                Q_bias=0.3 * r(H, N), K_bias=0.3 * r(H, N), Angles=2 * r(batch, seqlen, H, S),
                D=r(H) if static.get("has_D") else None, Z=r(batch, seqlen, H, P).to(v) if has_z else None)
    if static.get("has_init"):
        args["Input_States"] = (torch.rand(batch, H, S, generator=g) * 2 * math.pi, 0.5 * r(batch, H, P, N),
                                r(batch, H, N).to(ks), r(batch, H, P).to(v))
    return args


def combined_results(static: dict, dtypes: dict, arch: str, has_z: bool = True, batch: int = 2) -> tuple[dict, list]:
    """One mamba3_siso_combined call in the harness at preprocess dims ``static``: {name: (simulated, float64
    reference)} for out and the final angle, ssm and k states, and the keys run."""
    import tvm_mamba
    from ...reference.mamba3 import mamba3_siso_combined_ref

    Q = static["chunk_size"]
    args = combined_inputs(static, dtypes, size("batch", batch), size("seqlen", extent(Q + 3, Q)), has_z)
    with recording() as keys:
        with target(arch):
            got = tvm_mamba.mamba3_siso_combined(**args, chunk_size=Q, return_final_states=True)
    want = mamba3_siso_combined_ref(**args, return_final_states=True)
    return dict(zip(("out", "angle_state", "ssm_state", "k_state"), zip(got, want))), keys


def backward_results(static: dict, dtypes: dict, arch: str, batch: int = 2) -> tuple[dict, list]:
    """One mamba3_siso_combined forward + backward in the harness at preprocess dims ``static`` (Z given),
    for a random output gradient and random final-state gradients: {d<name>: (simulated, float64 reference
    gradient)} for every tensor argument and input state, and the keys run."""
    import tvm_mamba
    from ...reference.mamba3 import mamba3_siso_combined_ref

    Q = static["chunk_size"]
    args = combined_inputs(static, dtypes, size("batch", batch), size("seqlen", extent(Q + 3, Q)), has_z=True,
                           seed=1)
    g = generator(2)

    def grads(fn, dtype):
        leaves = {k: v.detach().to(dtype if dtype == torch.float64 else v.dtype).requires_grad_()
                  if isinstance(v, torch.Tensor) else v for k, v in args.items() if k != "Input_States"}
        names = [k for k, v in leaves.items() if isinstance(v, torch.Tensor)]
        if "Input_States" in args:
            leaves["Input_States"] = tuple(t.detach().to(dtype if dtype == torch.float64 else t.dtype)
                                           .requires_grad_() for t in args["Input_States"])
        outs = fn(**leaves, chunk_size=Q, return_final_states=True)
        loss = sum((o.double() * c).sum() for o, c in zip(outs, cot))
        tensors = [leaves[n] for n in names] + list(leaves.get("Input_States", ()))
        names += [f"{n}_state" for n in ("angle", "ssm", "k", "v")][:len(leaves.get("Input_States", ()))]
        return dict(zip(names, torch.autograd.grad(loss, tensors)))

    with torch.no_grad():
        shapes = [o.shape for o in mamba3_siso_combined_ref(**args, return_final_states=True)]
    cot = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    with recording() as keys:
        with target(arch):
            got = grads(tvm_mamba.mamba3_siso_combined, None)
    want = grads(mamba3_siso_combined_ref, torch.float64)
    return {f"d{k}": (got[k], want[k]) for k in got}, keys


def scan_of(static: dict, dtypes: dict, has_z: bool) -> tuple[dict, dict]:
    """The ssd_chunk_scan configuration (static, dtypes) a mamba3_siso_combined call at preprocess dims
    ``static`` / ``dtypes`` runs (as torch_ops/mamba3.py keys it)."""
    scan = dict(nheads=static["nheads"], ngroups=static["nheads"], headdim=static["headdim_v"],
                dstate=static["headdim_qk"], chunk_size=static["chunk_size"], has_seq_idx=False, has_D=True,
                D_has_hdim=False, has_z=has_z, has_init=static.get("has_init", False), diag_skip=True)
    if not scan["has_init"]:
        del scan["has_init"]  # OMIT_DEFAULT: left out of the key at its default
    return scan, {"x": dtypes.get("vstate", "float32"), "bc": "float32"}


def check_scan(static: dict, dtypes: dict, arch: str) -> None:
    """The ssd_chunk_scan configuration with ``diag_skip`` (simcheck/ssd.py hands it here): a
    mamba3_siso_combined call whose chunk scan is that configuration (1 Q/K head, headdim_angles
    dstate // 4), compared with the float64 reference."""
    pre = dict(nheads=static["nheads"], nheads_qk=1, headdim_qk=static["dstate"], headdim_v=static["headdim"],
               headdim_angles=max(static["dstate"] // 4, 1), chunk_size=static["chunk_size"], has_D=True,
               has_init=static.get("has_init", False))
    res, keys = combined_results(pre, {"qk": dtypes["x"], "vstate": dtypes["x"]}, arch, has_z=static["has_z"])
    ran(keys, "ssd", "chunk_scan", static, dtypes)
    _compare_all(res, "ssd.chunk_scan", arch)


PRE_BWD_OUTPUTS = ("dQh", "dKh", "dADT", "dDT", "dTrap", "dQb_part", "dKb_part", "dAngles", "dangle_state",
                   "dk_state", "dv_state")


def preprocess_results(static: dict, dtypes: dict, batch: int, seqlen: int, seq_idx=None) -> dict:
    """The forward preprocess kernel alone (on the CPU, or in the CUDA harness inside
    ``tvm_mamba.simulate_cuda``) on ``combined_inputs`` (ADT of position 1 below DA_MIN: a clamped step), with
    packed sequences where ``seq_idx`` (1, seqlen) int32 is given (angle_out then per sequence, zero-filled):
    {output name: (kernel result, float64 ``mamba3_siso_preprocess_ref``)} for q, k, dA_cs (with its padded
    slots), scale, skip, angle_out and, with has_init, init."""
    from ...compute.mamba3.dims import PreDims
    from ...reference.mamba3 import mamba3_siso_preprocess_ref
    from ...torch_ops._dlpack import kernel_for

    inp = combined_inputs(static, dtypes, batch, seqlen, has_z=False)
    inp["ADT"][..., min(1, seqlen - 1)] = -200.0
    H, N, P, A, Qc = (static[k] for k in ("nheads", "headdim_qk", "headdim_v", "headdim_angles", "chunk_size"))
    nc, nseq = -(-seqlen // Qc), batch if seq_idx is None else int(seq_idx.max()) + 1
    outs = [torch.empty(batch, seqlen, H, N), torch.empty(batch, seqlen, H, N)]
    outs += [torch.empty(batch, H, nc, Qc) for _ in range(3)] + [torch.zeros(nseq, H, A)]
    outs += [torch.empty(batch, H, P, N) if static.get("has_init") else torch.zeros(1, 1, 1, 1)]
    one = lambda n, dt="float32": torch.ones((1,) * n, dtype=_DTYPES[dt])  # noqa: E731
    opt = [inp["D"] if static.get("has_D") else one(1)]
    opt += list(inp["Input_States"]) if static.get("has_init") else [
        one(3), one(4), one(3, dtypes.get("kstate", "float32")), one(3, dtypes.get("vstate", "float32"))]
    dims = PreDims(**static, **{f"{k}_dtype": v for k, v in dtypes.items()})
    kernel_for(OP, "siso_preprocess", inp["Q"].device, dims, batch=batch, seqlen=seqlen)(
        *(inp[k] for k in ("Q", "K", "ADT", "DT", "Trap", "Q_bias", "K_bias", "Angles")), *opt, *outs,
        seq_idx if seq_idx is not None else torch.zeros(1, 1, dtype=torch.int32))
    ref = mamba3_siso_preprocess_ref(**{k: v for k, v in inp.items() if k not in ("V", "Z")}, chunk_size=Qc,
                                     seq_idx=seq_idx)
    names = ("q", "k", "dA_cs", "scale", "skip", "angle_out", "init")
    return {n: (got, want) for n, got, want in zip(names, outs, ref) if want is not None}


def preprocess_bwd_case(static: dict, dtypes: dict, batch: int, seqlen: int, seed: int = 0,
                        seq_idx=None) -> tuple[dict, dict]:
    """A preprocess backward call at PreDims fields ``static`` / dtypes (qk, vstate, kstate): (kernel
    arguments by name, in the kernel's order, gradient outputs and workspaces allocated, {output name: its
    float64 autograd reference}). Inputs as ``combined_inputs`` (ADT of position 1 below DA_MIN: a clamped
    step), random upstream gradients for every forward output; the dA_cs gradient G enters the kernel as
    ddA_step + ddecay = the within-chunk reverse cumsum of G (ddecay random). The reference is
    ``mamba3_siso_preprocess_ref`` on Q, K repeated per head (so its Q / K gradients are the kernel's per-head
    dQh / dKh) with the batch-summed bias gradients (the kernel's dQb_part / dKb_part summed over batch).
    ``seq_idx`` (1, seqlen) int32: packed sequences (has_seq_idx; daout then one row per sequence)."""
    from ...compute.mamba3.dims import PAIR_STEPS
    from ...reference.mamba3 import mamba3_siso_preprocess_ref

    g = generator(seed + 1)
    H, HQ, N, P, A, Qc = (static[k] for k in ("nheads", "nheads_qk", "headdim_qk", "headdim_v", "headdim_angles",
                                               "chunk_size"))
    inp = combined_inputs(dict(static, has_D=True), dtypes, batch, seqlen, has_z=False, seed=seed)
    inp["ADT"][..., min(1, seqlen - 1)] = -200.0
    has_init, nc = static.get("has_init", False), -(-seqlen // Qc)
    f32 = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    nseq = batch if seq_idx is None else int(seq_idx.max()) + 1
    grads = dict(dq=f32(batch, seqlen, H, N), dk=f32(batch, seqlen, H, N), dscale=f32(batch, H, nc, Qc),
                 dskip=f32(batch, H, nc, Qc), daout=f32(nseq, H, A), dinit=f32(batch, H, P, N))
    gda, ddecay = f32(batch, H, nc, Qc), f32(batch, H, nc)
    ddA = gda.flip(-1).cumsum(-1).flip(-1) - ddecay[..., None]
    leaves = {k: inp[k].double().requires_grad_() for k in ("ADT", "DT", "Trap", "Q_bias", "K_bias", "Angles")}
    Qh, Kh = (inp[k].double().repeat_interleave(H // HQ, dim=2).requires_grad_() for k in ("Q", "K"))
    states = [s.double().requires_grad_() for s in inp["Input_States"]] if has_init else None
    outs = mamba3_siso_preprocess_ref(Qh, Kh, **leaves, D=inp["D"], Input_States=states, chunk_size=Qc,
                                      seq_idx=seq_idx)
    pairs = [(o, gr) for o, gr in zip(outs, (grads["dq"], grads["dk"], gda, grads["dscale"], grads["dskip"],
                                             grads["daout"], grads["dinit"])) if o is not None]
    wrt = [Qh, Kh, *leaves.values()] + ([states[0], states[2], states[3]] if has_init else [])
    got = torch.autograd.grad([o for o, _ in pairs], wrt, [gr.double() for _, gr in pairs])
    ref = dict(zip(PRE_BWD_OUTPUTS, got))
    one = inp["Input_States"] if has_init else [None] * 4
    placeholder = lambda t, ndim, dtype=torch.float32: t if has_init else torch.zeros((1,) * ndim, dtype=dtype)  # noqa
    new = lambda *shape: torch.empty(*shape)  # noqa: E731
    parts = -(-seqlen // PAIR_STEPS)  # the bias gradients' parts: per (batch, block of PAIR_STEPS steps)
    args = dict(Q=inp["Q"], K=inp["K"], ADT=inp["ADT"], DT=inp["DT"], Trap=inp["Trap"], Q_bias=inp["Q_bias"],
                K_bias=inp["K_bias"], Angles=inp["Angles"], angle_state=placeholder(one[0], 3),
                k_state=placeholder(one[2], 3, _DTYPES[dtypes.get("kstate", "float32")]),
                v_state=placeholder(one[3], 3, _DTYPES[dtypes.get("vstate", "float32")]), dq=grads["dq"],
                dk=grads["dk"], dscale=grads["dscale"], ddA_step=ddA, dskip=grads["dskip"], ddecay=ddecay,
                daout=grads["daout"], dinit=placeholder(grads["dinit"], 4), dQh=new(batch, seqlen, H, N),
                dKh=new(batch, seqlen, H, N), dADT=new(batch, H, seqlen), dDT=new(batch, H, seqlen),
                dTrap=new(batch, H, seqlen), dQb_part=new(batch, parts, H, N), dKb_part=new(batch, parts, H, N),
                dAngles=new(batch, seqlen, H, A), dangle_state=placeholder(new(batch, H, A), 3),
                dk_state=placeholder(new(batch, H, N), 3), dv_state=placeholder(new(batch, H, P), 3),
                gdt=new(batch, seqlen, H, A), c0=new(batch, H),
                seq_idx=seq_idx if seq_idx is not None else torch.zeros(1, 1, dtype=torch.int32))
    if not has_init:
        ref = {k: v for k, v in ref.items() if k not in ("dangle_state", "dk_state", "dv_state")}
    return args, ref


def preprocess_bwd_results(static: dict, dtypes: dict, batch: int, seqlen: int, seed: int = 0,
                           seq_idx=None) -> dict:
    """The preprocess backward kernel run on ``preprocess_bwd_case``'s arguments (on the CPU, or in the CUDA
    harness inside ``tvm_mamba.simulate_cuda``): {output name: (kernel result, float64 reference)}, the bias
    parts summed over batch."""
    from ...compute.mamba3.dims import PreDims
    from ...torch_ops._dlpack import kernel_for

    args, ref = preprocess_bwd_case(static, dtypes, batch, seqlen, seed, seq_idx)
    dims = PreDims(**static, **{f"{k}_dtype": v for k, v in dtypes.items()})
    kernel_for(OP, "siso_preprocess_bwd", next(iter(args.values())).device, dims, batch=batch, seqlen=seqlen)(*args.values())
    got = {k: args[k] for k in ref}
    for k in ("dQb_part", "dKb_part"):
        got[k] = got[k].sum((0, 1))
    return {k: (got[k], ref[k]) for k in ref}


def _compare_all(res: dict, what: str, arch: str) -> None:
    for name, (got, want) in res.items():
        rtol, atol = tolerance(got.dtype)
        compare(f"{what} {arch}: {name}", got, want, rtol, atol * max(1.0, want.abs().max().item()))


def packed_seq_idx(chunk_size: int) -> torch.Tensor:
    """seq_idx (1, chunk_size + 3) int32 of three packed sequences, lengths 3, chunk_size - 3, 3: one boundary
    inside chunk 0, one on chunk 1's edge."""
    lens = torch.tensor([3, chunk_size - 3, 3])
    return torch.repeat_interleave(torch.arange(3, dtype=torch.int32), lens)[None]


def _check_packed(direction: str, static: dict, dtypes: dict, arch: str) -> None:
    """A has_seq_idx preprocess configuration: the kernel alone in the harness (batch 1, three packed
    sequences) against the float64 reference (forward) or its autograd (backward)."""

    Q = static["chunk_size"]
    run = preprocess_results if direction == "siso_preprocess" else preprocess_bwd_results
    with recording() as keys:
        with target(arch):
            res = run(static, dtypes, 1, Q + 3, seq_idx=packed_seq_idx(Q))
    ran(keys, OP, direction, static, dtypes)
    _compare_all(res, f"{OP}.{direction}", arch)


def check(direction: str, static: dict, dtypes: dict, arch: str) -> None:
    """Run one build-check configuration of Mamba-3 in the harness (module docstring)."""

    if direction in ("siso_preprocess", "siso_preprocess_bwd") and static.get("has_seq_idx"):
        _check_packed(direction, static, dtypes, arch)
        return
    if direction == "siso_preprocess":
        res, keys = combined_results(static, dtypes, arch)
        ran(keys, OP, direction, static, dtypes)
        ran(keys, "ssd", "chunk_scan", *scan_of(static, dtypes, True))
        _compare_all(res, f"{OP}.{direction}", arch)
        return
    if direction == "siso_preprocess_bwd":
        with recording() as keys:
            with target(arch):
                Lq = static["chunk_size"]
                res = preprocess_bwd_results(static, dtypes, size("batch", 2), size("seqlen", extent(Lq + 3, Lq)))
        ran(keys, OP, direction, static, dtypes)
        _compare_all(res, f"{OP}.{direction}", arch)
        return
    if direction in ("step_rotate", "step_update"):  # upstream's two-function decode path
        from .mamba3_step_parts import check as check_parts

        check_parts(direction, static, dtypes, arch)
        return
    if direction not in ("siso_step", "mimo_step"):
        raise CheckFailed(f"{OP}: unknown direction {direction!r} (CUDA runs siso_step, mimo_step, step_rotate, "
                          "step_update, siso_preprocess, siso_preprocess_bwd)")
    res, keys = step_results(static, dtypes, arch, batch=size("batch", 2))
    ran(keys, OP, direction, static, dtypes)
    _compare_all(res, f"{OP}.{direction}", arch)
