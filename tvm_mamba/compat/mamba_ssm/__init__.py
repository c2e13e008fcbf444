"""mamba_ssm's top-level names on tvm_mamba (``import mamba_ssm`` after ``tvm_mamba.compat.install()``).

``__version__`` is the mamba_ssm release whose API this mirrors (not tvm_mamba's version). Mamba3 is the SISO
block, inference only (MIMO and the backward are not implemented yet)."""
__version__ = "2.3.2.post1"

from .ops.selective_scan_interface import selective_scan_fn  # noqa: E402,F401
from .modules.mamba_simple import Mamba  # noqa: E402,F401
from .modules.mamba2 import Mamba2  # noqa: E402,F401
from .modules.mamba3 import Mamba3  # noqa: E402,F401
from .models.mixer_seq_simple import MambaLMHeadModel  # noqa: E402,F401

__all__ = ["selective_scan_fn", "Mamba", "Mamba2", "Mamba3", "MambaLMHeadModel", "__version__"]
