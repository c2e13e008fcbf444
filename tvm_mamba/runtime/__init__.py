"""Runtime: targets, kernel keys, the build cache and dispatch (torch-free)."""
from .target import cpu_target, cuda_target, target_for_device, target_key, host_cpu  # noqa: F401  (sets TVM_NUM_THREADS first)
from .key import KernelKey, shape_bucket, pow2_bucket  # noqa: F401
from .cache import build_and_load, cache_root, Kernel  # noqa: F401
