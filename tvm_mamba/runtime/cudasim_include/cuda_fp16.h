// tvm_mamba CUDA-on-CPU harness: stands in for the CUDA header of this name (see docs/cuda_sim.md).
#pragma once
#include "tvm_mamba_cudasim.h"
