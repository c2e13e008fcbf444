"""mamba_ssm 2.3.2.post1's pure-Python (Triton) kernels, timed on the same tensors as the case's call.

While a case runs, :func:`watch` wraps the tvm_mamba public functions that have a Triton counterpart upstream
(the simcheck cases call them as ``tvm_mamba.<name>``): the first call's arguments are cloned before our
kernel runs (in-place updates cannot leak into upstream's inputs) and our outputs kept. Afterwards upstream's
function runs on those clones: its time (CUDA events, median of 10 after warm-up) and its max |difference|
from our output (which the case compared with the float64 reference; the bound on upstream's own error is
that plus our max error). Never a failure: when mamba_ssm, Triton or CUDA is missing, or upstream rejects the
call, the row says "upstream: not available (reason)" or "upstream: failed (reason)".
"""
from __future__ import annotations

import contextlib
import importlib
import inspect

import torch

from .common import timer

# tvm_mamba function -> (upstream module, function)
UPSTREAM = {
    "mamba_chunk_scan_combined": ("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined"),
    "selective_state_update": ("mamba_ssm.ops.triton.selective_state_update", "selective_state_update"),
    "layernorm_fn": ("mamba_ssm.ops.triton.layernorm_gated", "layernorm_fn"),
    "layer_norm_fn": ("mamba_ssm.ops.triton.layer_norm", "layer_norm_fn"),
    "mamba3_siso_combined": ("mamba_ssm.ops.triton.mamba3.mamba3_siso_combined", "mamba3_siso_combined"),
    "mamba3_siso_step": ("mamba_ssm.ops.triton.mamba3.mamba3_siso_step", "mamba3_siso_step"),
}


def available(device: torch.device) -> str | None:
    """None when upstream's Triton kernels can run on ``device``, else why not."""
    if device.type != "cuda":
        return f"no CUDA device ({device.type})"
    for mod in ("triton", "mamba_ssm"):
        try:
            importlib.import_module(mod)
        except Exception as err:  # noqa: BLE001 - any import failure means "not here"
            return f"{mod} does not import: {type(err).__name__}: {str(err)[:120]}"
    return None


def _clone(v):
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    if isinstance(v, (tuple, list)):
        return type(v)(_clone(x) for x in v)
    return v


def _first_tensor(out):
    while isinstance(out, (tuple, list)) and out:
        out = out[0]
    return out if isinstance(out, torch.Tensor) else None


class Watch:
    def __init__(self, names: list[str], device: torch.device):
        self.device, self.calls, self.reason = device, {}, None
        self.names = names

    def wrap(self, name: str, ours):
        def call(*args, **kwargs):
            first = name not in self.calls
            saved = (_clone(args), _clone(kwargs)) if first else None
            out = ours(*args, **kwargs)
            if first:
                self.calls[name] = (*saved, _clone(out))
            return out

        return call

    def result(self) -> str | dict | None:
        """None (no upstream counterpart), a "not available / failed (reason)" line, or {function, time_ms,
        max_diff_vs_tvm_mamba}."""
        if not self.names:
            return None
        if self.reason:
            return f"not available ({self.reason})"
        if not self.calls:
            return None

        name, (args, kwargs, ours) = next(iter(self.calls.items()))
        try:
            mod, fn_name = UPSTREAM[name]
            fn = getattr(importlib.import_module(mod), fn_name)
            params = inspect.signature(fn).parameters
            kwargs = {k: v for k, v in kwargs.items() if k in params}  # our extensions upstream lacks
            theirs = _first_tensor(fn(*_clone(args), **_clone(kwargs)))
            ms = timer(self.device, lambda: fn(*args, **kwargs), 10)
            mine = _first_tensor(ours)
            diff = (theirs.double() - mine.double()).abs().max().item() if theirs is not None and mine is not None \
                and theirs.shape == mine.shape else None
            return {"function": f"{mod}.{fn_name}", "time_ms": ms, "max_diff_vs_tvm_mamba": diff}
        except Exception as err:  # noqa: BLE001 - upstream's failure is reported, never ours
            return f"failed ({type(err).__name__}: {str(err).strip()[:200]})"


@contextlib.contextmanager
def watch(case, device: torch.device):
    """``with watch(case, device) as w:`` record the case's calls of functions with an upstream counterpart;
    ``w.result()`` after the block runs upstream on them (module docstring)."""
    import tvm_mamba

    names = list(UPSTREAM) if case.op in ("ssd", "selective_scan", "mamba3", "rmsnorm_gated") else []
    w = Watch(names, device)
    w.reason = available(device) if names else None
    if w.reason or not names:
        yield w
        return
    saved = {}
    for n in names:
        try:
            saved[n] = getattr(tvm_mamba, n)
        except Exception:  # noqa: BLE001 - a function that does not import here is simply not watched
            continue
    try:
        for n, f in saved.items():
            setattr(tvm_mamba, n, w.wrap(n, f))
        yield w
    finally:
        for n, f in saved.items():
            setattr(tvm_mamba, n, f)
