"""tvm_mamba: Mamba kernels defined once in Apache TVM, compiled for each machine, called from PyTorch."""
__version__ = "0.1.0"
