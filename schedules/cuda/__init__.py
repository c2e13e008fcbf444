"""CUDA schedules: one module per op, ``apply(func, target, decisions) -> Schedule | None``."""
