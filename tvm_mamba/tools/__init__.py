"""Developer tooling beside the product: the kernel checks and tuning that build, run and judge the
product's kernels, never imported by it (tests/test_architecture.py).

``simcheck/``    every CUDA kernel run on the CPU through the CUDA execution harness against the references
``roofline/``    each CUDA kernel's bound and estimate (docs/roofline.md)
``tune.py``      the tuner: candidates per kernel and shape bucket, measured, the winner recorded
``candidates.py``, ``metaschedule.py``   candidate rounds on another machine; MetaSchedule's search space
``aot.py``       kernel packs for a machine with only the TVM runtime

``python -m tvm_mamba <command>`` (tvm_mamba/cli.py) dispatches to them.
"""
