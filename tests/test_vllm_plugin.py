"""tvm_mamba/vllm_plugin.py without vLLM (the engine tests are tests/vllm, marker vllm): the switch, and that
every name it binds is one of tvm_mamba's vLLM call forms."""
from __future__ import annotations

import pytest

from tvm_mamba import vllm_plugin


@pytest.mark.parametrize("value, on", [(None, True), ("1", True), ("0", False), ("off", False), ("False", False),
                                       ("no", False), ("yes", True)])
def test_switch(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv(vllm_plugin.ENV, raising=False)
    else:
        monkeypatch.setenv(vllm_plugin.ENV, value)
    assert vllm_plugin.enabled() is on


def test_bindings_are_the_vllm_call_forms():
    binds = vllm_plugin.bindings()
    assert set(binds) == {"vllm.model_executor.layers.mamba.mamba_mixer2",
                          "vllm.model_executor.layers.mamba.mamba_mixer"}
    for names in binds.values():
        for name, fn in names.items():
            assert fn.__module__ in ("tvm_mamba.torch_ops.serving", "tvm_mamba.torch_ops.serving_prefill")
            assert fn.__name__ == name or (name, fn.__name__) == ("selective_state_update",
                                                                   "selective_state_update_dispatch")


def test_disabled_plugin_does_not_import_vllm(monkeypatch):
    import sys

    monkeypatch.setenv(vllm_plugin.ENV, "0")
    monkeypatch.setitem(sys.modules, "vllm", None)  # importing it would raise
    vllm_plugin.register()
