"""Cached decode plans: one decode step of a Mamba / Mamba2 block, or of a whole MambaLMHeadModel, as a fixed
sequence of matmuls and kernel launches on preallocated buffers.

A decode step at batch 1 moves little data besides the weights, so what the public functions do around each
kernel (argument checks, kernel-key lookup, output allocation, ``torch.split`` / ``.contiguous()`` copies,
``-exp(A_log)``) costs as much as the kernels. A plan does that work once:

- derived parameters (A = -exp(A_log), float32 D / dt_bias, the (dim, width) conv weight view) are computed
  when the plan is built;
- projections (:class:`Dense`, :class:`Projection`) run the linear op's GEMV kernel — fp32 layers at inference
  (``fp32_linear``: the same function the blocks' step paths call) and bf16 / int8 ``QuantizedLinear`` — as a
  replayed launch, or one matmul into a buffer the plan owns; the parts of in_proj / x_proj are views of the
  result at batch 1, compact copies into buffers made once otherwise;
- each kernel op runs once through its public function (all checks, the kernel resolved through
  ``build_and_load``) while :func:`~tvm_mamba.torch_ops._dlpack.capture_launches` records the kernel and its
  argument tuple; later steps replay that launch on the same tensors (:class:`Captured`) — the CPU
  counterpart of upstream's CUDA-graph decode (mamba_ssm ``utils/generation.capture_graph``).

A plan is reused (:func:`cached`) while everything it baked in is unchanged: the module tree's parameters and
submodules (:class:`Watch`: identities, data pointers and ``_version`` counters, so an optimizer step,
``load_state_dict`` or ``.to`` rebuilds it), the state tensors (pointer, shape, strides, dtype), batch,
dtype, device, the kernel target (``simulate_cuda``), the dispatch generation (tuning logs) and inference
mode (buffers made in inference mode are inference tensors). Module attributes (eps, dt_limit, ...) are read
when a plan is built. Plans live in a weak dictionary beside the module, not on it (state_dict, deepcopy and
pickling never see them); a plan holds its state tensors until it is dropped (:func:`forget`).

A plan's buffers serve one step at a time; threads decoding different caches through one module get a plan
each (up to PLANS_PER_MODULE), as the same cache could not be shared by two threads anyway.

Used only where nothing needs autograd or tracing (:func:`eager`): grad mode with parameters that need
gradients, torch.compile, dispatch / function modes (profilers, FakeTensor) and tensor subclasses take the
modules' ordinary path, which runs the same kernels.
"""
from __future__ import annotations

import functools
import threading
import weakref
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..runtime import dispatch
from ..runtime.target import device_target_key
from ..torch_ops._dlpack import ALIGN, capture_launches, eager_direct
from ..torch_ops.causal_conv1d import causal_conv1d_update
from ..torch_ops.layer_norm import layer_norm_fn
from ..torch_ops.linear import fp32_on_kernel, fp32_linear, linear
from ..torch_ops.rmsnorm_gated import rmsnorm_fn
from ..torch_ops.selective_scan import selective_state_update
from ._checks import check_hidden
from .layer_norm import RMSNorm

_plans: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()  # key -> _Entry


class Watch:
    """What a plan baked in from a module tree: every submodule edge (parent, name, child) and parameter
    (owner, name, tensor) with the tensor's data pointer and version counter. :meth:`changed` is True once a
    submodule or parameter is replaced, or a parameter is updated in place (an optimizer step,
    load_state_dict) or moved (``.to``): the plan's derived tensors (A = -exp(A_log), ...) or the weights it
    reads may be stale. Cheaper per step than walking the tree (``model.parameters()``). Owners are held
    weakly (a plan must not keep its module alive)."""

    def __init__(self, root: torch.nn.Module):
        mods = list(root.modules())
        self.edges = [(weakref.ref(m), name, c) for m in mods for name, c in m._modules.items()]
        self.params = [(weakref.ref(m), name, p) for m in mods for name, p in m._parameters.items() if p is not None]
        self.stamp = self._stamp()  # RuntimeError for an inference tensor (no version counter)

    def _stamp(self) -> list:
        return [(p.data_ptr(), p._version) for _, _, p in self.params]

    def changed(self) -> bool:
        for owner, name, child in self.edges:
            m = owner()
            if m is None or m._modules.get(name) is not child:
                return True
        for owner, name, p in self.params:
            m = owner()
            if m is None or m._parameters.get(name) is not p:
                return True
        return self._stamp() != self.stamp


class _Entry(NamedTuple):
    watch: Watch
    plan: object


def eager(x: Tensor, module: torch.nn.Module) -> bool:
    """True when a plan may serve a step on input ``x``: eager mode, a plain tensor, and no gradient needed
    (grad mode off, or no parameter of ``module`` requires one)."""
    if not eager_direct(x):
        return False
    return not torch.is_grad_enabled() or not any(p.requires_grad for p in module.parameters())


def tensor_stamp(t: Tensor) -> tuple:
    """What a plan bound to ``t`` relies on: its memory, shape, strides and dtype."""
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


PLANS_PER_MODULE = 4  # caches decoded in turn through one model (sessions, candidates) keep their plans


def cached(module: torch.nn.Module, x: Tensor, extra: tuple, build: Callable[[], object]):
    """The module's plan for a step on input ``x`` (batch first): a cached one while its key (batch, dtype,
    device, kernel target, dispatch generation, inference mode, ``extra``: the states) matches and its
    :class:`Watch` sees no change, else ``build()``, cached (the least recently used of more than
    PLANS_PER_MODULE is dropped). None when the module has parameters without a version counter (inference
    tensors: an in-place update could not be seen)."""
    key = (x.shape[0], x.dtype, x.device, device_target_key(x.device), dispatch.generation(),
           torch.is_inference_mode_enabled()) + extra
    entries = _plans.get(module)
    hit = entries.pop(key, None) if entries is not None else None
    if hit is not None and not hit.watch.changed():
        entries[key] = hit  # most recently used last
        return hit.plan
    try:
        watch = Watch(module)
    except RuntimeError:
        _plans.pop(module, None)
        return None
    if entries is None or any(e.watch.changed() for e in entries.values()):
        entries = _plans[module] = {}
    plan = build()
    entries[key] = _Entry(watch, plan)
    while len(entries) > PLANS_PER_MODULE:
        entries.pop(next(iter(entries)))
    return plan


def plan_of(module: torch.nn.Module):
    """The module's most recently used plan, or None."""
    entries = _plans.get(module)
    return next(reversed(entries.values())).plan if entries else None


def forget(module: torch.nn.Module) -> None:
    """Drop the module's cached plans (and the state tensors they hold)."""
    _plans.pop(module, None)


def linear_into(x: Tensor, weight: Tensor, bias: Optional[Tensor], out: Optional[Tensor]) -> Tensor:
    """F.linear(x, weight, bias) for x: (batch, in_features), written into ``out`` when given (same bits)."""
    if out is None:
        return torch.nn.functional.linear(x, weight, bias)
    if bias is None:
        return torch.mm(x, weight.t(), out=out)
    return torch.addmm(bias, x, weight.t(), out=out)


class Tape:
    """A whole planned step as the flat list of what it does: replayed kernel launches and in-place copies
    between plan buffers, recorded while the step runs (:class:`LMStep`). Valid only when every action of the
    step was recordable (``ok``): an op run afresh, or torch glue that makes a new tensor each step (the
    MLP half's cat, dt_limit's softplus), leaves values a replay of the list would not recompute. Replaying
    the list skips the Python between the launches (per layer: views, parts, flag checks), which at batch 1
    costs a small model's step about as much as one of its projections (docs/performance.md)."""

    def __init__(self):
        self.actions: list[Callable[[], object]] = []
        self.ok = True


class _Recording(threading.local):
    tape: Optional[Tape] = None  # the Tape a step of this thread records into (a class default: no lookup miss)


_recording = _Recording()


def _record(*actions) -> None:
    if _recording.tape is not None:
        _recording.tape.actions.extend(actions)


def _unrecordable() -> None:
    if _recording.tape is not None:
        _recording.tape.ok = False


def _copy(dst: Tensor, src: Tensor) -> Tensor:
    """dst.copy_(src), recorded."""
    _record(functools.partial(dst.copy_, src))
    return dst.copy_(src)


class Captured:
    """One op call of a plan: the first :meth:`run` calls the op's public function and records its kernel
    launches; later runs replay them and return the first call's result (the same tensors, rewritten).

    A replay is only right when the launches read the caller's tensors themselves and write the result's.
    Every tensor argument given to the first run, and every tensor it returns, must therefore be a kernel
    argument at its own address; one that is not was copied by the op (a strided or unaligned input, a
    dtype conversion, a copied output), and a replay would use that stale copy: the stage then runs the op
    on every call instead. The ops a plan captures do no other per-call work than checks and allocating
    outputs their kernel writes in full (no dropout seeds, no zero-filling). Its result is the same tensors on
    every run (the op's fresh result copied into them when it cannot replay), so the stages after it replay
    on the memory they captured."""

    def __init__(self):
        self.launches = None  # None: not run yet; []: run the op every time; else the launches, bound
        self.result = None

    @staticmethod
    def _tensors(result) -> tuple:
        return tuple(result) if isinstance(result, (tuple, list)) else (result,)

    def run(self, fn: Callable, *args, **kwargs):
        """fn(*args, **kwargs), with the same tensors on every call (a plan's buffers), or its replay."""
        if self.launches:
            _record(*self.launches)
            for launch in self.launches:
                launch()
            return self.result
        _unrecordable()
        if self.launches is not None:  # into the first result's tensors: later stages replay on those
            fresh = fn(*args, **kwargs)
            for mine, new in zip(self._tensors(self.result), self._tensors(fresh)):
                mine.copy_(new)
            return self.result
        with capture_launches() as launches:
            result = fn(*args, **kwargs)
        seen = {a.data_ptr() for launch in launches for a in launch.args if isinstance(a, Tensor)}
        used = [a for a in (*args, *kwargs.values(), *self._tensors(result)) if isinstance(a, Tensor) and a.numel()]
        replayable = bool(launches) and all(t.data_ptr() in seen for t in used)
        self.launches = [launch.kernel.bind(*launch.args) for launch in launches] if replayable else []
        self.result = result
        return result


class Parts:
    """The parts (``sizes`` along the last dim) of a (batch, total) tensor as compact, 64-byte aligned tensors,
    as the kernels read them: a part is a view where it is one already (one row, or the whole width, starting
    on a 64-byte boundary), else a copy into a buffer made once (batch > 1: one copy per part instead of the
    ops' allocate-and-copy of a strided slice)."""

    def __init__(self, sizes, batch: int, like: Tensor):
        total, self.spans, start = sum(sizes), [], 0
        for size in sizes:
            view = size == 0 or (batch == 1 or size == total) and start * like.element_size() % ALIGN == 0
            self.spans.append((start, start + size, None if view else like.new_empty((batch, size))))
            start += size

    def __call__(self, t: Tensor) -> list[Tensor]:
        return [t[:, a:b] if buf is None else _copy(buf, t[:, a:b]) for a, b, buf in self.spans]


class _without_bias(NamedTuple):
    """dt_proj as the step uses it: its weight alone (the bias is added inside the state update)."""
    weight: Tensor
    bias: None = None

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]


class Dense:
    """y = layer(x) for x: (batch, in_features), as :func:`project` computes it: through the linear op (a
    ``QuantizedLinear``'s bf16 / int8 weights, or an fp32 ``nn.Linear`` where :func:`fp32_on_kernel` holds, decided
    on the first call: the plan's batch and dtype are fixed), its launch captured once and replayed; otherwise
    one matmul (into ``out`` when given, same bits as F.linear). ``external``: x is the caller's tensor (a new
    one each step), copied into a buffer the replayed launch reads; else x is a plan buffer, the same tensor
    every step."""

    def __init__(self, layer, external: bool = False):
        # a QuantizedLinear (modules/quantize.py) by what it holds: that module imports the blocks, which import this one
        self.quantized = isinstance(getattr(layer, "qweight", None), Tensor)
        self.args = (layer.qweight, layer.bias, layer.scale) if self.quantized else (layer.weight, layer.bias)
        self.call, self.external, self.x = Captured(), external, None
        self.op = True if self.quantized else None  # None: decided on the first call

    def reused(self, x: Tensor, out: Optional[Tensor] = None) -> Tensor:
        """layer(x); on the linear op, the replayed launch's result: the same tensor every step."""
        if self.op is None:
            self.op = fp32_on_kernel(x, *self.args)
        if not self.op:
            _unrecordable()
            return linear_into(x, *self.args, out)
        if self.external:
            if self.x is None:
                self.x = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            x = _copy(self.x, x)
        return self.call.run(linear, x, *self.args)

    def __call__(self, x: Tensor, out: Optional[Tensor] = None) -> Tensor:
        """layer(x) in ``out`` when given, else a new tensor (the caller may keep it past the next step)."""
        y = self.reused(x, out)
        if not self.op:
            return y
        if out is None:
            _unrecordable()  # a new tensor every step
            return y.clone()
        return _copy(out, y)


def project(layer, x: Tensor) -> Tensor:
    """layer(x) on a decode step's unplanned path (Mamba.step, Mamba2.step, the LM head), as a plan's
    :class:`Dense` computes it: an fp32 ``nn.Linear`` through :func:`fp32_linear` (the GEMV kernel at inference,
    F.linear under autograd), any other layer (``QuantizedLinear``) called."""
    if isinstance(layer, torch.nn.Linear):
        return fp32_linear(x, layer.weight, layer.bias)
    return layer(x)


class Projection:
    """y = layer(x) for x: (batch, in_features): the :class:`Dense` layer's replayed result (linear op) or one
    matmul into a buffer made once, returned as its parts (``sizes`` along out_features) in compact, aligned
    tensors (:class:`Parts`). One call, not one per part: torch's CPU matmul of a few rows reduces in another
    order than the whole matrix's (other bits), and one call is one launch. ``dtype``: the activations' (the
    result's dtype for a quantized layer; an nn.Linear's result has its weight's). ``external``: see Dense."""

    def __init__(self, layer, sizes, batch: int, dtype: torch.dtype, external: bool = False):
        if sum(sizes) != layer.out_features:
            raise ValueError(f"sizes: must add up to the layer's {layer.out_features} outputs, got {list(sizes)}")
        self.dense = Dense(layer, external)
        device = self.dense.args[0].device
        if not self.dense.quantized:
            dtype = layer.weight.dtype  # F.linear's result dtype (the linear op's too: fp32 x and weight)
        self.out = None if self.dense.quantized else torch.empty((batch, layer.out_features), dtype=dtype,
                                                                 device=device)  # unused where the op serves
        self.parts = Parts(sizes, batch, torch.empty(0, dtype=dtype, device=device))

    def __call__(self, x: Tensor) -> list[Tensor]:
        return self.parts(self.dense.reused(x, self.out))


# ------------------------------------------------------------------------------------------------------------
# block plans
class MambaStep:
    """Mamba.step on a plan (same ops, same bits): in_proj -> (x, z); conv update -> x; x_proj -> (dt, B, C);
    dt_proj; state update (softplus(dt + dt_proj.bias), D, silu(z) gate); out_proj.
    h: (batch, d_model) -> (batch, d_model); conv_state / ssm_state rows :batch updated in place."""

    def __init__(self, m, conv_state: Tensor, ssm_state: Tensor, batch: int):
        d, n = m.d_inner, m.d_state
        dtype = conv_state.dtype
        self.in_proj = Projection(m.in_proj, (d, d), batch, dtype, external=True)
        self.x_proj = Projection(m.x_proj, (m.dt_rank, n, n), batch, dtype)
        self.dt_proj = Projection(_without_bias(m.dt_proj.weight), (d,), batch, dtype)
        self.conv_args = (conv_state[:batch], m._conv_weight(), m.conv1d.bias, m.activation)
        self.ssm_state = ssm_state[:batch]
        self.A = -torch.exp(m.A_log.float())
        self.D, self.dt_bias = m.D.float(), m.dt_proj.bias.float()
        self.out_proj = Dense(m.out_proj)
        self.conv, self.scan = Captured(), Captured()

    def step(self, h: Tensor, out: Optional[Tensor] = None) -> Tensor:
        x, z = self.in_proj(h)
        x = self.conv.run(causal_conv1d_update, x, *self.conv_args)
        dt, B, C = self.x_proj(x)
        dt, = self.dt_proj(dt)
        y = self.scan.run(selective_state_update, self.ssm_state, x, dt, self.A, B, C, self.D, z=z,
                          dt_bias=self.dt_bias, dt_softplus=True)
        return self.out_proj(y, out)


class Mamba2Step:
    """Mamba2.step on a plan (same ops, same bits): in_proj -> (z0, x0, z, xBC, dt); conv update -> (x, B, C);
    state update (head layout, one A / dt / D per head unless D_has_hdim); gated RMSNorm; out_proj.
    h: (batch, d_model) -> (batch, d_model); conv_state / ssm_state rows :batch updated in place.

    D_has_hdim runs the untied kernel, which reads (nheads, headdim) dt / dt_bias and (nheads, headdim,
    dstate) A: those are made compact once (dt: one copy per step), where Mamba2.step's expanded views were
    copied by the op on every call."""

    def __init__(self, m, conv_state: Tensor, ssm_state: Tensor, batch: int):
        gn, hp = m.ngroups * m.d_state, (m.nheads, m.headdim)
        self.dims = (batch, hp, m.ngroups, m.d_state, m.d_ssm)
        self.d_mlp = d_mlp = (m.in_proj.weight.shape[0] - 2 * m.d_ssm - 2 * gn - m.nheads) // 2
        self.in_proj = Projection(m.in_proj, (d_mlp, d_mlp, m.d_ssm, m.d_ssm + 2 * gn, m.nheads), batch,
                                  conv_state.dtype, external=True)
        self.conv_args = (conv_state[:batch], m._conv_weight(), m.conv1d.bias, m.activation)
        self.xbc = Parts((m.d_ssm, gn, gn), batch, m.in_proj.weight)  # x, B, C of the conv output
        self.ssm_state = ssm_state[:batch]
        self.tied = not m.D_has_hdim
        A = (-torch.exp(m.A_log.float()))[:, None, None].expand(*hp, m.d_state)
        D = m.D.float().reshape(hp) if m.D_has_hdim else m.D.float()[:, None].expand(hp)
        self.limit = None if m.dt_limit == (0.0, float("inf")) else tuple(m.dt_limit)
        dt_bias = None if self.limit else m.dt_bias.float()[:, None].expand(hp)
        self.dt_bias_raw = m.dt_bias
        self.A, self.D = (A, D) if self.tied else (A.contiguous(), D)
        self.dt_bias = dt_bias if self.tied or dt_bias is None else dt_bias.contiguous()
        dt_dtype = m.in_proj.weight.dtype
        self.dt_buf = None if self.tied and not self.limit else m.in_proj.weight.new_empty(
            (batch, m.nheads) if self.tied else (batch, *hp), dtype=dt_dtype)
        self.norm = ((m.norm.weight, m.norm.bias), dict(eps=m.norm.eps, group_size=m.norm.group_size,
                                                         norm_before_gate=m.norm.norm_before_gate)) \
            if m.rmsnorm else None
        self.out_proj = Dense(m.out_proj)
        self.conv, self.scan, self.gate = Captured(), Captured(), Captured()

    def _dt(self, dt: Tensor) -> Tensor:
        """dt as the kernel reads it: (batch, nheads, headdim) (an expanded view in the tied case)."""
        batch, hp = self.dims[0], self.dims[1]
        if self.limit:  # the kernel has no clamp: softplus and dt_limit here, as Mamba2.step
            _unrecordable()
            dt = F.softplus(dt.float() + self.dt_bias_raw.float()).clamp(*self.limit).to(dt.dtype)
            if self.tied:
                dt = self.dt_buf.copy_(dt)
        if self.tied:
            return dt[:, :, None].expand(batch, *hp)
        return _copy(self.dt_buf, dt[:, :, None].expand(batch, *hp))

    def step(self, h: Tensor, out: Optional[Tensor] = None) -> Tensor:
        batch, hp, g, n, d_ssm = self.dims
        z0, x0, z, xbc, dt = self.in_proj(h)
        x, B, C = self.xbc(self.conv.run(causal_conv1d_update, xbc, *self.conv_args))
        y = self.scan.run(selective_state_update, self.ssm_state, x.view(batch, *hp), self._dt(dt), self.A,
                          B.view(batch, g, n), C.view(batch, g, n), self.D,
                          z=None if self.norm else z.view(batch, *hp), dt_bias=self.dt_bias,
                          dt_softplus=self.limit is None)
        y = y.view(batch, d_ssm)
        if self.norm is not None:
            y = self.gate.run(rmsnorm_fn, y, *self.norm[0], z=z, **self.norm[1])
        if self.d_mlp > 0:
            _unrecordable()
            y = torch.cat([F.silu(z0) * x0, y], dim=-1)
        return self.out_proj(y, out)


def _add_norm_args(norm, **flags) -> tuple:
    """(weight, bias, keywords) of layer_norm_fn for a Block's RMSNorm / torch LayerNorm ``norm``."""
    return norm.weight, norm.bias, dict(eps=norm.eps, is_rms_norm=isinstance(norm, RMSNorm), **flags)


class LMStep:
    """One decode step of a MambaLMHeadModel whose blocks are mixer-only with fused_add_norm (upstream's
    default): embedding -> per layer, the fused residual add + norm kernel and the mixer's plan -> final add +
    norm -> lm_head. ids: (batch, 1) -> logits (batch, 1, vocab) (a new tensor; everything else is reused).
    cache: InferenceParams.key_value_memory_dict, {layer_idx: (conv_state, ssm_state)}."""

    def __init__(self, model, cache: dict, batch: int):
        bb = model.backbone
        self.embedding = bb.embedding.weight
        self.h0 = self.embedding.new_empty((batch, self.embedding.shape[1]))
        self.layers = []
        for layer in bb.layers:
            conv_state, ssm_state = cache[layer.mixer.layer_idx]
            norm = _add_norm_args(layer.norm, prenorm=True, residual_in_fp32=layer.residual_in_fp32)
            self.layers.append((Captured(), norm, layer.mixer.decode_plan(conv_state, ssm_state, batch),
                                torch.empty_like(self.h0)))
        self.final = (Captured(), _add_norm_args(bb.norm_f, prenorm=False, residual_in_fp32=bb.residual_in_fp32))
        self.lm_head = Dense(model.lm_head)
        self.program: Optional[list] = None  # the step's Tape once a step recorded whole (the second, usually)

    def step(self, ids: Tensor) -> Tensor:
        torch.index_select(self.embedding, 0, ids.reshape(-1), out=self.h0)
        if self.program is not None:
            for action in self.program:
                action()
            return self.logits.clone().unsqueeze(1)
        tape = _recording.tape = Tape()
        try:
            logits = self._layers()
        finally:
            _recording.tape = None
        if not self.lm_head.op:  # F.linear's new tensor: the caller's own
            return logits.unsqueeze(1)
        if tape.ok:
            self.program, self.logits = tape.actions, logits
        return logits.clone().unsqueeze(1)

    def _layers(self) -> Tensor:
        """Every layer and the LM head on the embedded ids (h0) -> the LM head's logits (batch, vocab): the
        same tensor every step where the head's launch replays."""
        h, residual = self.h0, None
        for add_norm, (weight, bias, kw), mixer, out in self.layers:
            h, residual = add_norm.run(layer_norm_fn, h, weight, bias, residual=residual, **kw)
            h = mixer.step(h, out)
        final, (weight, bias, kw) = self.final
        h = final.run(layer_norm_fn, h, weight, bias, residual=residual, **kw)
        return self.lm_head.reused(h)


def lm_plan(model, input_ids: Tensor, inference_params) -> Optional[LMStep]:
    """The model's decode plan for this step, or None where it does not apply (then the blocks' path runs):
    blocks with an MLP or without fused_add_norm, a mixer without a decode plan (Mamba3), a (batch, seqlen > 1)
    input, a layer without a cache entry yet, autograd or tracing (:func:`eager`), untrackable parameters."""
    bb = model.backbone
    if input_ids.dim() != 2 or input_ids.shape[1] != 1 or not bb.fused_add_norm or \
            any(layer.mlp is not None or not hasattr(layer.mixer, "decode_plan") for layer in bb.layers) or \
            bb.embedding.max_norm is not None:
        return None
    if not eager(input_ids, model):
        return None
    cache = inference_params.key_value_memory_dict
    entries = [cache.get(layer.mixer.layer_idx) for layer in bb.layers]
    if any(e is None for e in entries):
        return None
    batch = input_ids.shape[0]

    def build():
        for layer, (conv_state, ssm_state) in zip(bb.layers, entries):
            layer.mixer._check_states(conv_state, ssm_state, batch, input_ids.device)
        return LMStep(model, cache, batch)
    states = (id(cache),) + tuple((id(e), e[0].data_ptr(), e[1].data_ptr()) for e in entries)
    return cached(model, input_ids, states, build)


def block_plan(m, hidden_states: Tensor, conv_state: Tensor, ssm_state: Tensor):
    """Mamba / Mamba2 ``m``'s decode plan (``m.decode_plan``) for this step's (checked) hidden_states
    (batch, 1, d_model) and states, or None where it does not apply (:func:`eager`, untrackable parameters).
    The states are checked (``m._check_states``) when a plan is built for them."""
    if not eager(hidden_states, m):
        return None
    batch = hidden_states.shape[0]

    def build():
        m._check_states(conv_state, ssm_state, batch, hidden_states.device)
        return m.decode_plan(conv_state, ssm_state, batch)
    return cached(m, hidden_states, (tensor_stamp(conv_state), tensor_stamp(ssm_state)), build)


def planned_step(m, hidden_states: Tensor, conv_state: Tensor, ssm_state: Tensor):
    """The opening Mamba.step and Mamba2.step share: hidden_states checked ((batch, 1, d_model)); the step's
    result (out, conv_state, ssm_state) from the cached plan where one applies (no autograd / tracing: same
    ops and bits), else None, once the states are checked for the step's own eager path."""
    check_hidden("hidden_states", hidden_states, m.d_model, seqlen_one=True)
    plan = block_plan(m, hidden_states, conv_state, ssm_state)
    if plan is not None:
        return plan.step(hidden_states.squeeze(1)).unsqueeze(1), conv_state, ssm_state
    m._check_states(conv_state, ssm_state, hidden_states.shape[0], hidden_states.device)
    return None
