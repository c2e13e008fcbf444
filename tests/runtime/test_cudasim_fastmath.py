"""The harness computes float math as the --use_fast_math GPU binary does (runtime/nvcc.py's flag set;
cudasim_include/tvm_mamba_cudasim_fastmath.h): each emulated intrinsic against float64 at the CUDA Math API's
documented error bound, and evidence that it is not precise libm (the errors the GPU has, the harness has)."""
from __future__ import annotations

import ctypes
import math
import subprocess

import numpy as np
import pytest
import torch
import tvm
from tvm.script import tirx as T

from tvm_mamba.runtime import cuda_target, cudasim, nvcc

FUNCS = {"expf": 1, "__expf": 1, "exp2f": 1, "logf": 1, "__logf": 1, "log2f": 1, "__powf": 2, "sinf": 1,
         "cosf": 1, "tanhf": 1, "sqrtf": 1, "rsqrtf": 1, "__fdividef": 2}

SRC = "\n".join(f'extern "C" float t_{n}(float a, float b) {{ return {n}(a{", b" if k == 2 else ""}); }}'
                for n, k in FUNCS.items()) + """
extern "C" float t_mul_in_kernel_mode(float a, float b) { ::tvm_mamba_sim::FpMode m; volatile float p = a * b; return p; }
"""


def _lib(tmp_path_factory, fast: bool):
    tmp = tmp_path_factory.mktemp("fastmath" if fast else "precise")
    flags = [f for f in cudasim.compile_flags("sm_90") if fast or f != "-D__USE_FAST_MATH__"]
    (tmp / "t.cc").write_text(SRC)
    subprocess.run(["g++", *flags, "-shared", "-o", str(tmp / "t.so"), str(tmp / "t.cc")], check=True, cwd=tmp)
    lib = ctypes.CDLL(str(tmp / "t.so"))
    for n in [*FUNCS, "mul_in_kernel_mode"]:
        f = getattr(lib, f"t_{n}")
        f.restype, f.argtypes = ctypes.c_float, [ctypes.c_float, ctypes.c_float]
    return lib


@pytest.fixture(scope="module")
def fm(tmp_path_factory):
    assert "--use_fast_math" in nvcc.NVCC_FLAGS and "-D__USE_FAST_MATH__" in cudasim.compile_flags("sm_90")
    return _lib(tmp_path_factory, fast=True)


@pytest.fixture(scope="module")
def precise(tmp_path_factory):
    return _lib(tmp_path_factory, fast=False)


def _f32(v) -> np.ndarray:
    return np.asarray(v, dtype=np.float32)


def _ulp_err(got, exact) -> np.ndarray:
    """|got - exact| in units of the float32 ulp at ``exact``."""
    ulp = np.spacing(np.abs(_f32(exact))).astype(np.float64)
    return np.abs(np.asarray(got, np.float64) - exact) / ulp


def _call(lib, name, xs, ys=None):
    f = getattr(lib, f"t_{name}")
    return np.array([f(float(x), float(y)) for x, y in zip(xs, ys if ys is not None else xs)], np.float64)


def test_expf_error_grows_with_x_within_the_documented_bound(fm, precise):
    x = _f32(np.linspace(-87.0, 88.0, 4001)).astype(np.float64)
    exact = np.exp(x)
    for name in ("expf", "__expf"):
        err = _ulp_err(_call(fm, name, x), exact)
        assert (err <= 2 + np.floor(np.abs(1.173 * x))).all(), name  # CUDA Math API: __expf
        big = np.abs(x) > 60
        assert err[big].max() > 8, name  # fl(x log2e)'s rounding: libm's expf is within 1 ulp
    assert _ulp_err(_call(precise, "expf", x), exact).max() <= 1  # without --use_fast_math: libm


def test_logf_absolute_error_near_one(fm, precise):
    x = _f32(np.concatenate([np.linspace(0.5, 2.0, 3001), 1 + np.arange(1, 200) * 2.0 ** -23])).astype(np.float64)
    got = _call(fm, "logf", x)
    assert np.abs(got - np.log(x)).max() <= 2 ** -21.41  # documented on [0.5, 2]
    near = x[(np.abs(x - 1) < 2 ** -16) & (x != 1)]
    assert (np.abs(_call(fm, "logf", near) / np.log(near) - 1)).max() > 1e-3  # not libm's relative accuracy
    assert (np.abs(_call(precise, "logf", near) / np.log(near) - 1)).max() < 1e-6
    far = _f32(np.geomspace(1e-30, 1e30, 2001)).astype(np.float64)
    far = far[(far < 0.5) | (far > 2)]
    assert _ulp_err(_call(fm, "logf", far), np.log(far)).max() <= 3
    assert _ulp_err(_call(fm, "log2f", far), np.log2(far)).max() <= 2


def test_sin_cos_tanh_pow_and_division(fm):
    x = _f32(np.linspace(-math.pi, math.pi, 4001)).astype(np.float64)
    assert np.abs(_call(fm, "sinf", x) - np.sin(x)).max() <= 2 ** -21.41
    assert np.abs(_call(fm, "cosf", x) - np.cos(x)).max() <= 2 ** -21.19
    t = _f32(np.linspace(-9, 9, 4001)).astype(np.float64)
    rel = np.abs(_call(fm, "tanhf", t) - np.tanh(t)) / np.maximum(np.abs(np.tanh(t)), 1e-30)
    assert rel.max() <= 2 ** -16 and rel.max() > 2 ** -20  # MUFU.TANH's ~16 bits, not libm's 24
    xs, ys = _f32(np.geomspace(0.01, 100, 500)).astype(np.float64), _f32(np.linspace(-9, 9, 500)).astype(np.float64)
    t = np.abs(ys * np.log2(xs))
    # documented as ex2(y lg2(x)): lg2's 2^-22 absolute error times |y| plus fl(y lg2 x)'s |t| 2^-24, through ex2
    assert (_ulp_err(_call(fm, "__powf", xs, ys), xs ** ys) <= 3 + math.log(2) * (4 * np.abs(ys) + t)).all()
    assert _call(fm, "__fdividef", [1.0, 1.0], [2.0 ** 127, 3.0]).tolist() == [0.0, _f32(1 / 3).item()]


def test_sqrt_rsqrt_and_flush_to_zero(fm, precise):
    x = _f32(np.geomspace(1e-30, 1e30, 2001)).astype(np.float64)
    assert _ulp_err(_call(fm, "sqrtf", x), np.sqrt(x)).max() <= 1
    assert _ulp_err(_call(fm, "rsqrtf", x), 1 / np.sqrt(x)).max() <= 2
    sub = 1e-39  # a float32 subnormal
    assert _call(fm, "sqrtf", [sub])[0] == 0.0 and _call(precise, "sqrtf", [sub])[0] > 0
    assert fm.t_mul_in_kernel_mode(1e-20, 1e-19) == 0.0  # -ftz=true: a subnormal product flushes
    assert precise.t_mul_in_kernel_mode(1e-20, 1e-19) > 0.0


def test_fast_math_follows_the_nvcc_flag_set(monkeypatch):
    assert cudasim.fast_math_defines() == ["-D__USE_FAST_MATH__"]
    monkeypatch.setattr(nvcc, "NVCC_FLAGS", tuple(f for f in nvcc.NVCC_FLAGS if f != "--use_fast_math"))
    assert cudasim.fast_math_defines() == []


@T.prim_func
def exp_kernel(a: T.Buffer((256,), "float32"), b: T.Buffer((256,), "float32")):
    T.func_attr({"global_symbol": "exp_kernel", "tirx.noalias": True})
    for bx in T.thread_binding(2, thread="blockIdx.x"):
        for tx in T.thread_binding(128, thread="threadIdx.x"):
            b[bx * 128 + tx] = T.exp(a[bx * 128 + tx]) * T.float32(1e-3)


def test_a_harness_kernel_runs_in_the_gpus_fast_math_mode(tmp_path):
    """Through cudasim.build/call: TVM's expf is the emulated one, and exp(-87) 1e-3 (1.6e-41, a subnormal)
    flushes to zero."""
    built = cudasim.build(tvm.IRModule({"exp_kernel": exp_kernel}), cuda_target("sm_90"), label="exp_kernel")
    built.export_library(str(tmp_path / "k.so"))
    module = cudasim.load(str(tmp_path / "k.so"))
    a = torch.cat([torch.linspace(60, 88, 128), torch.full((128,), -87.0)])
    b = torch.zeros(256)
    cudasim.call(module, module["exp_kernel"], [a, b], label="exp_kernel")
    exact = np.exp(a.double().numpy()) * np.float64(np.float32(1e-3))
    err = _ulp_err(b[:128].double().numpy(), exact[:128])
    assert err.max() > 8 and (err <= 3 + np.floor(1.173 * a[:128].double().numpy())).all()
    assert (b[128:] == 0).all()
