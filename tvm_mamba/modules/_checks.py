"""Argument checks shared by the Mamba / Mamba2 blocks: errors name the argument and say what was expected."""
from __future__ import annotations

import torch
from torch import Tensor


def check_hidden(name: str, x, d_model: int, seqlen_one: bool = False) -> None:
    """x: (batch, seqlen, d_model) floating tensor (seqlen == 1 when ``seqlen_one``)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got {x.dtype}")
    if x.dim() != 3 or x.shape[-1] != d_model:
        raise ValueError(f"{name}: expected (batch, seqlen, d_model={d_model}), got shape {tuple(x.shape)}")
    if seqlen_one and x.shape[1] != 1:
        raise ValueError(f"{name}: step() decodes one token: expected (batch, 1, {d_model}), "
                         f"got shape {tuple(x.shape)}")


def check_state(name: str, state, batch: int, tail: tuple, dtypes: tuple, device) -> None:
    """state: (>= batch, *tail) in one of dtypes on device; a cache allocated for a larger batch is fine."""
    if not isinstance(state, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(state).__name__}")
    if state.dim() != 1 + len(tail) or tuple(state.shape[1:]) != tuple(tail):
        raise ValueError(f"{name}: expected shape (batch, {', '.join(map(str, tail))}), got {tuple(state.shape)}")
    if state.shape[0] < batch:
        raise ValueError(f"{name}: allocated for batch {state.shape[0]}, but the input has batch {batch}")
    if state.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name}: dtype must be one of ({names}), got {str(state.dtype).replace('torch.', '')}")
    if state.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (where hidden_states is), got {state.device}")


FLOAT_STATES = (torch.float32, torch.float16, torch.bfloat16)
