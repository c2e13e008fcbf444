"""PyTorch references written from the math (float64-capable). No TVM. Used by tests and benchmarks."""
