"""The Mamba-3 kernels' table: direction -> typed dims, template, builder (``KERNELS``), and the
build-check / tuning configurations; the package's docstring describes the op."""
from __future__ import annotations

import functools

from tvm import tirx

from .._common import stamp
from .._math import Math
from ..selective_scan._layout import Layout
from ..ssd.strategy import SERIAL
from .dims import IO_DTYPES, MimoStepDims, PreDims, StepDims, acc_dtype, mimo_chunk_steps
from .preprocess import preprocess_template
from .preprocess_bwd import preprocess_bwd_template
from .step import step_template

__all__ = ["DIMS", "KERNELS", "TEMPLATES", "IO_DTYPES", "MimoStepDims", "PreDims", "StepDims", "acc_dtype", "build",
           "build_check_configs", "tuning_configs", "derived_dims", "mamba3_siso_step", "mamba3_mimo_step",
           "mamba3_step_rotate", "mamba3_step_update",
           "mamba3_siso_preprocess",
           "mamba3_siso_preprocess_bwd", "PREPROCESS"]

# direction -> typed static dims / template(dims, layout): the step takes a selective-scan Layout, the
# preprocess an SSD ChunkStrategy (the rules pick each direction's)
# step_rotate / step_update: the step's two passes as kernels of their own (upstream's
# apply_rotary_qk_inference_fwd and mamba3_step_fn), the same template
DIMS = {"siso_step": StepDims, "mimo_step": MimoStepDims, "step_rotate": MimoStepDims, "step_update": MimoStepDims,
        "siso_preprocess": PreDims, "siso_preprocess_bwd": PreDims}
TEMPLATES = {"siso_step": step_template, "mimo_step": step_template,
             "step_rotate": functools.partial(step_template, passes="rotate"),
             "step_update": functools.partial(step_template, passes="update"),
             "siso_preprocess": preprocess_template, "siso_preprocess_bwd": preprocess_bwd_template}
PREPROCESS = ("siso_preprocess", "siso_preprocess_bwd")  # the directions laid out by the SSD strategies


def build(direction: str, dims, layout: Layout) -> tirx.PrimFunc:
    """``direction``'s template laid out by ``layout``, named after its kernel."""
    return stamp(TEMPLATES[direction](dims, layout), f"mamba3_{direction}")


def mamba3_siso_step(dims: StepDims | None = None, /, **kwargs) -> tirx.PrimFunc:
    """Decode step. Q, K: (batch, nheads_qk, headdim_qk); V, Z: (batch, nheads, headdim_v); ADT, DT, Trap:
    (batch, nheads); Q_bias, K_bias: (nheads, headdim_qk); Angles, angle_state: (batch, nheads, headdim_angles);
    D: (nheads,); ssm_state: (batch, nheads, headdim_v, headdim_qk); k_state: (batch, nheads, headdim_qk);
    v_state: (batch, nheads, headdim_v) -> out: (batch, nheads, headdim_v), new angle, ssm and k states
    (acc dtype). Formula in the package docstring; ``dims``: a StepDims, or its fields as keywords."""
    if dims is not None and kwargs:
        raise TypeError(f"mamba3_siso_step: pass dims or keyword dims, not both ({sorted(kwargs)})")
    d = dims if dims is not None else StepDims(**kwargs)
    return build("siso_step", d, Layout(Math(d.acc)))


def mamba3_mimo_step(dims: MimoStepDims | None = None, /, **kwargs) -> tirx.PrimFunc:
    """MIMO decode step (the SISO step's template at rank R, halved rotary pairs). Q, K: (batch, R, nheads_qk,
    headdim_qk); V, Z: (batch, nheads, headdim_v); ADT, DT, Trap: (batch, nheads); Q_bias, K_bias: (nheads, R,
    headdim_qk); MIMO_V, MIMO_Z, MIMO_Out: (nheads, R, headdim_v) (MIMO_Z without has_z and MIMO_Out without
    has_outproj: (1, 1, 1)); Angles, angle_state: (batch, nheads, headdim_angles); D: (nheads,); ssm_state:
    (batch, nheads, headdim_v, headdim_qk); k_state: (batch, R, nheads, headdim_qk); v_state: (batch, nheads,
    headdim_v) -> out: (batch, nheads, headdim_v) (without has_outproj (batch, R, nheads, headdim_v)), new
    angle, ssm and k states (acc dtype); qrot: a k-state-shaped workspace. Formula in
    reference/mamba3_mimo.py; ``dims``: a MimoStepDims, or its fields as keywords."""
    if dims is not None and kwargs:
        raise TypeError(f"mamba3_mimo_step: pass dims or keyword dims, not both ({sorted(kwargs)})")
    d = dims if dims is not None else MimoStepDims(**kwargs)
    return build("mimo_step", d, Layout(Math(d.acc)))


def mamba3_step_rotate(dims: MimoStepDims) -> tirx.PrimFunc:
    """The step's pass 1 alone (upstream's ``apply_rotary_qk_inference_fwd``). Q, K: (batch, R, nheads_qk,
    headdim_qk); DT: (batch, nheads); Q_bias, K_bias: (R, nheads, headdim_qk) with ``rank_major`` (else (nheads,
    R, headdim_qk); (1, 1, 1) when absent); Angles, angle_state: (batch, nheads, headdim_angles) -> angle out
    (batch, nheads, headdim_angles) acc; k, q out (batch, R, nheads, headdim_qk) in Q's dtype (parameter order:
    ..., angle out, k out, q out). theta' = theta + pi tanh(Angles) DT (mod 2 pi with ``angle_mod``); q, k =
    R(+-theta') (Q + Q_bias), R(+-theta') (K + K_bias), pairs (2i, 2i+1) with ``pairwise``, else halved."""
    return build("step_rotate", dims, Layout(Math(dims.acc)))


def mamba3_step_update(dims: MimoStepDims) -> tirx.PrimFunc:
    """The step's pass 2 alone (upstream's ``mamba3_step_fn``). V (x), Z: (batch, nheads, headdim_v); ADT (A
    with ``raw_a``), DT, Trap (a probability without ``trap_logit``): (batch, nheads); MIMO_V, MIMO_Z, MIMO_Out:
    (R, nheads, headdim_v) with ``rank_major``; D: (nheads,); ssm state (batch, nheads, headdim_v, headdim_qk)
    in ``state`` dtype; k_state (batch, R, nheads, headdim_qk); v_state (batch, nheads, headdim_v) -> out
    (batch, nheads, headdim_v) (or (batch, R, nheads, headdim_v)), the new ssm state (into the input state with
    ``inplace``); then B (k), C (q): (batch, R, nheads, headdim_qk) in Q's dtype, already rotated."""
    return build("step_update", dims, Layout(Math(dims.acc)))


def mamba3_siso_preprocess(dims: PreDims | None = None, /, **kwargs) -> tirx.PrimFunc:
    """The chunked forward's preprocess. Q, K: (batch, seqlen, nheads_qk, headdim_qk); ADT, DT, Trap:
    (batch, nheads, seqlen) f32; Q_bias, K_bias: (nheads, headdim_qk) f32; Angles: (batch, seqlen, nheads,
    headdim_angles) f32; D: (nheads,) f32; angle_state (batch, nheads, headdim_angles) f32, ssm_state (batch,
    nheads, headdim_v, headdim_qk) f32, k_state (batch, nheads, headdim_qk), v_state (batch, nheads, headdim_v)
    -> q, k: (batch, seqlen, nheads, headdim_qk) f32 (rotated, biased); dA_cs, scale, skip: (batch, nheads,
    nchunks, chunk_size) f32; angle_out: (batch, nheads, headdim_angles) f32; init: (batch, nheads, headdim_v,
    headdim_qk) f32 (with has_init); last seq_idx (batch, seqlen) int32 (with has_seq_idx: packed sequences,
    angle_out then (nseq, nheads, headdim_angles), a row per sequence; else a (1, 1) placeholder). Formulas in
    preprocess.py; ``dims``: a PreDims, or its fields as keywords."""
    if dims is not None and kwargs:
        raise TypeError(f"mamba3_siso_preprocess: pass dims or keyword dims, not both ({sorted(kwargs)})")
    d = dims if dims is not None else PreDims(**kwargs)
    return build("siso_preprocess", d, SERIAL)


def mamba3_siso_preprocess_bwd(dims: PreDims | None = None, /, **kwargs) -> tirx.PrimFunc:
    """The preprocess's backward (preprocess_bwd.py has the math). Inputs as the forward's, less D and the ssm
    state: Q, K (batch, seqlen, nheads_qk, headdim_qk); ADT, DT, Trap (batch, nheads, seqlen) f32; Q_bias, K_bias
    (nheads, headdim_qk) f32; Angles (batch, seqlen, nheads, headdim_angles) f32; angle_state, k_state,
    v_state; gradients of the forward's outputs dq, dk (batch, seqlen, nheads, headdim_qk), dscale, ddA_step,
    dskip (batch, nheads, nchunks, chunk_size), ddecay (batch, nheads, nchunks), daout (batch, nheads,
    headdim_angles), dinit (batch, nheads, headdim_v, headdim_qk) -> dQh, dKh (batch, seqlen, nheads,
    headdim_qk) per head; dADT, dDT, dTrap (batch, nheads, seqlen); dQb_part, dKb_part (batch, ceil(seqlen /
    PAIR_STEPS), nheads, headdim_qk): the bias gradients in parts per batch row and block of PAIR_STEPS steps;
    dAngles (batch, seqlen, nheads, headdim_angles); dangle_state, dk_state, dv_state; workspaces gdt (batch,
    seqlen, nheads, headdim_angles), c0 (batch, nheads); all float32 (states and their gradients: placeholders
    without has_init); last seq_idx (batch, seqlen) int32 (with has_seq_idx: packed sequences, daout then (nseq,
    nheads, headdim_angles); else a (1, 1) placeholder). ``dims``: a PreDims, or its fields as keywords."""
    if dims is not None and kwargs:
        raise TypeError(f"mamba3_siso_preprocess_bwd: pass dims or keyword dims, not both ({sorted(kwargs)})")
    d = dims if dims is not None else PreDims(**kwargs)
    return build("siso_preprocess_bwd", d, SERIAL)


def build_check_configs() -> list[tuple[str, dict, dict]]:
    """(direction, static dims, dtypes) built by ``python -m tvm_mamba build-check`` for CUDA: upstream's
    tuned SISO shape (nheads_qk 1, 32 heads, headdim_qk 128, headdim_v 64) at rope_fraction 0.5 (32 angles)
    with bf16 activations: a bf16 K / V state (what Mamba3.allocate_inference_cache makes), the same without Z
    (``is_outproj_norm``: the gate is applied by the output norm), and fed back the step's own float32 K state;
    plus fp32 at rope_fraction 1.0 with GQA over 2 Q/K heads. The chunked forward's preprocess at the same
    shape, chunk 64: bf16 with D and input states (a float32 K state, what the forward itself returns), and
    fp32 without (GQA, full rotary); its SSD pieces are compute/ssd's (the chunk scan with ``diag_skip`` in
    that list). The preprocess's backward at the forward's two configurations. Packed sequences
    (has_seq_idx, bf16, no input states) for both directions. The MIMO step at the same shape, rank 4 (upstream's
    default): bf16 with D, Z, MIMO_Out and a bf16 K state (the module's cache), bf16 without Z or MIMO_Out
    (``is_outproj_norm``: R outputs) fed its own float32 K state; fp32 rank 2 with GQA over 2 Q/K heads at
    full rotary. Then upstream's two-function path's kernels (``_parts_configs``)."""
    base = dict(nheads=32, nheads_qk=1, headdim_qk=128, headdim_v=64, headdim_angles=32, has_D=True, has_z=True)
    bf16 = {"qk": "bfloat16", "v": "bfloat16"}
    pre = dict(nheads=32, nheads_qk=1, headdim_qk=128, headdim_v=64, headdim_angles=32, chunk_size=64)
    return [("siso_step", base, dict(bf16, kstate="bfloat16")),
            ("siso_step", dict(base, has_z=False), dict(bf16, kstate="bfloat16")),
            ("siso_step", base, bf16),
            ("siso_step", dict(base, nheads_qk=2, headdim_angles=64), {"qk": "float32", "v": "float32"}),
            ("siso_preprocess", dict(pre, has_D=True, has_init=True), {"qk": "bfloat16", "vstate": "bfloat16"}),
            ("siso_preprocess", dict(pre, nheads_qk=2, headdim_angles=64, has_D=False, has_init=False),
             {"qk": "float32", "vstate": "float32"}),
            ("siso_preprocess_bwd", dict(pre, has_D=True, has_init=True), {"qk": "bfloat16", "vstate": "bfloat16"}),
            ("siso_preprocess_bwd", dict(pre, nheads_qk=2, headdim_angles=64, has_D=False, has_init=False),
             {"qk": "float32", "vstate": "float32"}),
            ("siso_preprocess", dict(pre, has_D=True, has_init=False, has_seq_idx=True),
             {"qk": "bfloat16", "vstate": "bfloat16"}),
            ("siso_preprocess_bwd", dict(pre, has_D=False, has_init=False, has_seq_idx=True),
             {"qk": "bfloat16", "vstate": "bfloat16"}),
            ("mimo_step", dict(base, mimo_rank=4, has_outproj=True), dict(bf16, kstate="bfloat16")),
            ("mimo_step", dict(base, has_z=False, mimo_rank=4, has_outproj=False), bf16),
            ("mimo_step", dict(base, nheads_qk=2, headdim_angles=64, mimo_rank=2, has_outproj=True),
             {"qk": "float32", "v": "float32"}),
            *_parts_configs()]


def _parts_configs() -> list[tuple[str, dict, dict]]:
    """Upstream's two-function path (``Mamba3.step``) at the same shape, as its bf16 module calls it: the rotary
    pass (B / C broadcast from one group: nheads_qk 1) SISO (rank 1, interleaved pairs) and MIMO (rank 4, halved,
    conjugate); the update SISO (rank 1, D, Z, ones projections, a bf16 K state, the float32 state in place) and
    MIMO rank 4 (the same), and fp32 rank 4 without Z or MIMO_Out (``is_outproj_norm``) into a separate state."""
    rot = dict(nheads=32, nheads_qk=1, headdim_qk=128, headdim_v=1, headdim_angles=32, has_D=False, has_z=False,
               has_outproj=False, angle_mod=False, rank_major=True)
    upd = dict(nheads=32, nheads_qk=1, headdim_qk=128, headdim_v=64, headdim_angles=1, has_D=True, has_z=True,
               has_outproj=True, trap_logit=False, raw_a=True, rank_major=True)  # (flags at defaults: not keyed)
    bf16 = {"qk": "bfloat16", "v": "bfloat16", "kstate": "bfloat16"}
    return [("step_rotate", dict(rot, mimo_rank=1, pairwise=True), {"qk": "bfloat16", "v": "float32"}),
            ("step_rotate", dict(rot, mimo_rank=4, conjugate=True), {"qk": "bfloat16", "v": "float32"}),
            ("step_update", dict(upd, mimo_rank=1, inplace=True), bf16),
            ("step_update", dict(upd, mimo_rank=4, inplace=True), bf16),
            ("step_update", dict(upd, mimo_rank=4, has_z=False, has_outproj=False), {"qk": "float32", "v": "float32"})]


def tuning_configs(preset: str = "default") -> list[tuple[str, dict, dict]]:
    """Tuning (and roofline) workloads: each Mamba-3 preset's three Mamba-3 kernels as ``Mamba3`` (SISO, fp32)
    calls them: the decode step (D, Z; the cache's float32 K / V states), the chunked forward's preprocess
    (D, no input states: a plain forward or a prefill) and its backward (training: keyed without D, which it
    does not read, as the torch op keys it). The SSD pieces of the forward and backward are SSD kernels
    (compute/ssd), not listed here. A MIMO preset (one with a ``mimo_rank`` R) has its decode step (D, Z,
    MIMO_Out) instead of the SISO one, and the preprocesses at mamba3_mimo's R nheads rank-major virtual heads
    over R nheads_qk Q/K heads, chunks of ``mimo_chunk_steps`` steps, no D (torch_ops/mamba3_mimo.py; its SSD
    pieces, with step_group R, are SSD kernels)."""
    from .._presets import presets

    out = []
    for _, d in presets(preset, families=("mamba3",)):
        model = dict(nheads=d["nheads"], nheads_qk=d["ngroups"], headdim_qk=d["d_state"], headdim_v=d["headdim"],
                     headdim_angles=d["num_rope_angles"])
        R = d.get("mimo_rank")
        if R:
            mimo = MimoStepDims(**model, has_D=True, has_z=True, mimo_rank=R, has_outproj=True)
            out.append(("mimo_step", *mimo.key_parts()))
            model = dict(model, nheads=d["nheads"] * R, nheads_qk=d["ngroups"] * R)  # rank-major virtual heads
        else:
            out.append(("siso_step", *StepDims(**model, has_D=True, has_z=True).key_parts()))
        chunk = mimo_chunk_steps(d["chunk_size"], R) if R else d["chunk_size"]
        pre = PreDims(**model, chunk_size=chunk, has_D=not R, has_init=False)
        bwd = PreDims(**model, chunk_size=chunk, has_D=False, has_init=False)
        out += [("siso_preprocess", *pre.key_parts()), ("siso_preprocess_bwd", *bwd.key_parts())]
    return out


def derived_dims(direction: str, dims: dict, static: dict) -> dict:
    """Dynamic dims that follow from the others (for tuning and roofline inputs): the preprocess's
    nchunks = ceil(seqlen / chunk_size) (forward and backward), as torch_ops/mamba3.py allocates its per-chunk
    tensors."""
    if direction not in PREPROCESS or "seqlen" not in dims:
        return {}
    return {"nchunks": -(-dims["seqlen"] // static["chunk_size"])}


# direction -> builder(dims) -> PrimFunc: this op's kernels (runtime/registry.py reads this table)
KERNELS = {"siso_step": mamba3_siso_step, "mimo_step": mamba3_mimo_step, "step_rotate": mamba3_step_rotate,
           "step_update": mamba3_step_update, "siso_preprocess": mamba3_siso_preprocess,
           "siso_preprocess_bwd": mamba3_siso_preprocess_bwd}
