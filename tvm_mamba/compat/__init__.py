"""Upstream's module paths on tvm_mamba: ``mamba_ssm.*`` and ``causal_conv1d.*`` for code that imports deep names.

The packages ``tvm_mamba.compat.mamba_ssm`` and ``tvm_mamba.compat.causal_conv1d`` mirror mamba_ssm 2.3.2's and
causal-conv1d 1.7.0's layout (``mamba_ssm.ops.triton.ssd_combined``, ``causal_conv1d.causal_conv1d_interface``,
...), so an import change is enough::

    from tvm_mamba.compat.mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

and :func:`install` registers them in ``sys.modules`` under upstream's names, so unmodified code runs::

    import tvm_mamba.compat; tvm_mamba.compat.install()
    from mamba_ssm.ops.selective_scan_interface import selective_scan_fn   # tvm_mamba's kernel

``install(upstream=DIR)`` runs upstream's *own* Python modules instead (``mamba_ssm.modules``, ``.models``,
``.utils``, ``.distributed`` read from DIR, an extracted mamba_ssm sdist) with only the kernel paths
(``mamba_ssm.ops.*``, ``causal_conv1d.*``) pointing at tvm_mamba, on a machine without triton or CUDA.
"""
from __future__ import annotations

import importlib
import os
import pkgutil
import sys
import types

TOP_NAMES = ("mamba_ssm", "causal_conv1d")
# what upstream's mamba_ssm/__init__.py exports, resolved lazily in upstream mode (Mamba3 needs triton)
_UPSTREAM_TOP = {"selective_scan_fn": "mamba_ssm.ops.selective_scan_interface",
                 "mamba_inner_fn": "mamba_ssm.ops.selective_scan_interface",
                 "Mamba": "mamba_ssm.modules.mamba_simple", "Mamba2": "mamba_ssm.modules.mamba2",
                 "MambaLMHeadModel": "mamba_ssm.models.mixer_seq_simple"}
_installed: list = []


def _our_modules(top: str) -> dict:
    """{upstream name: module} for every module of tvm_mamba.compat.<top> (imported)."""
    package = importlib.import_module(f"{__name__}.{top}")
    found = {top: package}
    for info in pkgutil.walk_packages(package.__path__, prefix=f"{package.__name__}."):
        module = importlib.import_module(info.name)
        found[top + info.name[len(package.__name__):]] = module
    return found


def _upstream_package_dir(upstream) -> str:
    """upstream: the sdist root (holding mamba_ssm/) or the mamba_ssm package folder itself."""
    path = os.fspath(upstream)
    for candidate in (os.path.join(path, "mamba_ssm"), path):
        if os.path.isfile(os.path.join(candidate, "__init__.py")) and \
                os.path.isdir(os.path.join(candidate, "modules")):
            return os.path.abspath(candidate)
    raise ValueError(f"upstream: {path!r} is neither a mamba_ssm source tree (holding mamba_ssm/) nor the "
                     "mamba_ssm package folder")


def _upstream_top(package_dir: str) -> types.ModuleType:
    """A ``mamba_ssm`` package whose subpackages come from upstream's folder (its __init__ is not run: it
    imports Mamba3's triton kernels); the top-level names resolve on first use."""
    top = types.ModuleType("mamba_ssm", "mamba_ssm from upstream's source, kernels from tvm_mamba")
    top.__path__ = [package_dir]
    top.__file__ = os.path.join(package_dir, "__init__.py")
    top.__version__ = "2.3.2.post1"

    def __getattr__(name):
        if name in _UPSTREAM_TOP:
            return getattr(importlib.import_module(_UPSTREAM_TOP[name]), name)
        raise AttributeError(f"module 'mamba_ssm' has no attribute {name!r}")

    top.__getattr__ = __getattr__
    return top


def install(upstream=None) -> None:
    """Register tvm_mamba under upstream's module names in ``sys.modules``: ``mamba_ssm``, ``mamba_ssm.ops.*``,
    ``mamba_ssm.modules.*``, ``mamba_ssm.models.*``, ``mamba_ssm.utils.generation``, ``causal_conv1d``,
    ``causal_conv1d.causal_conv1d_interface``, ... (every module of tvm_mamba.compat).

    upstream: optional path of an extracted mamba_ssm source tree (e.g. ``.../mamba_ssm-2.3.2.post1``): then
    only the kernel paths (``mamba_ssm.ops.*``, ``causal_conv1d.*``) are tvm_mamba's, and ``mamba_ssm.modules``,
    ``.models``, ``.utils``, ``.distributed`` are upstream's own files, imported from there on first use.
    Call before anything imports mamba_ssm / causal_conv1d; a real installation already imported is refused
    (RuntimeError). Installing again replaces the previous install."""
    if _installed:
        uninstall()
    clash = [n for n in TOP_NAMES if n in sys.modules]
    if clash:
        raise RuntimeError(f"install: {clash} already imported (another installation?); call "
                           "tvm_mamba.compat.install() before anything imports them")
    aliases = {}
    for top in TOP_NAMES:
        aliases.update(_our_modules(top))
    if upstream is not None:
        package_dir = _upstream_package_dir(upstream)
        aliases = {k: v for k, v in aliases.items() if not k.startswith("mamba_ssm") or k.startswith("mamba_ssm.ops")}
        aliases["mamba_ssm"] = _upstream_top(package_dir)
    for name in sorted(aliases):  # parents first
        sys.modules[name] = aliases[name]
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, aliases[name])
    _installed.extend(TOP_NAMES)


def uninstall() -> None:
    """Remove every ``mamba_ssm*`` / ``causal_conv1d*`` entry that :func:`install` (or upstream's modules
    imported through it) put into ``sys.modules``."""
    for name in list(sys.modules):
        if any(name == top or name.startswith(top + ".") for top in _installed):
            del sys.modules[name]
    _installed.clear()


__all__ = ["install", "uninstall"]
