"""tvm_mamba.compat: upstream's module paths (mamba_ssm.*, causal_conv1d.*) resolve to tvm_mamba's functions
and modules after install(), both as a package tree (import change) and as sys.modules aliases; uninstall()
removes them; a real installation already imported is not shadowed."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import tvm_mamba
from tvm_mamba import compat

# upstream path -> names a user imports from it (each must be tvm_mamba's object)
PATHS = {
    "mamba_ssm": ["Mamba", "Mamba2", "Mamba3", "MambaLMHeadModel", "selective_scan_fn"],
    "mamba_ssm.ops.selective_scan_interface": ["selective_scan_fn", "selective_scan_ref", "mamba_inner_fn",
                                               "mamba_inner_ref"],
    "mamba_ssm.ops.triton.ssd_combined": ["mamba_chunk_scan_combined", "mamba_split_conv1d_scan_combined",
                                          "mamba_split_conv1d_scan_ref"],
    "mamba_ssm.ops.triton.selective_state_update": ["selective_state_update", "selective_state_update_ref"],
    "mamba_ssm.ops.triton.mamba3.mamba3_siso_step": ["mamba3_siso_step", "mamba3_siso_step_ref"],
    "mamba_ssm.ops.triton.mamba3.mamba3_siso_combined": ["mamba3_siso_combined", "mamba3_siso_combined_ref"],
    "mamba_ssm.ops.tilelang.mamba3.mamba3_mimo": ["mamba3_mimo"],
    "mamba_ssm.ops.triton.mamba3.mamba3_mimo_rotary_step": ["apply_rotary_qk_inference_fwd"],
    "mamba_ssm.ops.cute.mamba3.mamba3_step_fn": ["mamba3_step_fn"],
    "mamba_ssm.ops.triton.layernorm_gated": ["RMSNorm", "LayerNorm", "rmsnorm_fn", "layernorm_fn", "rms_norm_ref"],
    "mamba_ssm.ops.triton.layer_norm": ["RMSNorm", "layer_norm_fn", "rms_norm_fn", "layer_norm_ref", "rms_norm_ref"],
    "mamba_ssm.modules.mamba_simple": ["Mamba"],
    "mamba_ssm.modules.mamba2": ["Mamba2"],
    "mamba_ssm.modules.mamba3": ["Mamba3"],
    "mamba_ssm.modules.block": ["Block"],
    "mamba_ssm.modules.mlp": ["GatedMLP"],
    "mamba_ssm.models.mixer_seq_simple": ["MambaLMHeadModel", "MixerModel", "create_block"],
    "mamba_ssm.models.config_mamba": ["MambaConfig"],
    "mamba_ssm.utils.generation": ["InferenceParams", "GenerationMixin", "decode", "sample"],
    "mamba_ssm.utils.hf": ["load_config_hf", "load_state_dict_hf"],
    "causal_conv1d": ["causal_conv1d_fn", "causal_conv1d_update"],
    "causal_conv1d.causal_conv1d_interface": ["causal_conv1d_fn", "causal_conv1d_update", "causal_conv1d_ref"],
    "causal_conv1d.causal_conv1d_varlen": ["causal_conv1d_varlen_states", "causal_conv1d_varlen_states_ref"],
}
SAME_AS_TOP = {"selective_scan_fn", "mamba_chunk_scan_combined", "mamba_inner_fn", "mamba_split_conv1d_scan_combined",
               "selective_state_update", "mamba3_siso_step", "mamba3_siso_combined", "mamba3_mimo", "rmsnorm_fn", "layernorm_fn", "layer_norm_fn", "rms_norm_fn", "causal_conv1d_fn", "causal_conv1d_update",
               "causal_conv1d_varlen_states", "Mamba", "Mamba2", "Mamba3", "MambaLMHeadModel"}


@pytest.fixture
def installed():
    compat.install()
    yield
    compat.uninstall()


@pytest.mark.smoke
def test_upstream_paths_resolve_to_tvm_mamba(installed):
    import importlib

    for path, names in PATHS.items():
        module = importlib.import_module(path)
        assert module is sys.modules[path]
        assert module.__name__.startswith("tvm_mamba.compat."), path  # the package tree, aliased
        for name in names:
            obj = getattr(module, name)
            if name in SAME_AS_TOP:
                assert obj is getattr(tvm_mamba, name), f"{path}.{name}"
    import causal_conv1d
    import mamba_ssm
    import mamba_ssm.ops.triton.ssd_combined as deep

    assert mamba_ssm.ops.triton.ssd_combined is deep  # the attribute chain of the aliased parents

    assert mamba_ssm.__version__ == "2.3.2.post1" and causal_conv1d.__version__ == "1.7.0"


def test_import_change_without_install():
    from tvm_mamba.compat.causal_conv1d.causal_conv1d_interface import causal_conv1d_fn
    from tvm_mamba.compat.mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    assert causal_conv1d_fn is tvm_mamba.causal_conv1d_fn
    assert mamba_chunk_scan_combined is tvm_mamba.mamba_chunk_scan_combined
    assert "mamba_ssm" not in sys.modules


def test_uninstall_and_refusals(tmp_path):
    compat.install()
    compat.install()  # again: replaces the previous install
    compat.uninstall()
    assert not [m for m in sys.modules if m.split(".")[0] in ("mamba_ssm", "causal_conv1d")]
    with pytest.raises(ValueError, match="upstream"):
        compat.install(upstream=tmp_path)  # no mamba_ssm source tree there
    assert "mamba_ssm" not in sys.modules  # nothing half-installed
    sys.modules["mamba_ssm"] = type(sys)("mamba_ssm")  # a real installation, imported first
    try:
        with pytest.raises(RuntimeError, match="already imported"):
            compat.install()
    finally:
        del sys.modules["mamba_ssm"]


def test_unmodified_upstream_style_script_runs(tmp_path):
    """A script written for mamba_ssm (deep imports, InferenceParams, generate), after one install() line."""
    script = tmp_path / "user.py"
    script.write_text(textwrap.dedent("""
        import tvm_mamba.compat; tvm_mamba.compat.install()
        import torch
        from mamba_ssm.models.config_mamba import MambaConfig
        from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel
        from mamba_ssm.utils.generation import InferenceParams
        torch.manual_seed(0)
        cfg = MambaConfig(d_model=32, n_layer=1, vocab_size=50,
                          ssm_cfg=dict(layer="Mamba2", d_state=16, headdim=16, chunk_size=8))
        model = MambaLMHeadModel(cfg)
        ids = torch.randint(0, 50, (1, 6))
        params = InferenceParams(max_seqlen=10, max_batch_size=1)
        logits = model(ids, inference_params=params).logits
        out = model.generate(ids, max_length=10, return_dict_in_generate=True, output_scores=True)
        print(tuple(logits.shape), tuple(out.sequences.shape), len(out.scores))
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[-2] == "(1, 6, 56) (1, 10) 4"
