"""How a kernel holds its 8-bit tensors (int8 codes, uint8 dropout masks): as bytes, or as the 32-bit words of
the same bytes, for targets without 8-bit buffers (WGSL has only f32, i32 and u32: ``GpuCaps.bytes``).

The word format is :func:`~tvm_mamba.compute.int8_dot.int8_dot_pack`'s: little-endian, byte i of a word is the
element 4j + i. An 8-bit tensor of shape (..., last) is held as

- (..., last / 4) int32 words where last % 4 == 0: each row's bytes, four to a word; what the caller passes is
  ``t.view(torch.int32)`` (zero-copy, the same memory);
- else (ceil(numel / 4),) int32 words of its row-major bytes (a row starts mid-word): ``t.reshape(-1)``,
  padded to a whole word, ``.view(torch.int32)``.

A byte is read with 32-bit integer arithmetic: shifted to the top of its word and arithmetic-shifted back
(int8: sign extension in one step) or shifted down and masked (uint8). An output word is its four bytes
(each ``& 0xFF``) shifted into place and or-ed. ``BYTES`` builds exactly the expressions the kernels had
before words existed (a load and a cast), so the byte kernels' IR does not change.
"""
from __future__ import annotations

import dataclasses
import inspect
import math

from tvm import te, tirx


def _numel(shape):
    return math.prod(shape[1:], start=shape[0])


def _cast(fn, dtype: str):
    """``fn`` cast to ``dtype``, with ``fn``'s parameter names (TE names the compute's axes after them)."""

    def cast(*idx):
        return fn(*idx).astype(dtype)

    cast.__signature__ = inspect.signature(fn)
    return cast


@dataclasses.dataclass(frozen=True)
class Storage:
    """Bytes (``words=False``) or 32-bit words (``words=True``) for a kernel's 8-bit tensors."""

    words: bool = False

    def shape(self, shape: tuple) -> tuple:
        """The held shape of an 8-bit tensor of logical ``shape`` (module docstring)."""
        if not self.words:
            return tuple(shape)
        last = int(shape[-1])
        if last % 4 == 0:
            return (*shape[:-1], last // 4)
        n = _numel(shape)
        return ((n + 3) // 4 if isinstance(n, int) else tirx.indexdiv(n + 3, 4),)

    def placeholder(self, shape: tuple, dtype: str, name: str) -> te.Tensor:
        """An 8-bit input of logical ``shape`` and ``dtype`` ("int8" / "uint8"), held as bytes or words."""
        return te.placeholder(self.shape(shape), "int32" if self.words else dtype, name=name)

    def _locate(self, shape: tuple, idx: tuple):
        """(the held index of logical element ``idx``, its byte within the word)."""
        last = int(shape[-1])
        if last % 4 == 0:
            return (*idx[:-1], tirx.indexdiv(idx[-1], 4)), tirx.indexmod(idx[-1], 4)
        flat = idx[0]
        for n, i in zip(shape[1:], idx[1:]):
            flat = flat * n + i
        return (tirx.indexdiv(flat, 4),), tirx.indexmod(flat, 4)

    def read(self, buf: te.Tensor, shape: tuple, dtype: str, idx: tuple, to: str):
        """Element ``idx`` of the 8-bit tensor ``buf`` (logical ``shape``, ``dtype``) as a ``to`` value."""
        if not self.words:
            return buf[tuple(idx)].astype(to)
        at, sub = self._locate(shape, tuple(idx))
        w = buf[at]
        if dtype == "int8":
            v = (w << (24 - 8 * sub)) >> 24
        else:
            v = (w >> (8 * sub)) & 0xFF
        return v.astype(to)

    def output(self, shape: tuple, dtype: str, fn, name: str) -> te.Tensor:
        """An 8-bit output of logical ``shape``: ``fn(*idx)`` (an integer value) cast to ``dtype``, or, as
        words, the four bytes of each word packed (elements past the end are 0)."""
        if not self.words:
            return te.compute(shape, _cast(fn, dtype), name=name)
        held, last = self.shape(shape), int(shape[-1])

        def byte(*idx):
            return fn(*idx).astype("int32") & 0xFF

        if last % 4 == 0:
            def word(*i):
                acc = tirx.const(0, "int32")
                for b in range(4):
                    acc = acc | (byte(*i[:-1], i[-1] * 4 + b) << (8 * b))
                return acc
        else:
            numel = _numel(shape)

            def word(e):
                acc = tirx.const(0, "int32")
                for b in range(4):
                    f, idx = e * 4 + b, []
                    rest = f
                    for n in reversed(shape[1:]):
                        idx.insert(0, tirx.indexmod(rest, n))
                        rest = tirx.indexdiv(rest, n)
                    idx.insert(0, tirx.min(rest, shape[0] - 1))
                    acc = acc | (tirx.if_then_else(f < numel, byte(*idx), 0) << (8 * b))
                return acc

        return te.compute(held, word, name=name)


BYTES = Storage(False)
WORDS = Storage(True)


def held(bytes_ok: bool) -> Storage:
    """How a target holds 8-bit tensors: bytes where it has 8-bit buffers (``GpuCaps.bytes``), else words."""
    return BYTES if bytes_ok else WORDS
