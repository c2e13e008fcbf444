"""Hand schedules, ``tvm_mamba.schedules`` through the package's ``schedules`` link: ``rule.py`` (the contract),
``cpu/<op>.py`` and ``cuda/<op>.py`` (one module per op, each exposing ``lay_out(kernel, dims, target, decisions)``,
listed in the folder's ``RULES`` table, which runtime/registry.py reads)."""

import tvm_mamba.compute  # noqa: E402,F401 - installs compute/_tvmscript.py before any schedule parses TVMScript
