"""tvm_mamba.compute._tvmscript: TVMScript parsing without per-frame source reads gives the same IR as TVM's
own frame lookup, for macros, prim_funcs in an ``@I.ir_module`` class and PEP 563 closure annotations."""
from __future__ import annotations

import inspect

import pytest
import tvm
from tvm.script import ir as I
from tvm.script import tirx as T

from tvm_mamba.compute import _tvmscript


def _scaled_copy(n: int, scale: float):
    @T.macro
    def body(a, b, i):
        b[i] = a[i] * T.float32(scale)

    @T.prim_func
    def f(a: T.Buffer((n,), "float32"), b: T.Buffer((n,), "float32")):
        for i in range(n):
            body(a, b, i)

    return f


def test_macros_and_prim_funcs_read_one_frames_source_at_most(monkeypatch):
    """TVM reads the stack's third record's source line (``@I.ir_module`` class?); nothing else."""
    def refuse(*args, **kwargs):
        raise AssertionError("frame records for the whole stack were built")

    read = []
    getframeinfo = inspect.getframeinfo
    monkeypatch.setattr(inspect, "getouterframes", refuse)
    monkeypatch.setattr(inspect, "stack", refuse)
    monkeypatch.setattr(inspect, "getframeinfo", lambda *a, **k: read.append(a) or getframeinfo(*a, **k))
    func = _scaled_copy(8, 2.0)
    assert len(read) == 1
    text = func.script()
    assert "T.float32(2.0)" in text and "b[i] = a[i]" in text


def test_same_ir_as_tvms_own_frame_lookup(monkeypatch):
    ours = _scaled_copy(5, 3.0)
    from tvm.script.parser.core import parser
    from tvm.tirx.script.parser import entry

    original = parser.ScriptMacro._find_parser_def
    assert original is _tvmscript._find_parser_def

    def tvms(self):  # TVM 0.27's lookup, as written there
        for finfo in inspect.getouterframes(inspect.currentframe()):
            found = finfo.frame.f_globals.get(parser.ScriptMacro.parser_object_name)
            if found is not None:
                return found
        raise RuntimeError("no parser")

    monkeypatch.setattr(parser.ScriptMacro, "_find_parser_def", tvms)
    monkeypatch.setattr(entry, "inspect", inspect)
    theirs = _scaled_copy(5, 3.0)
    tvm.ir.assert_structural_equal(ours, theirs)


def test_a_prim_func_inside_an_ir_module_class_is_left_to_the_class():
    @I.ir_module
    class Module:
        @T.prim_func
        def add_one(a: T.Buffer((4,), "float32"), b: T.Buffer((4,), "float32")):
            for i in range(4):
                b[i] = a[i] + T.float32(1)

    assert [gv.name_hint for gv in Module.get_global_vars()] == ["add_one"]


def test_annotation_only_closure_names_resolve():
    """With ``from __future__ import annotations`` (this file), ``width`` appears only in an annotation; the
    parser finds it in the enclosing frame's locals through the frame records."""
    def make():
        width = 6

        @T.prim_func
        def f(a: T.Buffer((width,), "float32")):
            a[0] = T.float32(0)

        return f

    func = make()
    assert "T.Buffer((6,)" in func.script()


def test_install_is_idempotent():
    _tvmscript.install()
    _tvmscript.install()
    from tvm.tirx.script.parser import entry

    assert isinstance(entry.inspect, _tvmscript._Inspect)
    with pytest.raises(AttributeError):
        entry.inspect.no_such_function


def _accumulate(n: int):
    """A template with an ``AugAssign``, whose target's ``ctx`` TVM's parser flips to Load and back in the
    tree it parses."""
    @T.macro
    def add(acc, a, i):
        acc[0] += a[i]

    @T.prim_func
    def f(a: T.Buffer((n,), "float32"), b: T.Buffer((n,), "float32"), acc: T.Buffer((1,), "float32")):
        acc[0] = T.float32(0)
        for i in range(n):
            add(acc, a, i)
        for i in range(n):
            b[i] = a[i] - acc[0]

    return f


def test_cached_trees_and_lines_give_the_same_ir_as_tvms_own(monkeypatch):
    """Parsed three times from the cached tree (the parser's in-place writes are the same each time) equals
    the IR from TVM's own ``as_ast`` and ``getsourcelines``."""
    from tvm.script.parser.core import diagnostics, doc

    ours = [_accumulate(6) for _ in range(3)]
    monkeypatch.setattr(diagnostics.Source, "as_ast", lambda self: doc.parse(self.source))
    monkeypatch.setattr(diagnostics, "getsourcelines", diagnostics.getsourcelines.original)
    theirs = _accumulate(6)
    for func in ours:
        tvm.ir.assert_structural_equal(func, theirs)
    assert "acc = acc + a[i]" in theirs.script()  # the AugAssign, read and stored


def test_a_template_is_parsed_once_per_thread(monkeypatch):
    import threading

    from tvm.script.parser.core import doc

    _accumulate(7)  # the trees of this thread
    parsed = []
    parse = doc.parse
    monkeypatch.setattr(doc, "parse", lambda source, *a, **k: parsed.append(source) or parse(source, *a, **k))
    _accumulate(9)
    assert parsed == []  # another size, the same source text: no parse
    other = threading.Thread(target=_accumulate, args=(9,))
    other.start()
    other.join()
    assert len(parsed) == 2  # the other thread parses its own trees: the macro's and the prim_func's
