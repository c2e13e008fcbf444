"""Static model dims of the released Mamba / Mamba-2 checkpoints (mamba_ssm configs), for the tuning
grid and the build check. d_inner = expand * d_model; Mamba-2's conv runs over
conv_dim = d_inner + 2 * ngroups * d_state channels and has nheads = d_inner / headdim heads."""
from __future__ import annotations

MAMBA1 = {name: dict(d_model=d, d_inner=2 * d, d_state=16, d_conv=4, dt_rank=-(-d // 16))
          for name, d in (("mamba-130m", 768), ("mamba-370m", 1024), ("mamba-790m", 1536),
                          ("mamba-1.4b", 2048), ("mamba-2.8b", 2560))}
MAMBA2 = {name: dict(d_model=d, d_inner=2 * d, d_state=128, d_conv=4, headdim=64, ngroups=1, chunk_size=256,
                     nheads=2 * d // 64, conv_dim=2 * d + 2 * 128)
          for name, d in (("mamba2-130m", 768), ("mamba2-370m", 1024), ("mamba2-780m", 1536),
                          ("mamba2-1.3b", 2048), ("mamba2-2.7b", 2560))}
PRESETS = {**MAMBA1, **MAMBA2}
# "default": the smallest of each family (what CI-sized tuning and the committed logs cover); "all": every one.
GROUPS = {"default": ["mamba-130m", "mamba2-130m"], "all": list(PRESETS)}


def presets(name: str) -> list[tuple[str, dict]]:
    """[(preset name, dims)] for a preset or group name."""
    if name in GROUPS:
        return [(n, PRESETS[n]) for n in GROUPS[name]]
    if name in PRESETS:
        return [(name, PRESETS[name])]
    raise ValueError(f"preset: unknown {name!r}; choose from {sorted(GROUPS) + sorted(PRESETS)}")
