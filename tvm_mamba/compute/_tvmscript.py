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

Every ``@T.macro`` expansion (dozens per kernel) and every ``T.prim_func`` re-reads its function's source
lines (``inspect.getblock`` tokenizes the file from the definition on) and converts Python's AST of it into
TVMScript's doc AST, node by node; the same template functions are parsed for every kernel. Both are pure
functions of the source: the lines are kept per code object (a closure re-made per call shares one), the doc
AST per source text and thread. TVM's parser changes a parsed tree in two places only, each time to the same
value (an ``AugAssign`` target's ``ctx`` set to ``Load`` while its value is read and back to ``Store``; a
slice without a step given ``Constant(1)``), so a tree parsed before gives the same IR; the flip makes one tree
unsafe to share between threads that parse at once, hence a tree per thread.

``install()`` runs when ``tvm_mamba.compute`` and ``tvm_mamba.schedules`` (the layers that write TVMScript)
are imported.
"""
from __future__ import annotations

import inspect
import sys
import threading


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


_trees = threading.local()  # .by_source: {source text: doc AST}
_lines: dict = {}  # {code object: (lines, first line number)}


def _as_ast(self):
    """``Source.as_ast``: ``doc.parse(self.source)``, parsed once per source text and thread."""
    cache = getattr(_trees, "by_source", None)
    if cache is None:
        cache = _trees.by_source = {}
    tree = cache.get(self.source)
    if tree is None:
        from tvm.script.parser.core import doc

        tree = cache[self.source] = doc.parse(self.source)
    return tree


def _getsourcelines(getsourcelines):
    """TVM's ``diagnostics.getsourcelines``, its answer for a function kept per code object."""

    def cached(obj):
        code = getattr(inspect.unwrap(obj), "__code__", None)
        if code is None:  # a class (an @I.ir_module): read as TVM does
            return getsourcelines(obj)
        found = _lines.get(code)
        if found is None:
            found = _lines[code] = getsourcelines(obj)
        return list(found[0]), found[1]

    cached.tvm_mamba_cached, cached.original = True, getsourcelines
    return cached


class _Inspect:
    """The ``inspect`` module, but with the lazy ``stack``."""

    stack = staticmethod(_stack)

    def __getattr__(self, name):
        return getattr(inspect, name)


def install() -> None:
    """Replace ``ScriptMacro._find_parser_def``, ``T.prim_func``'s ``inspect``, ``Source.as_ast`` and
    ``diagnostics.getsourcelines`` (idempotent). Nothing on a
    runtime-only TVM (``TVM_USE_RUNTIME_LIB=1``, the GPU machine's bundle), whose TVMScript does not import
    and where nothing is parsed: importing it there would fail and leave half its modules behind."""
    import tvm.base

    if getattr(tvm.base, "_RUNTIME_ONLY", False):
        return
    from tvm.script.parser.core import diagnostics, parser
    from tvm.tirx.script.parser import entry

    global _PARSER_NAME
    if hasattr(parser.ScriptMacro, "_find_parser_def"):
        _PARSER_NAME = parser.ScriptMacro.parser_object_name
        parser.ScriptMacro._find_parser_def = _find_parser_def
    if getattr(entry, "inspect", None) is inspect:
        entry.inspect = _Inspect()
    if hasattr(diagnostics.Source, "as_ast"):
        diagnostics.Source.as_ast = _as_ast
    if not getattr(diagnostics.getsourcelines, "tvm_mamba_cached", False):
        diagnostics.getsourcelines = _getsourcelines(diagnostics.getsourcelines)
