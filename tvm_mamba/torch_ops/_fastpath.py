"""Prepared launches for the small ops a server calls once per layer and token (the decode steps).

A decode-step op's Python (argument checks, kernel key, cache lookup, layout, placeholders) costs tens of
microseconds, its kernel at decode shapes a few. Everything the Python decides is a function of the call's
*signature*: each tensor's shape, strides, dtype, device and address modulo 64 (the alignment the kernels
need), the flags, and what selects kernels (tuning state, ``simulate_cuda``, the environment variables the
kernel cache reads). :class:`FastPath` runs an op's full implementation the first time it sees a signature,
watches the launches it makes (:class:`~._dlpack.capture_launches`) and keeps a *recipe*: per launch, the
kernel and where each argument comes from — an input (or a view of it, rebuilt with ``as_strided``), a
cached placeholder, or a fresh output. The next call with that signature runs only the op's data checks
(index ranges: values, not shapes; on the CPU the kernels check those themselves) and the launches. The last
few recipes are tried first by their guards (torch's C++ tensor check, without building the signature); each
recipe's guard, context check and launches run as one generated straight-line function
(torch_ops/_recipe_code.py).

An op qualifies when its implementation touches memory only through kernels (no torch writes beside them)
and its kernels take tensors only. A signature whose launches read a temporary gets no recipe and keeps the
full path, except the op's compact copies of read-only inputs when the op opts in (``copies``: a server's
activations are strided slices of a projection's output; the recipe copies them again, as the op would). Autograd, torch.compile,
tensor subclasses and dispatch modes always take the full path (:func:`~._dlpack.eager_direct`).
"""
from __future__ import annotations

import os
import threading
import time
from typing import Callable, Optional, Sequence

import torch

from ..runtime import dispatch
from ..runtime.cache import FAST_TTL_S, KERNEL_ENV_VARS
from ..runtime.cudasim import current as sim_config
from ..runtime.target import cudasim_active, webgpu_active
from . import _dlpack
from ._recipe_code import MISS, compile_recipe, compile_serve

_SLOW = object()  # a signature whose launches read a temporary: no recipe
_AMBIGUOUS = object()  # a launch argument inside two inputs (they share memory in this call): not kept
_MAX_ENTRIES = 4096  # signatures kept per op (a server sees a few per batch size)
_HOT = 4  # recipes an op tries by guard before it computes the signature (the layers of a decode step share one)


def _environ_reader() -> Callable[[], tuple]:
    """The kernel cache's environment variables, read as ``os.environ``'s own dict holds them (a dict
    lookup each; ``os.environ.get`` encodes the name first, ~1 us apiece)."""
    data = getattr(os.environ, "_data", None)
    encode = getattr(os.environ, "encodekey", None)
    if not isinstance(data, dict) or encode is None:
        return lambda: tuple(os.environ.get(name) for name in KERNEL_ENV_VARS)
    keys, get = tuple(encode(name) for name in KERNEL_ENV_VARS), data.get
    return lambda: tuple(map(get, keys))


_environ = _environ_reader()


def context() -> tuple:
    """What picks kernels beyond the call itself; a recipe serves only under the context it was made in."""
    sim = cudasim_active()
    return (dispatch.generation(), None if sim is None else (sim.target_key, sim_config().checks), webgpu_active(),
            _environ())


def signature(tensors: Sequence[Optional[torch.Tensor]], flags: tuple) -> Optional[tuple]:
    """The call's signature, or None when the call must take the full path (what
    :func:`~._dlpack.eager_direct` refuses: compiling, dispatch or function modes, a tensor subclass or
    functorch wrapper, a tensor that needs a gradient). One pass over the tensors: the two checks cost a
    decode step's call more than its kernel when made apart."""
    if not _dlpack.modes_allow_direct():
        return None
    grad, wrapped, parts = torch.is_grad_enabled(), torch._C._functorch.is_functorch_wrapped_tensor, [flags]
    for t in tensors:
        if t is None:
            parts.append(None)
            continue
        if type(t) not in _dlpack.PLAIN or (grad and t.requires_grad) or wrapped(t):
            return None
        parts.append((t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 63))
    return tuple(parts)


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last) byte addresses ``t`` reads (strides >= 0)."""
    return t.data_ptr(), t.data_ptr() + _dlpack.extent(t) * t.element_size()


def _source(a: torch.Tensor, inputs, outputs: list, copies=()):
    """Where launch argument ``a`` comes from: ("id", j) input j itself; ("in", j, size, stride, offset delta) a
    view inside input j; ("new", k) fresh output storage k (flat), ("out", k, size, stride,
    offset) a view of it; ("const", a) a cached placeholder; ("copy", k, source, size, stride, offset delta) a
    view of the k-th compact copy the op made (``copies``: (copy, original) pairs) of ``source`` (an input or
    a view inside one); None for anything else (a temporary)."""
    if _dlpack.is_dummy(a):
        return ("const", a)
    if any(s < 0 for s in a.stride()):
        return None
    storage = a.untyped_storage().data_ptr()
    lo, hi = _span(a)
    found = None
    for j, t in enumerate(inputs):
        if t is None or t.dtype != a.dtype or t.untyped_storage().data_ptr() != storage:
            continue
        t_lo, t_hi = _span(t)
        if t_lo <= lo and hi <= t_hi and min(t.stride(), default=0) >= 0:
            if found is not None:  # e.g. B and C the same tensor: which one the op passed is not knowable here
                return _AMBIGUOUS
            if a.shape == t.shape and a.stride() == t.stride() and lo == t_lo:
                found = ("id", j)  # the input itself: so for every call of this signature
            else:
                found = ("in", j, tuple(a.shape), tuple(a.stride()), a.storage_offset() - t.storage_offset())
    if found is not None:
        return found
    for k, (ptr, numel, dtype, _device) in enumerate(outputs):
        if ptr == storage and dtype == a.dtype:
            if a.storage_offset() == 0 and a.dim() == 1 and a.numel() == numel:
                return ("new", k)
            return ("out", k, tuple(a.shape), tuple(a.stride()), a.storage_offset())
    for k, (copy, original) in enumerate(copies):
        if copy.untyped_storage().data_ptr() == storage and copy.dtype == a.dtype:
            src = _source(original, inputs, outputs)
            if src is None or src is _AMBIGUOUS or src[0] not in ("id", "in"):
                return src if src is _AMBIGUOUS else None
            return ("copy", k, src, tuple(a.shape), tuple(a.stride()), a.storage_offset() - copy.storage_offset())
    return None


class _Recipe:
    """Launches (kernel, argument sources), fresh outputs (numel, dtype, device), the result's source(s);
    served under ``context`` until ``expires`` (then the op runs in full once more: the kernel cache's own
    re-resolution interval, so tuning records written meanwhile are picked up)."""
    __slots__ = ("context", "expires", "launches", "outputs", "result", "serve", "run", "on_host")

    def __init__(self, context, launches, outputs, result, inputs):
        self.context, self.launches, self.outputs, self.result = context, launches, outputs, result
        self.on_host = all(kernel.on_host for kernel, _ in launches)  # every kernel checks its own values
        self.expires = time.monotonic() + FAST_TTL_S
        self.serve: Optional[Callable] = None  # serve(tensors, flags, args): guarded run (compile_serve)
        self.run = compile_recipe(launches, outputs, result, inputs, _build)  # run(inputs) -> result

    def serves(self) -> bool:
        return self.context == context() and time.monotonic() < self.expires


def _make_recipe(ctx, inputs, launches, result, copies=()):
    """The recipe of one watched call; None when a launch reads a temporary or takes a non-tensor (the
    signature keeps the full path); _AMBIGUOUS when inputs shared memory in this call (nothing is kept: a
    later call of the signature with separate inputs makes the recipe, which then serves shared ones too)."""
    results = result if isinstance(result, tuple) else (result,)
    if not all(isinstance(r, torch.Tensor) for r in results):
        return None
    outputs, seen = [], set()
    for r in results:  # the op's fresh outputs: storage no input shares
        ptr = r.untyped_storage().data_ptr()
        if ptr not in seen and all(t is None or t.untyped_storage().data_ptr() != ptr for t in inputs):
            seen.add(ptr)
            outputs.append((ptr, r.untyped_storage().nbytes() // r.element_size(), r.dtype, r.device))
    steps = []
    for launch in launches:
        if not all(isinstance(a, torch.Tensor) for a in launch.args):
            return None
        sources = [_source(a, inputs, outputs, copies) for a in launch.args]
        if any(s is None or s is _AMBIGUOUS for s in sources):
            return _AMBIGUOUS if _AMBIGUOUS in sources else None
        steps.append((launch.kernel, tuple(sources)))
    returned = [_source(r, inputs, outputs) for r in results]
    if any(s is _AMBIGUOUS for s in returned):
        return _AMBIGUOUS
    if any(s is None or s[0] == "const" for s in returned):
        return None
    result_spec = tuple(returned) if isinstance(result, tuple) else returned[0]
    return _Recipe(ctx, tuple(steps), tuple((numel, dtype, device) for _, numel, dtype, device in outputs),
                   result_spec, tuple(None if t is None else (tuple(t.shape), t.stride(), t.dtype, t.device)
                                      for t in inputs))


def _build(src, inputs, fresh, made=None):
    kind = src[0]
    if kind == "copy":  # the op's copy of an input (made once per call, shared by the launches reading it)
        _, k, inner, size, stride, delta = src
        if k not in made:
            made[k] = _dlpack.prepare(_build(inner, inputs, fresh))
        copy = made[k]
        return copy.as_strided(size, stride, copy.storage_offset() + delta)
    if kind == "id":
        return inputs[src[1]]
    if kind == "const":
        return src[1]
    if kind == "new":
        return fresh[src[1]]
    if kind == "in":  # here only as what a "copy" copies; a launch's own views are remembered by _recipe_code
        _, j, size, stride, delta = src
        t = inputs[j]
        return t.as_strided(size, stride, t.storage_offset() + delta)
    _, k, size, stride, offset = src
    return fresh[k].as_strided(size, stride, offset)


class FastPath:
    """``FastPath(full, checks)``: ``call(tensors, flags, *args)`` runs ``full(*args)`` (the op's public
    implementation) the first time a signature of ``tensors`` (every tensor argument, None where absent) and
    ``flags`` (every non-tensor argument) is seen, and its recipe after; ``checks(*args)`` runs first on
    every recipe call (the value checks: indices in range, distinct slots), raising as ``full`` would;
    ``host_checks``: the op's CPU kernels make those checks themselves before they write (compute/strategy.py
    ``slot_checks``), so a recipe whose launches all run on the host skips them, and runs them only after a
    kernel refused the call, to name the value as the full path does.
    ``copies``: the op's compact copies of read-only inputs (``_dlpack.prepare``: a strided ``x``, as a
    server's sliced activations are) are made again by the recipe; only for ops whose kernels write no such
    copy (their in-place pools go through ``prepare_pool``, which is never replayed)."""

    def __init__(self, full: Callable, checks: Callable | None = None, copies: bool = False,
                 host_checks: bool = False):
        self.full, self.checks, self.copies, self.host_checks = full, checks, copies, host_checks
        self._recipes: dict = {}
        self._hot: tuple = ()  # recipes with guards, most recently used first
        self._lock = threading.Lock()

    def call(self, tensors: Sequence[Optional[torch.Tensor]], flags: tuple, *args):
        if _dlpack.modes_allow_direct():
            for recipe in self._hot:
                result = recipe.serve(tensors, flags, args)
                if result is not MISS:
                    return result
        if not all(t is None or isinstance(t, torch.Tensor) for t in tensors):
            return self.full(*args)  # the full path names the argument that is no tensor
        sig = signature(tensors, flags)
        if sig is None:
            return self.full(*args)
        try:
            recipe = self._recipes.get(sig)
        except TypeError:  # an unhashable flag: the full path says what is wrong with it
            return self.full(*args)
        if recipe is _SLOW:
            return self.full(*args)
        if recipe is not None and recipe.serves():
            self._promote(recipe)
            return self._serve(recipe, tensors, args)
        return self._watch(sig, tensors, flags, args)

    def _serve(self, recipe: _Recipe, tensors, args):
        """``recipe.run``, after the value checks where its kernels do not make them."""
        if self.checks is None:
            return recipe.run(tensors)
        if not (self.host_checks and recipe.on_host):
            self.checks(*args)
            return recipe.run(tensors)
        try:
            return recipe.run(tensors)
        except ValueError:  # a kernel refused a value (nothing written): the checks name it as the full path does
            self.checks(*args)
            raise

    def _promote(self, recipe: _Recipe) -> None:
        """Put ``recipe`` first among the guarded ones (a new tuple: readers in other threads see either)."""
        if recipe.serve is not None and (not self._hot or self._hot[0] is not recipe):
            self._hot = (recipe,) + tuple(r for r in self._hot if r is not recipe)[:_HOT - 1]

    def _watch(self, sig, tensors, flags, args):
        ctx, outer = context(), _dlpack.recording()
        copies, saved = ([] if self.copies else None), _dlpack._capture.copies
        _dlpack._capture.copies = copies
        try:
            with _dlpack.capture_launches() as launches:
                result = self.full(*args)
        finally:
            _dlpack._capture.copies = saved
        if outer is not None:  # a capture around this call (a decode plan's) sees these launches too
            outer.extend(launches)
        made = _make_recipe(ctx, tensors, launches, result, copies or ())
        if made is _AMBIGUOUS:
            return result
        if made is not None:
            made.serve = compile_serve(made.run, tensors, flags, made.context, made.expires, context, self.checks,
                                       checks_first=not (self.host_checks and made.on_host))
        with self._lock:
            if len(self._recipes) >= _MAX_ENTRIES:
                self._recipes.clear()
                self._hot = ()
            old = self._recipes.get(sig)
            self._recipes[sig] = _SLOW if made is None else made
            if old is not None and old is not _SLOW:  # an expired recipe of this signature: its guard goes too
                self._hot = tuple(r for r in self._hot if r is not old)
            if made is not None:
                self._promote(made)
        return result

    def clear(self) -> None:
        with self._lock:
            self._recipes.clear()
            self._hot = ()
