"""Argument checks shared by the Mamba / Mamba2 / Mamba3 blocks: errors name the argument and say what was expected."""
from __future__ import annotations

import torch
from torch import Tensor

from ..torch_ops.ssd import check_seq_idx, seq_idx_of


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


def check_cu_seqlens(cu_seqlens, batch: int, seqlen: int, seq_idx=None) -> Tensor:
    """cu_seqlens: (nseq + 1,) int32/int64, 0 = cu[0] <= cu[1] <= ... <= cu[-1] <= seqlen, for a batch of one
    packed row; the positions from cu[-1] on are padding (mamba_ssm's test_generation_varlen_with_padding)
    -> seq_idx (1, seqlen) int32: the given one, checked to agree before cu[-1] (the padding's ids are free
    within seq_idx's own rule: nondecreasing, or negative to the row's end), or derived: the id of the sequence
    holding each position, and nseq for the padding (a sequence of its own, as upstream's test passes it)."""
    if not isinstance(cu_seqlens, Tensor):
        raise TypeError(f"cu_seqlens: expected a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens: expected a 1-D int32 tensor (nseq + 1,), got {cu_seqlens.dtype} "
                         f"shape {tuple(cu_seqlens.shape)}")
    if batch != 1:
        raise ValueError(f"cu_seqlens: packed sequences need batch 1 (all sequences in one row), got batch {batch}")
    cu = cu_seqlens.to("cpu", torch.int64)
    end = int(cu[-1])
    if int(cu[0]) != 0 or end > seqlen or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"cu_seqlens: must start at 0, be nondecreasing and end at seqlen={seqlen} or before it "
                         f"(the positions after its last entry are padding), got {cu.tolist()}")
    derived = seq_idx_of(cu, seqlen)
    if seq_idx is None:
        return derived.to(cu_seqlens.device)
    if not isinstance(seq_idx, Tensor) or tuple(seq_idx.shape) != (1, seqlen) \
            or not torch.equal(seq_idx[:, :end].to("cpu", torch.int32), derived[:, :end]):
        raise ValueError("seq_idx: does not match cu_seqlens (seq_idx[0, t] must be the index of the sequence "
                         "holding position t, for t < cu_seqlens[-1])")
    check_seq_idx(seq_idx, 1, seqlen, seq_idx.device, padding=True)
    return seq_idx


def states_from_cache(block, inference_params, batch_size: int, initialize_states: bool = False) -> tuple:
    """The decode states of ``block`` (a Mamba / Mamba2: (conv_state, ssm_state); a Mamba3: (angle, ssm, k,
    v states); the block needs ``layer_idx``) in the inference cache, allocated by the block's
    ``allocate_inference_cache`` on first use; zeroed in place when ``initialize_states`` (mamba_ssm's
    ``_get_states_from_cache``, shared by the blocks)."""
    assert block.layer_idx is not None, "layer_idx: must be set to use inference_params"
    cache = inference_params.key_value_memory_dict
    if block.layer_idx not in cache:
        cache[block.layer_idx] = block.allocate_inference_cache(batch_size, inference_params.max_seqlen)
    states = tuple(cache[block.layer_idx])
    if initialize_states:
        for state in states:
            state.zero_()
    return states
