"""Hand schedules, installed as ``tvm_mamba.schedules``: ``rule.py`` (the contract), ``cpu/<op>.py`` and
``cuda/<op>.py`` (one module per op, each exposing ``apply(func, target, decisions)``)."""

from tvm_mamba.compute import _tvmscript  # noqa: E402,F401 - TVMScript macros without per-frame source reads
