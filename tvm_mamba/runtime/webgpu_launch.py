"""Running a WebGPU kernel file (runtime/webgpu.py) through wgpu: the host function evaluated here, each device
kernel dispatched with its storage buffers and its ``PODArgs`` uniform.

The host function after ``SplitHostDevice`` is a flat list of statements: ``Bind(var, value)``,
``DeclBuffer`` (a view: same data), ``Evaluate(call_ffi_kernel(name, *args, *launch extents))``, and
``AssertStmt``. Its expressions are integer arithmetic over the parameters' shapes and strides, evaluated by
:func:`evaluate`. A storage buffer is a tensor's span of memory (first to last element it may touch, strides
as they are: a strided state pool stays strided), uploaded before the first kernel that binds it and read
back, after the last kernel, when some kernel declared it ``read_write``. Kernels of one call run in one
command submission, in order (WebGPU orders dispatches of one pass).
"""
from __future__ import annotations

import operator
import re
import struct
import threading

import numpy as np

_device_lock = threading.Lock()
_device: list = []


def device():
    """(adapter, device) of this process (the adapter's limits requested: llvmpipe grants 16 storage buffers a
    stage where WebGPU's default is 8, and the backward kernels bind up to 14)."""
    with _device_lock:
        if not _device:
            try:
                import wgpu
            except ImportError as e:
                raise RuntimeError("webgpu: needs the wgpu package (pip install wgpu)") from e
            adapter = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
            if adapter is None:
                raise RuntimeError("webgpu: wgpu found no adapter (on a machine without a GPU, Mesa's llvmpipe: "
                                   "WGPU_BACKEND_TYPE=OpenGL)")
            wanted = ("max-storage-buffers-per-shader-stage", "max-compute-workgroup-storage-size",
                      "max-storage-buffer-binding-size", "max-buffer-size")
            limits = {k: adapter.limits[k] for k in wanted if k in adapter.limits}
            _device.append((adapter, adapter.request_device_sync(required_limits=limits)))
        return _device[0]


def adapter_info() -> dict | None:
    """The adapter's name, backend and compute limits, or None where wgpu or an adapter is missing."""
    try:
        adapter, _ = device()
    except RuntimeError:
        return None
    keys = ("max-compute-invocations-per-workgroup", "max-compute-workgroup-storage-size",
            "max-storage-buffers-per-shader-stage", "max-compute-workgroups-per-dimension")
    info = adapter.info
    return {"device": info.get("device", ""), "description": info.get("description", ""),
            "backend": info.get("backend_type", ""), "type": info.get("adapter_type", ""),
            "features": sorted(adapter.features), "limits": {k: adapter.limits[k] for k in keys}}


# ---- the host function's expressions ------------------------------------------------------------------------
def _trunc_div(a, b):
    """TIR's Div: C's division (integers truncated toward zero; floats as they are)."""
    if isinstance(a, int) and isinstance(b, int):
        q = abs(a) // abs(b)
        return -q if (a < 0) != (b < 0) else q
    return a / b


def _trunc_mod(a, b):
    """TIR's Mod: C's remainder (the sign of the dividend), not Python's floored one."""
    return a - b * _trunc_div(a, b)


_BINARY = {"Add": operator.add, "Sub": operator.sub, "Mul": operator.mul, "FloorDiv": operator.floordiv,
           "FloorMod": operator.mod, "Div": _trunc_div, "Mod": _trunc_mod, "Min": min, "Max": max,
           "EQ": operator.eq, "NE": operator.ne, "LT": operator.lt, "LE": operator.le, "GT": operator.gt,
           "GE": operator.ge, "And": lambda a, b: a and b, "Or": lambda a, b: a or b}


def evaluate(e, env: dict):
    """The value of host expression ``e`` with its variables in ``env`` (a dict by variable object)."""
    kind = type(e).__name__
    if kind in ("IntImm", "FloatImm"):
        return e.value
    if kind in ("Var", "SizeVar"):
        try:
            return env[e]
        except KeyError:
            raise RuntimeError(f"webgpu: the host function reads {e.name}, which nothing bound") from None
    if kind in _BINARY:
        return _BINARY[kind](evaluate(e.a, env), evaluate(e.b, env))
    if kind == "Not":
        return not evaluate(e.a, env)
    if kind == "Select":
        return evaluate(e.true_value if evaluate(e.condition, env) else e.false_value, env)
    if kind == "Cast":
        v = evaluate(e.value, env)
        return float(v) if "float" in str(e.ty) else int(v)
    if kind == "Call" and e.op.name == "tirx.if_then_else":
        return evaluate(e.args[1] if evaluate(e.args[0], env) else e.args[2], env)
    if kind == "StringImm":
        return e.value
    raise NotImplementedError(f"webgpu: the host function computes {kind} ({e}), which this launcher cannot")


# ---- binding the parameters --------------------------------------------------------------------------------------
_DTYPES = {"float32": np.float32, "int32": np.int32, "uint32": np.uint32}


def _array(name: str, t):
    """(``t`` as a numpy array over the same memory, None) for a torch CPU tensor or anything with
    ``__dlpack__``; for a bfloat16 torch tensor (numpy has no bfloat16) a float32 copy and the call that writes it
    back rounded."""
    if isinstance(t, np.ndarray):
        return t, None
    if not hasattr(t, "__dlpack__"):
        raise TypeError(f"{name}: expected a tensor, got {type(t).__name__}")
    dev = t.__dlpack_device__()[0] if hasattr(t, "__dlpack_device__") else 1
    if dev != 1:  # kDLCPU
        raise ValueError(f"{name}: the WebGPU path takes CPU tensors (copied to the adapter), got device type {dev}")
    if hasattr(t, "detach"):  # a torch tensor that requires grad exports only detached (same memory)
        t = t.detach()
    if str(getattr(t, "dtype", "")) == "torch.bfloat16":
        wide = t.float()
        return np.from_dlpack(wide), lambda: t.copy_(wide)
    try:
        return np.from_dlpack(t), None
    except (BufferError, TypeError, RuntimeError) as e:
        raise TypeError(f"{name}: WebGPU kernels take 32-bit buffers, got {getattr(t, 'dtype', t)}") from e


def _converted(name: str, a: np.ndarray, want):
    """(``a`` as the buffer a kernel taking ``want`` reads, its write-back or None): itself; an int64 / float16
    array as an int32 / float32 copy (WGSL has neither type; an index beyond int32 refused); an 8-bit array as
    the int32 words of its bytes (int8 codes, uint8 masks: compute/int8_dot/codes.py's WORDS), a zero-copy
    view where its rows are whole words, else its flat bytes padded to whole words."""
    if a.dtype == want:
        return a, None
    if (a.dtype, want) in ((np.int64, np.int32), (np.float16, np.float32)):
        if a.dtype == np.int64 and a.size and (a.min() < np.iinfo(np.int32).min or a.max() > np.iinfo(np.int32).max):
            raise ValueError(f"{name}: int64 values beyond int32's range (WebGPU has no 64-bit integers)")
        copy = a.astype(want)
        return copy, lambda: np.copyto(a, copy, casting="unsafe")
    if a.dtype in (np.int8, np.uint8) and want == np.int32:
        if a.ndim and a.flags.c_contiguous and a.shape[-1] % 4 == 0:
            return a.view(np.int32), None
        raw = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        words = np.zeros((raw.size + 3) // 4, np.int32)
        words.view(np.uint8)[:raw.size] = raw
        return words, lambda: np.copyto(a, words.view(np.uint8)[:raw.size].view(a.dtype).reshape(a.shape))
    raise TypeError(f"{name}: expected {np.dtype(want).name}, got {a.dtype}")


def _is_var(expr) -> bool:
    return type(expr).__name__ in ("Var", "SizeVar")


def bind_params(func, args, env: dict, originals: dict | None = None) -> dict:
    """Bind ``func``'s buffer parameters to the tensors ``args`` (torch CPU tensors or numpy arrays): shape and
    stride variables into ``env`` (every variable first, then every extent checked: a flat word buffer's
    extent is an expression of other parameters' dims); returns {buffer parameter: array}. A tensor bound
    converted (:func:`_array`, :func:`_converted`) leaves its write-back in ``originals``."""
    if len(args) != len(func.params):
        raise TypeError(f"webgpu: {len(func.params)} arguments expected, got {len(args)}")
    data, extents = {}, []
    for p, t in zip(func.params, args):
        want = _DTYPES.get(str(p.dtype))
        if want is None:
            raise TypeError(f"{p.name}: WebGPU kernels take float32 / int32 buffers, this one is {p.dtype}")
        a, back_t = _array(p.name, t)
        a, back_a = _converted(p.name, a, want)
        if originals is not None and (back_t or back_a):
            originals[p] = [f for f in (back_a, back_t) if f]  # in this order: the array, then the tensor
        if len(p.shape) != a.ndim:
            raise ValueError(f"{p.name}: expected {len(p.shape)} dimensions, got shape {a.shape}")
        strides = [st // a.itemsize for st in a.strides]
        extents += [(expr, a.shape[d], f"{p.name}.shape[{d}]", True) for d, expr in enumerate(p.shape)]
        if len(p.strides):  # a size-1 axis's stride binds a variable but is never checked (never stepped)
            extents += [(expr, strides[d], f"{p.name}.stride({d})", a.shape[d] != 1) for d, expr in enumerate(p.strides)]
        elif not (a.flags.c_contiguous or a.size <= 1):
            raise ValueError(f"{p.name}: expected a contiguous tensor, got strides {tuple(strides)}")
        data[p] = a
    for expr, value, _, _ in extents:
        if _is_var(expr) and expr not in env:
            env[expr] = value
    for expr, value, what, checked in extents:
        if checked and evaluate(expr, env) != value:
            raise ValueError(f"{what}: expected {evaluate(expr, env)}, got {value}")
    return data


def span(a: np.ndarray) -> np.ndarray:
    """A 1-D view of the memory ``a`` may touch, first element to last (gaps of a strided array included)."""
    if a.size == 0:
        return np.empty(0, a.dtype)
    if any(st < 0 for st in a.strides):
        raise ValueError(f"webgpu: negative strides {a.strides}")
    n = 1 + sum((s - 1) * st for s, st in zip(a.shape, a.strides)) // a.itemsize
    return np.lib.stride_tricks.as_strided(a, shape=(n,), strides=(a.itemsize,))


# ---- the kernels ---------------------------------------------------------------------------------------------
_WGSL_NAME = re.compile(r"[^A-Za-z0-9_]")  # what TVM's WGSL codegen writes as "_" in a name
_BINDING = re.compile(r"@group\(0\) @binding\((\d+)\) var<storage, (read|read_write)> (\w+)")
_POD = re.compile(r"struct PODArgs \{([^}]*)\}", re.S)
_POD_FORMAT = {"i32": "i", "u32": "I", "f32": "f"}


class _Kernel:
    """One device kernel: its pipeline, its storage bindings (index, mode, parameter) and its uniform's fields."""

    def __init__(self, name: str, spec: dict, dev):
        self.name, self.wgsl = name, spec["wgsl"]
        self.params = [n for n, _ in spec["params"]]
        self.launch = spec["launch"]
        self.bindings = [(int(i), mode, var) for i, mode, var in _BINDING.findall(self.wgsl)]
        pod = _POD.search(self.wgsl)
        self.fields = [tuple(f.strip().split(":")) for f in pod.group(1).split(",") if f.strip()] if pod else []
        self.fields = [(n.strip(), ty.strip()) for n, ty in self.fields]
        self.pod_binding = int(re.search(r"@binding\((\d+)\) var<uniform> podArgs", self.wgsl).group(1)) \
            if pod else None
        self.workgroup = tuple(int(v) for v in re.search(r"@workgroup_size\((\d+), (\d+), (\d+)\)",
                                                         self.wgsl).groups())
        module = dev.create_shader_module(code=self.wgsl, label=name)
        self.pipeline = dev.create_compute_pipeline(layout="auto", compute={"module": module, "entry_point": name})

    def grid(self, extents: list[int], limit: int) -> tuple[tuple[int, int, int], int]:
        """Workgroups to dispatch and ``packGridDimX``: blockIdx.x beyond the adapter's per-dimension limit is
        folded into z (the shader reads blockIdx.z * gridDim.x + blockIdx.x and returns past packGridDimX)."""
        g = {"x": 1, "y": 1, "z": 1}
        threads = {"x": 1, "y": 1, "z": 1}
        for tag, n in zip(self.launch, extents):
            axis = tag.rsplit(".", 1)[1]
            (g if tag.startswith("blockIdx") else threads)[axis] = int(n)
            if not tag.startswith(("blockIdx", "threadIdx")):
                raise NotImplementedError(f"webgpu: {self.name}: launch parameter {tag} (dynamic shared memory?) "
                                          "has no WebGPU equivalent")
        if (threads["x"], threads["y"], threads["z"]) != self.workgroup:
            raise RuntimeError(f"webgpu: {self.name}: the host launches {threads}, the shader declares "
                               f"{self.workgroup}")
        if g["x"] > limit:
            if g["z"] != 1:
                raise RuntimeError(f"webgpu: {self.name}: {g['x']} workgroups on x with blockIdx.z in use")
            g["z"] = -(-g["x"] // limit)
            return (-(-g["x"] // g["z"]), g["y"], g["z"]), g["x"] - 1
        return (g["x"], g["y"], g["z"]), g["x"] - 1

    def uniform(self, scalars: dict, pack_x: int) -> bytes:
        values = [pack_x if n == "packGridDimX" else scalars[n] for n, _ in self.fields]
        raw = struct.pack("<" + "".join(_POD_FORMAT[ty] for _, ty in self.fields), *values)
        return raw + bytes(-len(raw) % 16 or (16 if not raw else 0))


class Launcher:
    """``launcher(*tensors)``: the host function run on CPU tensors (torch or numpy; its parameters in order)."""

    def __init__(self, host, kernels: dict):
        self.host, self.specs = host, kernels
        self._kernels: dict[str, _Kernel] = {}
        self._lock = threading.Lock()
        self.ran: list[str] = []  # the entry points the last call dispatched (explain)

    def kernel(self, name: str, dev) -> _Kernel:
        with self._lock:
            if name not in self._kernels:
                self._kernels[name] = _Kernel(name, self.specs[name], dev)
            return self._kernels[name]

    def __call__(self, *args):
        env: dict = {}
        originals: dict = {}
        data = bind_params(self.host, args, env, originals)
        roots = {p: p for p in data}  # buffer variable -> the parameter whose memory it is
        launches = []
        for stmt in _statements(self.host.body):
            kind = type(stmt).__name__
            if kind == "Bind":
                env[stmt.var] = evaluate(stmt.value, env)
            elif kind == "AssertStmt":
                if not evaluate(stmt.condition, env):
                    raise ValueError(f"webgpu: {evaluate(stmt.message, env)}")
            elif kind == "DeclBuffer":  # a view: the same memory as the buffer its data comes from
                roots[stmt.buffer] = roots[_data_of(stmt.data)]
            elif kind == "Evaluate" and type(stmt.value).__name__ == "Call" \
                    and stmt.value.op.name == "tirx.call_ffi_kernel":
                launches.append(self._launch_args(stmt.value, env, roots))
            elif not (kind == "Evaluate" and type(stmt.value).__name__ == "IntImm"):
                raise NotImplementedError(f"webgpu: the host function holds a {kind}, which this launcher cannot run")
        written = self._run(launches, data)
        for p in written & originals.keys():  # a converted copy a kernel wrote: back into its tensor, converted
            for back in originals[p]:
                back()

    def _launch_args(self, call, env: dict, roots: dict):
        """(kernel name, {pointer param: buffer parameter}, {scalar param: value}, launch extents); parameters
        by their WGSL names (a TE output ``out.v0`` binds as ``out_v0_ptr``)."""
        name, rest = call.args[0].value, list(call.args[1:])
        params = self.specs[name]["params"]
        pointers, scalars = {}, {}
        for (pname, kind), a in zip(params, rest[:len(params)]):
            if kind == "ptr":
                pointers[_WGSL_NAME.sub("_", pname)] = roots[_data_of(a)]
            else:
                scalars[_WGSL_NAME.sub("_", pname)] = evaluate(a, env)
        return name, pointers, scalars, [evaluate(a, env) for a in rest[len(params):]]

    def _run(self, launches, data: dict) -> set:
        """Dispatch ``launches`` in one submission; the parameters some kernel wrote, read back into ``data``."""
        import wgpu

        adapter, dev = device()
        limit = adapter.limits["max-compute-workgroups-per-dimension"]
        buffers, written, keep = {}, set(), []
        encoder = dev.create_command_encoder()
        self.ran = []
        for name, pointers, scalars, extents in launches:
            k = self.kernel(name, dev)
            groups, pack_x = k.grid(extents, limit)
            entries = []
            for index, mode, var in k.bindings:
                dvar = pointers[var]
                if dvar not in buffers:
                    buffers[dvar] = _upload(dev, wgpu, span(data[dvar]))
                if mode == "read_write":
                    written.add(dvar)
                entries.append({"binding": index, "resource": {"buffer": buffers[dvar]}})
            if k.pod_binding is not None:
                pod = dev.create_buffer_with_data(data=k.uniform(scalars, pack_x), usage=wgpu.BufferUsage.UNIFORM)
                keep.append(pod)
                entries.append({"binding": k.pod_binding, "resource": {"buffer": pod}})
            group = dev.create_bind_group(layout=k.pipeline.get_bind_group_layout(0), entries=entries)
            if min(groups) > 0:
                cpass = encoder.begin_compute_pass()
                cpass.set_pipeline(k.pipeline)
                cpass.set_bind_group(0, group)
                cpass.dispatch_workgroups(*groups)
                cpass.end()
            self.ran.append(name)
        dev.queue.submit([encoder.finish()])
        for dvar in written:
            flat = span(data[dvar])
            if flat.size:
                raw = dev.queue.read_buffer(buffers[dvar], 0, flat.nbytes)
                flat[:] = np.frombuffer(raw, dtype=flat.dtype, count=flat.size)
        return written


def _upload(dev, wgpu, flat: np.ndarray):
    """A storage buffer holding ``flat`` (at least 4 bytes: WebGPU binds no empty buffer)."""
    raw = flat.tobytes()
    raw += bytes(-len(raw) % 4 or (4 if not raw else 0))
    usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
    return dev.create_buffer_with_data(data=raw, usage=usage)


def _data_of(e):
    """The buffer variable whose data ``e`` (``tirx.buffer_data(buf)``) is."""
    if not (type(e).__name__ == "Call" and e.op.name == "tirx.buffer_data"):
        raise NotImplementedError(f"webgpu: the host function passes {e} where a buffer's data was expected")
    return e.args[0]


def _statements(body):
    """The host function's statements in order (a SeqStmt flattened; a single statement as itself)."""
    if type(body).__name__ == "SeqStmt":
        for s in body.seq:
            yield from _statements(s)
    else:
        yield body


__all__ = ["Launcher", "adapter_info", "device", "evaluate"]
