"""Hand schedules, installed as ``tvm_mamba.schedules``: ``rule.py`` (the contract), ``cpu/<op>.py`` and
``cuda/<op>.py`` (one module per op, each exposing ``apply(func, target, decisions)``)."""

import tvm_mamba.compute  # noqa: E402,F401 - installs compute/_tvmscript.py before any schedule parses TVMScript
