"""sim-check for causal_conv1d: the build-check configurations (fwd, bwd with seq_idx padding, update
with state indices / circular buffer, varlen_states) run through the CUDA execution harness via the public
functions, against the float64 reference.

Model dims are the configuration's (dim 1536); batch 2 and seqlen 19 keep one check around a second or
two in the harness (one fiber per output element: 2*1536*19 = 58k threads). seqlen 19 is not a multiple
of 32 (a warp covers 32 time steps), so the last warp of each channel is partly masked.
"""
from __future__ import annotations

import torch

from . import CheckFailed, compare, extent, generator, production_knob, ran, recording, size, target, tolerance

OP = "causal_conv1d"
BATCH, SEQLEN = 2, 19
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _activation(static: dict):
    return "silu" if static["activation"] == "silu" else None


def _seq_idx(batch: int, seqlen: int, gen: torch.Generator) -> torch.Tensor:
    """(batch, seqlen) int32, non-decreasing ids with a cut about every 4 positions (short segments, so
    taps hit a change of id often), and padding (-1): the first 2 positions of row 0, 3 positions in the
    middle of the last row and the last 3 of every row."""
    cuts = torch.randint(0, 4, (batch, seqlen), generator=gen) == 0
    seq_idx = torch.cumsum(cuts.to(torch.int32), dim=1).to(torch.int32)
    seq_idx[0, :2] = -1
    seq_idx[-1, seqlen // 2:seqlen // 2 + 3] = -1
    seq_idx[:, -3:] = -1
    return seq_idx


def _seqlen(direction: str, static: dict, dtypes: dict, arch: str) -> int:
    """SEQLEN; under sim-check --full two of the production plan's time tiles (``tile``) and a ragged tail."""
    return extent(SEQLEN, lambda: production_knob(OP, direction, static, dtypes, arch, "tile"))


def _inputs(static: dict, dtypes: dict, gen: torch.Generator, seqlen: int = SEQLEN) -> dict:
    """Tensors for one configuration, already rounded to their kernel dtypes (the reference sees the same
    values in float64)."""
    xdt, wdt = DTYPES[dtypes["x"]], DTYPES[dtypes["weight"]]
    dim, width = static["dim"], static["width"]
    batch, seqlen = size("batch", BATCH), size("seqlen", seqlen)
    t = {"x": torch.randn(batch, dim, seqlen, generator=gen).to(xdt),
         "weight": (torch.randn(dim, width, generator=gen) / width ** 0.5).to(wdt)}
    if static["has_bias"]:
        t["bias"] = torch.randn(dim, generator=gen).to(wdt)
    if static.get("has_seq_idx"):
        t["seq_idx"] = _seq_idx(batch, seqlen, gen)
    if static.get("has_init"):
        t["initial_states"] = torch.randn(batch, dim, width - 1, generator=gen).to(xdt)
    return t


def _call(fn, t: dict, static: dict, return_final: bool):
    """fn(x, weight, bias, seq_idx, initial_states, return_final_states, activation) -> tuple of outputs."""
    outs = fn(t["x"], t["weight"], t.get("bias"), seq_idx=t.get("seq_idx"),
              initial_states=t.get("initial_states"), return_final_states=return_final,
              activation=_activation(static))
    return outs if isinstance(outs, tuple) else (outs,)


def _reference(t64: dict, static: dict, return_final: bool):
    """The float64 reference's outputs. With seq_idx and initial_states together (an extension over
    upstream, see causal_conv1d_fn) the initial states continue the row's first sequence: they are
    prepended to x as positions carrying the id of position 0, and the reference runs without them (its
    own initial_states path masks every tap before t=0 when seq_idx is given)."""
    from ...reference.causal_conv1d import causal_conv1d_ref

    init, seq_idx = t64.get("initial_states"), t64.get("seq_idx")
    if init is None or seq_idx is None:
        return _call(causal_conv1d_ref, t64, static, return_final)
    lead = init.shape[-1]
    padded = dict(t64, x=torch.cat([init, t64["x"]], dim=-1), initial_states=None,
                  seq_idx=torch.cat([seq_idx[:, :1].expand(-1, lead), seq_idx], dim=-1).contiguous())
    outs = _call(causal_conv1d_ref, padded, static, return_final)
    return (outs[0][..., lead:],) + outs[1:]


def _check_fwd(static: dict, dtypes: dict, arch: str, gen: torch.Generator) -> None:
    import tvm_mamba

    t = _inputs(static, dtypes, gen, _seqlen("fwd", static, dtypes, arch))
    with recording() as keys, target(arch):
        outs = _call(tvm_mamba.causal_conv1d_fn, t, static, static["return_final"])
    ran(keys, OP, "fwd", static, dtypes)
    t64 = {k: (v.double() if v.is_floating_point() else v) for k, v in t.items()}
    refs = _reference(t64, static, static["return_final"])
    for name, got, ref in zip(("out", "final_states"), outs, refs):
        compare(name, got, ref, *tolerance(got.dtype))


def _check_bwd(static: dict, dtypes: dict, arch: str, gen: torch.Generator) -> None:
    """Forward (returning final states when the config takes dfinal) then autograd backward with random
    cotangents in x's dtype; every input gradient against the float64 reference's autograd."""
    import tvm_mamba
    from ...reference.causal_conv1d import causal_conv1d_ref

    t = _inputs(static, dtypes, gen, _seqlen("bwd", static, dtypes, arch))
    grad_names = [n for n in ("x", "weight", "bias", "initial_states") if n in t]
    leaves = {k: (v.clone().requires_grad_() if k in grad_names else v) for k, v in t.items()}
    refs = {k: (v.double().requires_grad_() if k in grad_names else v) for k, v in t.items()}
    with recording() as keys, target(arch):
        outs = _call(tvm_mamba.causal_conv1d_fn, leaves, static, static["has_dfinal"])
        cots = [torch.randn(o.shape, generator=gen).to(o.dtype) for o in outs]
        torch.autograd.backward(outs, cots)
    ran(keys, OP, "bwd", static, dtypes)
    routs = _reference(refs, static, static["has_dfinal"])
    torch.autograd.backward(routs, [c.double() for c in cots])
    for name in grad_names:
        got, ref = leaves[name].grad, refs[name].grad
        if got is None:
            raise CheckFailed(f"d{name}: no gradient")
        rtol, atol = tolerance(got.dtype)
        if name in ("weight", "bias"):  # sums over batch*seqlen: the error grows with the magnitude
            atol *= max(1.0, ref.abs().max().item())
        compare(f"d{name}", got, ref, rtol, atol)


def _check_update(static: dict, dtypes: dict, arch: str, gen: torch.Generator) -> None:
    """A single-token step ((batch, dim) x) under ``x_2d``, else a 1-token and a 3-token step ((batch, dim,
    seqlen) x); out and the in-place conv_state (``in_place``: vLLM's call, out written over x). With
    has_indices the state is a pool of BATCH + 3 slots and one row is padding (index -1); with
    has_cache_seqlens it is a circular buffer (one row's position wraps past state_len)."""
    import tvm_mamba
    from ...reference.causal_conv1d import causal_conv1d_update_ref
    from ...torch_ops.causal_conv1d import causal_conv1d_update_into_x

    xdt, wdt, sdt = DTYPES[dtypes["x"]], DTYPES[dtypes["weight"]], DTYPES[dtypes["state"]]
    dim, width, state_len = static["dim"], static["width"], static["state_len"]
    weight = (torch.randn(dim, width, generator=gen) / width ** 0.5).to(wdt)
    bias = torch.randn(dim, generator=gen).to(wdt) if static["has_bias"] else None
    indexed, circular = static.get("has_indices", False), static.get("has_cache_seqlens", False)
    batch = size("batch", BATCH)
    state = torch.randn(batch + 3 if indexed else batch, dim, state_len, generator=gen).to(sdt)
    idx = torch.tensor([batch + 2] + [-1] * (batch - 1), dtype=torch.int32) if indexed else None
    cs = torch.tensor([state_len - 1] + [5 * state_len] * (batch - 1), dtype=torch.int32) if circular else None
    for shape in ((batch, dim),) if static.get("x_2d") else ((batch, dim, 1), (batch, dim, 3)):
        x = torch.randn(shape, generator=gen).to(xdt)
        before = state.clone()
        with recording() as keys, target(arch):
            if static.get("in_place"):
                out = causal_conv1d_update_into_x(x.clone(), state, weight, bias, _activation(static), idx)
            else:
                out = tvm_mamba.causal_conv1d_update(x, state, weight, bias, activation=_activation(static),
                                                     cache_seqlens=cs, conv_state_indices=idx)
        ran(keys, OP, "update", static, dtypes)
        ref, ref_state = causal_conv1d_update_ref(x.double(), before.double(), weight.double(),
                                                  bias.double() if bias is not None else None,
                                                  _activation(static), cs, idx)
        compare(f"out{list(shape)}", out, ref, *tolerance(out.dtype))
        compare(f"conv_state{list(shape)}", state, ref_state, *tolerance(state.dtype))


def _check_varlen_states(static: dict, dtypes: dict, arch: str, gen: torch.Generator) -> None:
    """Packed sequences longer, shorter than state_len and empty: the gathered states, exactly."""
    import tvm_mamba
    from ...reference.causal_conv1d import causal_conv1d_varlen_states_ref

    lens = torch.tensor([0, 7, 1, static["state_len"], 2], dtype=torch.int32)
    x = torch.randn(int(lens.sum()), static["dim"], generator=gen).to(DTYPES[dtypes["x"]])
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0).to(torch.int32)])
    with recording() as keys, target(arch):
        states = tvm_mamba.causal_conv1d_varlen_states(x, cu, static["state_len"])
    ran(keys, OP, "varlen_states", static, dtypes)
    compare("states", states, causal_conv1d_varlen_states_ref(x, cu, static["state_len"]), 0.0, 0.0)


CHECKS = {"fwd": _check_fwd, "bwd": _check_bwd, "update": _check_update, "varlen_states": _check_varlen_states}


def check(direction: str, static: dict, dtypes: dict, arch: str) -> None:
    """Run one build-check configuration of causal_conv1d through the harness (see the package docstring)."""
    if direction not in CHECKS:
        raise CheckFailed(f"causal_conv1d: unknown direction {direction!r} (expected one of {sorted(CHECKS)})")
    CHECKS[direction](dict(static), dict(dtypes), arch, generator(0))
