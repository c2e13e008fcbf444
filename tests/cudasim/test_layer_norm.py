"""layer_norm_fn / rms_norm_fn (the fused residual-add norm) with the CUDA kernels run on the CPU by the
execution harness (tvm_mamba.simulate_cuda), against the float64 reference: forward, residual_out and every
gradient, fp32 and bf16 with an fp32 residual (Block's residual_in_fp32 path), and sim-check's own check of
the build-check configurations. Mirrors tests/torch_ops/test_layer_norm.py at small model dims.

HIDDEN = 192: the row blocks get 64 threads (the largest of 32..512 dividing 192), a 2-warp reduction.
"""
from __future__ import annotations

import pytest
import torch

from tests.conftest import assert_close_to_ref
from tests.torch_ops.test_layer_norm import _inputs as _cpu_inputs, _names, _run
from tvm_mamba.compute.rmsnorm_gated import build_check_configs
from tvm_mamba.modules.layer_norm import RMSNorm
from tvm_mamba.reference.layer_norm import layer_norm_ref
from tvm_mamba.torch_ops.layer_norm import layer_norm_fn

HIDDEN = 192

pytestmark = pytest.mark.usefixtures("sim")


@pytest.mark.parametrize("is_rms_norm,rdt,fp32", [(True, torch.float32, False), (False, torch.float32, False),
                                                   (False, None, True)])
def test_fp32(is_rms_norm, rdt, fp32, sim):
    x, w, b, r = _cpu_inputs((6,), torch.float32, not is_rms_norm, rdt, seed=1, hidden=HIDDEN)
    g = torch.Generator().manual_seed(2)
    douts = (torch.randn(6, HIDDEN, generator=g), torch.randn(6, HIDDEN, generator=g))
    kw = dict(eps=1e-5, is_rms_norm=is_rms_norm, residual_in_fp32=fp32)
    got = _run(layer_norm_fn, x, w, b, r, douts, **kw)
    ref = _run(layer_norm_ref, x, w, b, r, [d.double() for d in douts], dtype=torch.float64, **kw)
    assert sim and all(k.target.startswith("cudasim-") for k, _ in sim)
    for name, gv, rv in zip(_names(b is not None, r is not None), got, ref):
        assert_close_to_ref(gv, rv, name=name, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("is_rms_norm,rdt", [(True, torch.float32), (False, torch.float32), (True, None)])
def test_bf16_with_fp32_residual(is_rms_norm, rdt):
    """Block's paths: bf16 hidden states with the fp32 residual of residual_in_fp32, and the first layer (no
    residual yet: residual_out = x stored in float32)."""
    x, w, b, r = _cpu_inputs((4, 3), torch.bfloat16, not is_rms_norm, rdt, seed=3, hidden=HIDDEN)
    g = torch.Generator().manual_seed(4)
    douts = (torch.randn(4, 3, HIDDEN, generator=g), torch.randn(4, 3, HIDDEN, generator=g))
    kw = dict(eps=1e-5, is_rms_norm=is_rms_norm, residual_in_fp32=True)
    got = _run(layer_norm_fn, x, w, b, r, douts, **kw)
    ref64 = _run(layer_norm_ref, *(t.detach().double() if t is not None else None for t in (x, w, b, r)),
                 [d.double() for d in douts], **kw)
    low = _run(layer_norm_ref, x, w, b, r, douts, **kw)
    assert got[1].dtype == torch.float32
    for name, gv, rv, lo in zip(_names(b is not None, r is not None), got, ref64, low):
        assert gv.dtype == lo.dtype, name
        assert_close_to_ref(gv, rv, lo, name=name)


def test_rowscale():
    x, w, b, r = _cpu_inputs((5,), torch.float32, True, torch.float32, seed=6, hidden=HIDDEN)
    rs = torch.rand(5, generator=torch.Generator().manual_seed(7)) + 0.5
    g = torch.Generator().manual_seed(8)
    douts = (torch.randn(5, HIDDEN, generator=g), torch.randn(5, HIDDEN, generator=g))
    kw = dict(eps=1e-5, is_rms_norm=False)
    got = _run(layer_norm_fn, x, w, b, r, douts, rowscale=rs, **kw)
    ref = _run(layer_norm_ref, x, w, b, r, [d.double() for d in douts], dtype=torch.float64,
               rowscale=rs.double(), **kw)
    for name, gv, rv in zip(_names(True, True), got, ref):
        assert_close_to_ref(gv, rv, name=name, atol=2e-4, rtol=1e-4)


def test_module_prenorm():
    m = RMSNorm(HIDDEN, eps=1e-5)
    x, r = torch.randn(2, HIDDEN), torch.randn(2, HIDDEN)
    out, rout = m(x, r, prenorm=True, residual_in_fp32=True)
    ref, rref = layer_norm_ref(x.double(), m.weight.double(), None, r.double(), 1e-5, True, True, True)
    assert_close_to_ref(out, ref, atol=2e-4)
    assert_close_to_ref(rout, rref, atol=1e-6)


def _config_id(config):
    direction, static, dtypes = config
    return f"{direction}-{'rms' if static.get('is_rms_norm', True) else 'ln'}-{dtypes['x']}"


@pytest.mark.parametrize("config", [c for c in build_check_configs()
                                    if c[1].get("has_residual") or c[1].get("has_dresidual")], ids=_config_id)
def test_simcheck_build_check_configs(config):
    """sim-check's own check on the fused add-norm build-check configurations (hidden 2048, bf16 x, fp32
    residual: mixer_seq_simple's Block with residual_in_fp32)."""
    from tvm_mamba.tools.simcheck import rmsnorm_gated as simcheck

    direction, static, dtypes = config
    simcheck.check(direction, static, dtypes, "sm_90")
