"""TVMScript parsing that does not read source files for every frame of the call stack.

Two places in TVM 0.27's TVMScript parser build ``inspect`` frame records for the whole call stack and use
almost nothing of them. Each ``@T.macro`` call in TVM 0.27 finds the parser that is expanding it with
``inspect.getouterframes(inspect.currentframe())``, then keeps only ``frame.f_globals``. ``getouterframes``
also builds every frame's source context, which runs ``inspect.getmodule`` over all of ``sys.modules`` for
each frame; with torch imported (thousands of modules) that is ~0.15 s per macro call, and a kernel's
templates make dozens of them, so it was most of a kernel's build time in a torch process. The replacement
walks the same frames outermost-last through ``f_back`` and reads the same ``f_globals`` entry, so the
parser found is the same one; only the unused source context is not built.

``T.prim_func`` takes ``inspect.stack()`` (~0.1 s with torch imported, twice per kernel build) and reads each
record's ``frame``, and the third record's ``code_context`` / ``lineno`` (is the function written inside an
``@I.ir_module`` class?). Its ``inspect`` is given a ``stack`` whose records compute their source context
only when it is read.

``install()`` runs when ``tvm_mamba.compute`` and ``tvm_mamba.schedules`` (the layers that write TVMScript)
are imported.
"""
from __future__ import annotations

import inspect
import sys


_PARSER_NAME = "__current_script_parser__"  # ScriptMacro.parser_object_name, read by install()


def _find_parser_def(self):  # noqa: ARG001 - the method's signature
    """The innermost frame's script parser, as ``ScriptMacro._find_parser_def`` finds it (same frames,
    same order, starting at this function's own frame)."""
    name = _PARSER_NAME
    frame = sys._getframe(0)
    while frame is not None:
        found = frame.f_globals.get(name)
        if found is not None:
            return found
        frame = frame.f_back
    raise RuntimeError(f"{name} not available")


class _FrameRecord:
    """``inspect.FrameInfo``'s fields for one frame, the source context read on first use."""

    __slots__ = ("frame", "filename", "lineno", "function", "_info")

    def __init__(self, frame):
        self.frame, self.filename = frame, frame.f_code.co_filename
        self.lineno, self.function = frame.f_lineno, frame.f_code.co_name
        self._info = None

    def _context(self):
        if self._info is None:
            self._info = inspect.getframeinfo(self.frame, 1)
        return self._info

    code_context = property(lambda self: self._context().code_context)
    index = property(lambda self: self._context().index)
    positions = property(lambda self: self._context().positions)


def _stack(context: int = 1) -> list[_FrameRecord]:
    """``inspect.stack()``'s records (the caller's frame first), source context computed on demand."""
    records, frame = [], sys._getframe(1)
    while frame is not None:
        records.append(_FrameRecord(frame))
        frame = frame.f_back
    return records


class _Inspect:
    """The ``inspect`` module, but with the lazy ``stack``."""

    stack = staticmethod(_stack)

    def __getattr__(self, name):
        return getattr(inspect, name)


def install() -> None:
    """Replace ``ScriptMacro._find_parser_def`` and ``T.prim_func``'s ``inspect`` (idempotent). Nothing on a
    runtime-only TVM (``TVM_USE_RUNTIME_LIB=1``, the GPU machine's bundle), whose TVMScript does not import
    and where nothing is parsed: importing it there would fail and leave half its modules behind."""
    import tvm.base

    if getattr(tvm.base, "_RUNTIME_ONLY", False):
        return
    from tvm.script.parser.core import parser
    from tvm.tirx.script.parser import entry

    global _PARSER_NAME
    if hasattr(parser.ScriptMacro, "_find_parser_def"):
        _PARSER_NAME = parser.ScriptMacro.parser_object_name
        parser.ScriptMacro._find_parser_def = _find_parser_def
    if getattr(entry, "inspect", None) is inspect:
        entry.inspect = _Inspect()
