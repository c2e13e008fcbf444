"""Workload lists of the selective scan: what ``build-check`` compiles for CUDA and what tuning measures."""
from __future__ import annotations

from .dims import block_size, chunk_size


def build_check_configs() -> list[tuple[str, dict, dict]]:
    """(direction, static dims, dtypes) built by ``python -m tvm_mamba build-check`` for CUDA: Mamba-130M's
    d_inner 1536 at dstate 16, 64, 128, 256; B/C time-varying (batch, dstate, L) as in Mamba-1, with D, z,
    delta_bias, softplus; fp32 and bf16; the complex-A scan; plus the decode step (Mamba-1's own layout, and
    the Mamba-2 head layout's serving and tied forms)."""
    out = []
    for dstate in (16, 64, 128, 256):
        for u_dtype in ("float32", "bfloat16"):
            dt = {"u": u_dtype, "B": u_dtype, "C": u_dtype}
            base = dict(dim=1536, dstate=dstate, b_groups=1, c_groups=1, has_D=True, has_z=True,
                        has_delta_bias=True, delta_softplus=True, has_init=False,
                        chunk=chunk_size(dstate))
            out.append(("fwd", base, dt))
            out.append(("bwd", dict(base, block=16), dt))
        out.append(("update", dict(nheads=1536, headdim=1, dstate=dstate, ngroups=1, has_D=True, has_z=True,
                                    has_dt_bias=True, dt_softplus=True, mamba1_layout=True),
                    {"x": "float32", "B": "float32", "C": "float32"}))
    # complex A (S4D-style): B varying as in Mamba-1, C time-invariant complex
    for u_dtype in ("float32", "bfloat16"):
        cplx = dict(dim=1536, dstate=16, b_groups=1, c_groups=0, has_D=True, has_z=True, has_delta_bias=True,
                    delta_softplus=True, has_init=False, chunk=chunk_size(32))
        dt = {"u": u_dtype, "B": u_dtype, "C": "float32"}
        out.append(("fwd_complex", cplx, dt))
        out.append(("bwd_complex", dict(cplx, block=block_size(1536, 1, 0)), dt))
    # serving: Mamba-2 heads, a bf16 state pool addressed by int32 state_batch_indices, bf16 activations
    out.append(("update", dict(nheads=24, headdim=64, dstate=128, ngroups=1, has_D=True, has_z=True,
                               has_dt_bias=True, dt_softplus=True),
                {"x": "bfloat16", "B": "bfloat16", "C": "bfloat16", "state": "bfloat16", "idx": "int32"}))
    # Mamba2.step's call: one A / dt / D / dt_bias per head (mamba_ssm's TIE_HDIM), fp32
    out.append(("update", dict(nheads=24, headdim=64, dstate=128, ngroups=1, has_D=True, has_z=True,
                               has_dt_bias=True, dt_softplus=True, tie_hdim=True),
                {"x": "float32", "B": "float32", "C": "float32"}))
    return out


def tuning_configs(preset: str = "default") -> list[tuple[str, dict, dict]]:
    """Tuning workloads: each Mamba-1 preset's scan (d_inner channels, d_state, B/C varying, D, z,
    delta_bias, softplus; fwd and bwd, fp32) and each Mamba-2 preset's decode step (heads layout, untied
    and tied per head: the latter is what Mamba2.step runs)."""
    from .._presets import presets

    out = []
    f32 = {"u": "float32", "B": "float32", "C": "float32"}
    for _, dims in presets(preset, families=("mamba", "mamba2")):
        if "headdim" in dims:
            step = dict(nheads=dims["nheads"], headdim=dims["headdim"], dstate=dims["d_state"],
                        ngroups=dims["ngroups"], has_D=True, has_z=True, has_dt_bias=True, dt_softplus=True)
            out.append(("update", step, {"x": "float32", "B": "float32", "C": "float32"}))
            out.append(("update", dict(step, tie_hdim=True), {"x": "float32", "B": "float32", "C": "float32"}))
            continue
        base = dict(dim=dims["d_inner"], dstate=dims["d_state"], b_groups=1, c_groups=1, has_D=True, has_z=True,
                    has_delta_bias=True, delta_softplus=True, has_init=False, chunk=chunk_size(dims["d_state"]))
        out.append(("fwd", base, f32))
        out.append(("bwd", dict(base, block=block_size(dims["d_inner"], 1, 1)), f32))
    return out
