"""``mamba_ssm`` on the GPU machine (scripts/gpu_check.sh puts scripts/gpu_upstream on PYTHONPATH): upstream's
package folder carried in the bundle ($TVM_MAMBA_UPSTREAM_DIR/mamba_ssm-<version>/mamba_ssm), its submodules
(``mamba_ssm.ops.triton.ssd_combined``, ...) imported from there, but its own ``__init__.py`` not run: that
imports the CUDA extension ``selective_scan_cuda``, which the bundle does not carry (docs/gpu.md). With the
variable unset (the sanitizer runs leave upstream out) ``import mamba_ssm`` fails, as it would without it."""
import glob
import os

_root = os.environ.get("TVM_MAMBA_UPSTREAM_DIR")
_found = sorted(glob.glob(os.path.join(_root, "mamba_ssm-*", "mamba_ssm"))) if _root else []
if not _found:
    raise ImportError(f"mamba_ssm: no mamba_ssm-*/mamba_ssm under TVM_MAMBA_UPSTREAM_DIR={_root!r}")
__path__ = [_found[-1]]
__version__ = os.path.basename(os.path.dirname(_found[-1])).split("-", 1)[1]
