"""mamba_ssm.utils.hf on tvm_mamba, for local checkpoint directories only (no hub downloads)."""
from ....modules import checkpoint


def load_config_hf(model_name):
    """model_name: a local directory -> its config.json as a dict."""
    return checkpoint.read_config(checkpoint.checkpoint_dir(model_name))


def load_state_dict_hf(model_name, device=None, dtype=None):
    """model_name: a local directory -> its state_dict (pytorch_model.bin or model.safetensors), cast to dtype."""
    state = checkpoint.read_state_dict(checkpoint.checkpoint_dir(model_name))
    return {k: v.to(device=device, dtype=dtype if dtype is not None and v.is_floating_point() else v.dtype)
            for k, v in state.items()}


__all__ = ["load_config_hf", "load_state_dict_hf"]
