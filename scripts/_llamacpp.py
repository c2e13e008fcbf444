"""llama.cpp on token ids, through llama-cpp-python's bindings of llama.h (the C API, not its ``Llama`` class:
that one tokenizes text and keeps one sequence; we feed ids, and batch b as b sequences of one decode call).

    lm = LlamaCpp("model.gguf", n_threads=2, n_seq=1)
    logits = lm.forward(ids)      # ids (b, L) int -> logits of each sequence's last token (b, vocab) float32
    logits = lm.forward(next_ids) # (b, 1): one decode step; the recurrent states carry on
    lm.reset()                    # empty states: the next forward is a new prompt
    lm.close()

The context keeps llama.cpp's defaults (n_ubatch 512: a longer prompt runs as several graph evaluations, as
llama-cli / llama-bench would) except: n_batch is raised to the longest call so that one ``llama_decode``
takes a whole prompt, n_seq_max is the batch (one recurrent state slot per sequence), and n_threads /
n_threads_batch are the caller's (bench_lm passes tvm_mamba's thread count). Logging below ERROR is off.
"""
from __future__ import annotations

import logging
import os

import numpy as np

LOGGER = "llama-cpp-python"  # llama-cpp-python's logger: its level filters llama.cpp's log callback


def available() -> bool:
    """llama-cpp-python and gguf (the GGUF writer) are both importable."""
    import importlib.util

    return all(importlib.util.find_spec(name) is not None for name in ("llama_cpp", "gguf"))


def version() -> str:
    import llama_cpp

    return llama_cpp.__version__


class LlamaCpp:
    """One llama.cpp model + context: ``forward`` b equal-length sequences, states kept between calls."""

    def __init__(self, path, n_threads: int, n_seq: int = 1, max_tokens: int = 2048):
        import llama_cpp as lc

        logging.getLogger(LOGGER).setLevel(logging.ERROR)
        self.lc = lc
        lc.llama_backend_init()
        self.model = lc.llama_model_load_from_file(os.fsencode(path), lc.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        params = lc.llama_context_default_params()
        params.n_batch = max(params.n_batch, max_tokens)
        params.n_ctx = max(params.n_ctx, params.n_batch)
        params.n_seq_max = n_seq
        params.n_threads = params.n_threads_batch = n_threads
        params.no_perf = True
        self.ctx = lc.llama_init_from_model(self.model, params)
        if not self.ctx:
            lc.llama_model_free(self.model)
            raise RuntimeError(f"llama.cpp could not create a context for {path} ({n_seq} sequences)")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.n_batch, self.n_seq = params.n_batch, n_seq
        self.batch = lc.llama_batch_init(self.n_batch, 0, n_seq)
        self.pos = 0

    def reset(self) -> None:
        """Forget every sequence's state (the next forward starts at position 0)."""
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        self.pos = 0

    def _fill(self, ids: np.ndarray) -> None:
        """The batch: sequence s's tokens at s * L ..., positions pos.., logits for each sequence's last."""
        b, length = ids.shape
        batch = self.batch
        batch.n_tokens = b * length
        for s in range(b):
            for t in range(length):
                i = s * length + t
                batch.token[i] = int(ids[s, t])
                batch.pos[i] = self.pos + t
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = s
                batch.logits[i] = t == length - 1

    def forward(self, ids) -> np.ndarray:
        """ids: (batch, seqlen) token ids, batch <= n_seq, batch * seqlen <= n_batch -> (batch, vocab) float32
        logits of each sequence's last token (a copy: llama.cpp reuses its buffer on the next call)."""
        ids = np.asarray(ids)
        if ids.ndim != 2 or not ids.shape[0] or not ids.shape[1]:
            raise ValueError(f"ids: expected a non-empty (batch, seqlen) array, got shape {ids.shape}")
        b, length = ids.shape
        if b > self.n_seq or b * length > self.n_batch:
            raise ValueError(f"ids: (batch {b}, seqlen {length}) exceeds this context's {self.n_seq} sequences "
                             f"/ {self.n_batch} tokens per call")
        self._fill(ids)
        rc = self.lc.llama_decode(self.ctx, self.batch)
        if rc:
            raise RuntimeError(f"llama_decode failed (return code {rc})")
        self.pos += length
        out = np.empty((b, self.n_vocab), dtype=np.float32)
        for s in range(b):
            ptr = self.lc.llama_get_logits_ith(self.ctx, s * length + length - 1)
            out[s] = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
        return out

    def close(self) -> None:
        if self.ctx:
            self.lc.llama_batch_free(self.batch)
            self.lc.llama_free(self.ctx)
            self.lc.llama_model_free(self.model)
            self.ctx = self.model = None
