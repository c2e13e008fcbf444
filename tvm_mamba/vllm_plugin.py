"""vLLM plugin: vLLM's Mamba-1 and Mamba-2 layers run on tvm_mamba's kernels.

Installed with ``pip install "tvm-mamba[vllm]"`` and registered under the entry point group
``vllm.general_plugins`` (name ``tvm_mamba``), which vLLM loads in every process it starts. Set
``TVM_MAMBA_VLLM=0`` to leave vLLM's own kernels in place (``VLLM_PLUGINS`` selects plugins by name too).

What it changes:

- ``MambaMixer2`` (``vllm.model_executor.layers.mamba.mamba_mixer2``) and ``MambaMixer`` (``mamba_mixer``)
  call tvm_mamba's vLLM call forms (``torch_ops.serving`` / ``torch_ops.serving_prefill``) for the prefill
  conv and scan and for the decode steps: the layers look these names up in their modules' globals at
  call time, so the plugin rebinds those names and vLLM's own layer code (metadata, splits, projections)
  runs unchanged. vLLM's op modules are not touched, so other models keep vLLM's kernels.
- ``Mixer2RMSNormGated`` (a CustomOp) is replaced out of tree (``CustomOp.register_oot``) by a subclass
  whose gated RMSNorm is tvm_mamba's kernel where no tensor-parallel reduction is needed.
- ``MambaMixer`` is replaced out of tree (``PluggableLayer.register_oot``) by a subclass whose output
  projection receives a row-major input: vLLM's Mamba-1 layer hands it a transposed (column-major) view,
  which vLLM's CPU GEMM (oneDNN) rejects, so Mamba-1 did not run on vLLM's CPU build at all.

Written for vLLM 0.32; with another version the plugin logs a warning and leaves vLLM's kernels in place.
Prefix caching's per-block pointers (``mamba_cache_mode='all'``) are refused with a ValueError naming the
argument; the default ``'align'`` mode runs. docs/vllm.md.
"""
from __future__ import annotations

import importlib
import logging
import os

ENV = "TVM_MAMBA_VLLM"
_MIXER2 = "vllm.model_executor.layers.mamba.mamba_mixer2"
_MIXER1 = "vllm.model_executor.layers.mamba.mamba_mixer"
SUPPORTED = "0.32."  # the vLLM release whose Mamba layers' call forms this plugin mirrors
_state = {"registered": False}
_log = logging.getLogger(__name__)


def enabled() -> bool:
    """False when ``TVM_MAMBA_VLLM`` is 0 / false / off / no."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def bindings() -> dict[str, dict[str, object]]:
    """module name -> {global name: tvm_mamba function} the plugin installs."""
    from .torch_ops import serving, serving_prefill

    decode = {"causal_conv1d_update": serving.causal_conv1d_update,
              "selective_state_update": serving.selective_state_update_dispatch,
              "causal_conv1d_fn": serving_prefill.causal_conv1d_fn}
    return {_MIXER2: dict(decode, mamba_chunk_scan_combined_varlen=serving_prefill.mamba_chunk_scan_combined_varlen,
                          store_prefill_checkpoint=serving_prefill.store_prefill_checkpoint),
            _MIXER1: dict(decode, selective_scan_fn=serving_prefill.selective_scan_fn)}


def register() -> None:
    """The entry point vLLM calls (in each of its processes; a second call does nothing)."""
    if not enabled() or _state["registered"]:
        return
    import vllm

    if not vllm.__version__.startswith(SUPPORTED):
        _log.warning("tvm_mamba's vLLM plugin is written for vLLM %sx, this is %s: vLLM's own Mamba kernels stay "
                     "in place", SUPPORTED, vllm.__version__)
        return
    for module_name, names in bindings().items():
        module = importlib.import_module(module_name)
        for name, fn in names.items():
            if not hasattr(module, name):
                raise RuntimeError(f"tvm_mamba's vLLM plugin: {module_name} has no {name} (a vLLM version this "
                                   "plugin does not know; set TVM_MAMBA_VLLM=0)")
            setattr(module, name, fn)
    _register_layers()
    _state["registered"] = True


def _register_layers() -> None:
    from vllm.model_executor.custom_op import CustomOp, PluggableLayer

    mixer2 = importlib.import_module(_MIXER2)
    mixer1 = importlib.import_module(_MIXER1)

    @CustomOp.register_oot(name="Mixer2RMSNormGated")
    class TvmMambaRMSNormGated(mixer2.Mixer2RMSNormGated):
        """vLLM's gated RMSNorm (x * silu(gate), normalized per group, times weight) on tvm_mamba's kernel."""

        def forward_native(self, x, gate):
            if not self.use_rms_norm or (self.tp_size > 1 and self.n_groups % self.tp_size != 0) or \
                    (self.tp_size > 1 and self.n_groups == 1):
                return super().forward_native(x, gate)  # a reduction across ranks: vLLM's own path
            from .torch_ops.rmsnorm_gated import rmsnorm_fn

            group = self.group_size if self.n_groups > 1 else x.shape[-1]
            return rmsnorm_fn(x, self.weight, None, z=gate, eps=self.variance_epsilon, group_size=group,
                              norm_before_gate=False)

        def forward_cpu(self, x, gate):
            return self.forward_native(x, gate)

        def forward_cuda(self, x, gate):
            return self.forward_native(x, gate)

    @PluggableLayer.register_oot(name="MambaMixer")
    class TvmMambaMixer(mixer1.MambaMixer):
        """vLLM's Mamba-1 layer; its output projection gets a row-major input (see the module docstring)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.out_proj.forward = _row_major_input(self.out_proj.forward)


def _row_major_input(forward):
    def call(x, *args, **kwargs):
        return forward(x.contiguous(), *args, **kwargs)

    return call
