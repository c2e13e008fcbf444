"""A prepared launch as straight-line Python: the recipe of torch_ops/_fastpath.py and the check of its
signature, each compiled to one function.

A recipe says, per launch argument, where it comes from (an input, a view inside one, a fresh output or a
view of it, a cached placeholder, a compact copy). Interpreting that list costs a decode step's call
~8 us for its ten arguments (a loop, a tuple unpack and a branch per argument, a helper call per view);
the same steps written out as one function, with the sources' constants bound as globals, cost the
allocations and views alone. The generated code is what :func:`_fastpath._build` does, argument by
argument; anything but the common kinds ("copy") calls ``_build`` itself.

Views of inputs are remembered per site as one tuple (the input's address, the view, the view's address)
and reused while a call's input has that address: parameters (A, D, dt_bias, a conv weight) come back
call after call at the same address, often as fresh expanded views of themselves, and rebuilding their
views costs ~1.5 us apiece. The address alone decides because the guard has checked the input's dtype,
shape and strides, so the view's geometry is the recipe's either way, and because the kept view keeps its
storage alive: no other allocation can take that address meanwhile, so an input there is that memory (a
view of the same storage, or foreign memory over it). The view's own address is checked too: a storage
resized in place since has moved it. The tuple is replaced whole, so a thread reads the old or the new one.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from ..runtime import dispatch
from . import _dlpack

try:  # dynamo's check of a compiled frame's tensors, in C++; absent or changed: every call computes its signature
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:  # pragma: no cover - torch builds without dynamo
    _TensorGuards = None


class _Writer:
    """Source lines and the globals they name (constants of the recipe bound once)."""

    def __init__(self, build: Callable, shapes: dict):
        self.shapes = shapes  # output k -> the (size, stride) it is allocated with, where one view covers it
        self.lines: list[str] = []
        self.env: dict = {"_empty": torch.empty, "_empty_like": torch.empty_like, "_note": dispatch.note_key,
                          "_recording": _dlpack.recording, "_Launch": _dlpack.Launch, "_build": build}
        self.needs_fresh = self.needs_made = False

    def const(self, value, stem: str) -> str:
        name = f"{stem}{len(self.env)}"
        self.env[name] = value
        return name

    def arg(self, src, target: str) -> None:
        """``target = <the tensor src names>``."""
        kind = src[0]
        if kind == "id":
            self.lines.append(f"    {target} = i{src[1]}")
        elif kind == "const":
            self.lines.append(f"    {target} = {self.const(src[1], 'C')}")
        elif kind == "new":
            self.lines.append(f"    {target} = f{src[1]}" + (".view(-1)" if src[1] in self.shapes else ""))
        elif kind == "out":
            _, k, size, stride, offset = src
            same = offset == 0 and self.shapes.get(k) == (size, stride)
            self.lines.append(f"    {target} = f{k}" if same else
                              f"    {target} = f{k}.as_strided({size!r}, {stride!r}, {offset})")
        elif kind == "in":
            _, j, size, stride, delta = src
            memo = self.const([None], "M")
            offset = "" if delta == 0 else f", i{j}.storage_offset() + {delta}"
            self.lines += [f"    m = {memo}[0]",
                           f"    if m is not None and m[0] == i{j}.data_ptr() and m[1].data_ptr() == m[2]:",
                           f"        {target} = m[1]",
                           "    else:",
                           f"        {target} = i{j}.as_strided({size!r}, {stride!r}{offset})",
                           f"        {memo}[0] = (i{j}.data_ptr(), {target}, {target}.data_ptr())"]
        else:  # a compact copy of an input (made once per call, shared by the launches reading it)
            self.needs_fresh = self.needs_made = True
            self.lines.append(f"    {target} = _build({self.const(src, 'S')}, inputs, fresh, made)")


def _covering(src, numel: int) -> bool:
    """An "out" view at offset 0 with torch's contiguous strides over the whole output (size-1 dimensions
    included, so the tensor ``torch.empty(size)`` gives is that view exactly)."""
    if src[0] != "out" or src[4] != 0 or torch.Size(src[2]).numel() != numel:
        return False
    expected = 1
    for size, stride in reversed(list(zip(src[2], src[3]))):
        if stride != expected:
            return False
        expected *= size
    return True


def _shapes(launches, outputs, specs) -> dict:
    """Output k -> (size, stride) of the first view covering it, results first (returned as allocated, no view
    made; the kernel's view of the same memory is then the one ``as_strided``)."""
    shapes: dict = {}
    for src in list(specs) + [s for _, sources in launches for s in sources]:
        if src[0] == "out" and src[1] not in shapes and _covering(src, outputs[src[1]][0]):
            shapes[src[1]] = (src[2], src[3])
    return shapes


def _contiguous_strides(size) -> tuple:
    strides, step = [], 1
    for n in reversed(size):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _like(inputs, size, dtype, device) -> Optional[int]:
    """An input of exactly the geometry ``torch.empty(size)`` gives (the guard holds it to that geometry every
    call), whose ``empty_like`` allocates the output for less than ``empty``'s argument parsing (a decode step's
    out is x's twin); None if there is none."""
    want = (tuple(size), _contiguous_strides(size), dtype, device)
    return next((j for j, geometry in enumerate(inputs) if geometry == want), None)


def compile_recipe(launches, outputs, result, inputs, build: Callable) -> Callable:
    """``run(inputs) -> result``: allocate ``outputs`` ((numel, dtype, device) each), run ``launches``
    ((kernel, sources) each) with arguments built from the call's tensors (by position; ``inputs``: their
    (shape, strides, dtype, device) or None, as every call of the signature has them) and the fresh outputs,
    note each kernel's key (explain) and record each launch when a ``capture_launches`` block is open, and
    return what ``result`` (a source, or a tuple of sources) names."""
    multi = isinstance(result, tuple) and bool(result) and isinstance(result[0], tuple)
    specs = result if multi else (result,)
    w = _Writer(build, _shapes(launches, outputs, specs))
    for n, (kernel, sources) in enumerate(launches):
        names = [f"a{n}_{p}" for p in range(len(sources))]
        for src, name in zip(sources, names):
            w.arg(src, name)
        k = w.const(kernel, "K")
        call = ", ".join(names) + ("," if len(names) == 1 else "")
        if kernel.simulated:  # the CUDA checker's launch goes through the kernel object
            w.lines.append(f"    {k}({call})")
        else:
            w.lines += [f"    _note({w.const(kernel.key, 'Y')}, {w.const(kernel.plan, 'P')})",
                        f"    {w.const(kernel.fn, 'F')}({call})"]
        w.lines += ["    if rec is not None:", f"        rec.append(_Launch({k}, ({call})))"]
    for r, spec in enumerate(specs):
        w.arg(spec, f"r{r}")
    returned = ", ".join(f"r{r}" for r in range(len(specs)))
    head = ["def run(inputs):", f"    {''.join(f'i{j}, ' for j in range(len(inputs)))}= inputs"]
    for k, (numel, dtype, device) in enumerate(outputs):
        size = w.shapes.get(k, ((numel,),))[0]
        j = _like(inputs, size, dtype, device)
        head.append(f"    f{k} = _empty({size!r}, dtype={w.const(dtype, 'D')}, device={w.const(device, 'V')})"
                    if j is None else f"    f{k} = _empty_like(i{j})")
    if w.needs_fresh:
        head.append(f"    fresh = [{', '.join(f'f{k}' for k in range(len(outputs)))}]")
    if w.needs_made:
        head.append("    made = {}")
    head.append("    rec = _recording()")
    tail = [f"    return ({returned},)" if multi else f"    return {returned}"]
    source = "\n".join(head + w.lines + tail) + "\n"
    exec(compile(source, "<tvm_mamba recipe>", "exec"), w.env)  # noqa: S102 - our own straight-line code
    run = w.env["run"]
    run.source, run.body, run.env = source, head[2:] + w.lines + tail, w.env  # body: after the inputs' unpacking
    return run


MISS = object()  # what serve() returns for a call it does not stand for


def compile_serve(run: Callable, tensors, flags, context: tuple, expires: float, context_now: Callable,
                  checks: Optional[Callable], checks_first: bool) -> Optional[Callable]:
    """``serve(tensors, flags, args) -> result``, or MISS when the call is not of this recipe's signature
    (torch_ops/_fastpath.signature) or the recipe no longer serves: the guard, the recipe's context and expiry,
    the value checks and ``run``'s body, one function (a decode call's Python, run after a kernel that
    streamed megabytes of state, costs per distinct function it enters as much as per line).

    The guard is torch's C++ tensor check (``TensorGuards``: what dynamo checks before it reuses a compiled
    frame — Python type, dispatch keys, where functorch wrappers and inference tensors differ, dtype, device,
    requires_grad, sizes, strides) over the tensors present, plus the positions of the Nones, each address
    modulo 64, the flags and, when a tensor requires grad, grad mode off; an argument it cannot read is a
    MISS (the full path names it). ``checks(*args)`` runs before the launches when ``checks_first``, else only
    after a kernel raised ValueError (kernels that check the values themselves: the checks then name the
    value). None without TensorGuards (or with a torch whose guard API changed): the signature path then
    serves alone."""
    present = [i for i, t in enumerate(tensors) if t is not None]
    if _TensorGuards is None or not present:
        return None
    ts = [tensors[i] for i in present]
    try:
        check = _TensorGuards(*ts, dynamic_dims_sizes=[list(t.shape) for t in ts],
                              dynamic_dims_strides=[list(t.stride()) for t in ts]).check
    except Exception:  # noqa: BLE001 - see above
        return None
    env = dict(run.env, _check=check, _flags=flags, _grad=torch.is_grad_enabled, _MISS=MISS, _context=context_now,
               _ctx=context, _expires=expires, _monotonic=time.monotonic, _checks=checks)
    absent = "".join(f" or i{i} is not None" for i, t in enumerate(tensors) if t is None)
    grad = " or _grad()" if any(t.requires_grad for t in ts) else ""
    zero = [i for i in present if tensors[i].data_ptr() & 63 == 0]  # the usual case: one test for all of them
    aligned = (f" and ({' | '.join(f'i{i}.data_ptr()' for i in zero)}) & 63 == 0" if zero else "") + "".join(
        f" and i{i}.data_ptr() & 63 == {tensors[i].data_ptr() & 63}" for i in present if i not in zero)
    checked = f"_check({', '.join(f'i{i}' for i in present)}){aligned}"
    lines = ["def serve(inputs, flags, args):", "    try:",
             f"        {''.join(f'i{j}, ' for j in range(len(tensors)))}= inputs",
             f"        if flags != _flags{absent}{grad} or not ({checked}):",
             "            return _MISS", "    except Exception:", "        return _MISS",
             "    if _monotonic() >= _expires or _context() != _ctx:", "        return _MISS"]
    if checks is None:
        lines += run.body
    elif checks_first:
        lines += ["    _checks(*args)"] + run.body
    else:
        lines += ["    try:"] + ["    " + line for line in run.body] + \
            ["    except ValueError:  # a kernel refused a value (nothing written): the checks name it",
             "        _checks(*args)", "        raise"]
    source = "\n".join(lines) + "\n"
    exec(compile(source, "<tvm_mamba serve>", "exec"), env)  # noqa: S102 - our own straight-line code
    serve = env["serve"]
    serve.source = source
    return serve
