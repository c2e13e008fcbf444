"""Every option of every ``python -m tvm_mamba`` subcommand has help text (walked from the parser, so an option
added later without help fails here), ``--ops`` help lists the valid op names, and a bad ``--ops`` / ``--arch``
(below sm_80) is a one-line usage error (exit 2) on every command that takes it (issue #41, items 8 and 9)."""
from __future__ import annotations

import argparse

import pytest

from tvm_mamba import cli


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_every_subcommand_and_option_has_help():
    parser = cli.build_parser()
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    described = {choice.dest for choice in action._choices_actions if (choice.help or "").strip()}
    assert described == set(action.choices), f"subcommands without help: {set(action.choices) - described}"
    missing = [f"{name} {opt.option_strings[-1]}" for name, sub in _subcommands().items() for opt in sub._actions
               if not (opt.help or "").strip() or opt.help == argparse.SUPPRESS]
    assert not missing, f"options without help text: {missing}"
    for name, sub in _subcommands().items():
        sub.format_help()  # every help string formats (a stray % would raise here)


def test_ops_help_lists_the_valid_op_names():
    from tvm_mamba.runtime.rules import compute_ops

    with_ops = {name: sub for name, sub in _subcommands().items()
                if any("--ops" in a.option_strings for a in sub._actions)}
    assert set(with_ops) == {"build-check", "sim-check", "roofline", "tune", "aot"}
    for name, sub in with_ops.items():
        text = " ".join(sub.format_help().split())  # argparse wraps lines
        assert "valid: " + ", ".join(compute_ops()) in text, (name, text)


REQUIRED = {"aot": ["--out", "unused-pack-dir"]}  # never written: the usage error comes first


@pytest.mark.parametrize("cmd", ["build-check", "sim-check", "roofline", "tune", "aot"])
def test_bad_ops_and_old_arch_are_usage_errors(cmd, capsys):
    assert cli.main([cmd, "--ops", "ssd,no_such_op", *REQUIRED.get(cmd, [])]) == 2
    err = capsys.readouterr().err
    assert f"{cmd}: unknown op no_such_op; valid: causal_conv1d," in err and err.count("\n") == 1
    for arch in ("sm_75", "sm_70", "compute_90"):
        assert cli.main([cmd, "--arch", arch, *REQUIRED.get(cmd, [])]) == 2
        err = capsys.readouterr().err
        assert f"{cmd}: unsupported --arch {arch!r}; the minimum is sm_80" in err and err.count("\n") == 1
    assert cli._checked_arch("sm_80", cmd) == "sm_80"


def test_simulate_cuda_refuses_arches_below_sm_80():
    import tvm_mamba
    from tvm_mamba.runtime.cudasim import SimConfig

    for arch in ("sm_70", "sm_75", "sm_61"):
        with pytest.raises(ValueError, match=rf"arch: '{arch}' is below the minimum sm_80"):
            with tvm_mamba.simulate_cuda(arch):
                pass  # pragma: no cover - the context manager refuses on entry
    assert SimConfig("sm_80").target_key == "cudasim-sm_80" and SimConfig("sm_100").arch == "sm_100"
