"""Static model dims of the released Mamba / Mamba-2 checkpoints (mamba_ssm configs), and a Mamba-3 model of
the same size, for the tuning grid, the build check and the roofline. d_inner = expand * d_model; Mamba-2's conv
runs over conv_dim = d_inner + 2 * ngroups * d_state channels and has nheads = d_inner / headdim heads.

Each preset belongs to a family ("mamba", "mamba2", "mamba3"): an op's ``tuning_configs`` asks
``presets(name, families=...)`` for the families whose blocks run its kernels (Mamba-3 has no conv and no
Mamba-2 decode step; its chunked forward's SSD pieces run with Mamba-3's own flags)."""
from __future__ import annotations

MAMBA1 = {name: dict(d_model=d, d_inner=2 * d, d_state=16, d_conv=4, dt_rank=-(-d // 16))
          for name, d in (("mamba-130m", 768), ("mamba-370m", 1024), ("mamba-790m", 1536),
                          ("mamba-1.4b", 2048), ("mamba-2.8b", 2560))}
MAMBA2 = {name: dict(d_model=d, d_inner=2 * d, d_state=128, d_conv=4, headdim=64, ngroups=1, chunk_size=256,
                     nheads=2 * d // 64, conv_dim=2 * d + 2 * 128)
          for name, d in (("mamba2-130m", 768), ("mamba2-370m", 1024), ("mamba2-780m", 1536),
                          ("mamba2-1.3b", 2048), ("mamba2-2.7b", 2560))}
# No Mamba-3 checkpoint is released: mamba3-130m is Mamba3(d_model=768) with upstream's defaults (expand 2,
# headdim 64, d_state 128, ngroups 1, rope_fraction 0.5 -> 32 rotary angles, chunk 64), SISO; mamba3-mimo-130m
# the same with is_mimo (upstream's mimo_rank 4 and its recommended chunk 64 / 4 = 16); not in "default".
_M3 = dict(d_model=768, d_inner=1536, d_state=128, headdim=64, ngroups=1, nheads=24, num_rope_angles=32)
MAMBA3 = {"mamba3-130m": dict(_M3, chunk_size=64), "mamba3-mimo-130m": dict(_M3, chunk_size=16, mimo_rank=4)}
PRESETS = {**MAMBA1, **MAMBA2, **MAMBA3}
FAMILY = {**dict.fromkeys(MAMBA1, "mamba"), **dict.fromkeys(MAMBA2, "mamba2"), **dict.fromkeys(MAMBA3, "mamba3")}
# "default": the smallest of each family (what CI-sized tuning and the committed logs cover); "all": every one.
GROUPS = {"default": ["mamba-130m", "mamba2-130m", "mamba3-130m"], "all": list(PRESETS)}


def presets(name: str, families: tuple[str, ...] | None = None) -> list[tuple[str, dict]]:
    """[(preset name, dims)] for a preset or group name; ``families``: only presets of these families (None:
    every one)."""
    if name in GROUPS:
        chosen = [(n, PRESETS[n]) for n in GROUPS[name]]
    elif name in PRESETS:
        chosen = [(name, PRESETS[name])]
    else:
        raise ValueError(f"preset: unknown {name!r}; choose from {sorted(GROUPS) + sorted(PRESETS)}")
    return [(n, d) for n, d in chosen if families is None or FAMILY[n] in families]
