"""Every op through its public function with the CUDA kernels run by the CPU harness (runtime/cudasim.py)."""
