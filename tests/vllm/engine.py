"""One vLLM engine run, in a process of its own (the plugin rebinds module globals for the whole process, and
vLLM's CPU engine is process-wide): ``python tests/vllm/engine.py SPEC_JSON`` prints one line
``RESULT {"tokens": [...], "seen": {...}}``.

SPEC: model (a directory saved by transformers), prompts (token ids), max_tokens (one per prompt), engine
(keyword arguments of vllm.LLM), warm (prompts generated first, for prefix-cache hits), record_accepted_tokens
(fill in vLLM 0.32's missing accepted-token counts for attention-free models: _record_accepted_tokens),
simulate_cuda (tvm_mamba's CUDA kernels run through the CPU harness instead of its CPU kernels). ``seen`` counts what
the Mamba layers were called with: prefills continuing a state (chunked prefill, prefix-cache hits), the
longest decode query (speculative decoding), and whether tvm_mamba's functions were the ones called.
"""
from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the model runs in this process: calls are seen


def _watch(seen: dict) -> None:
    """Wrap the conv calls of both Mamba layers (whichever implementation is bound) to record what they get."""
    import vllm.model_executor.layers.mamba.mamba_mixer as m1
    import vllm.model_executor.layers.mamba.mamba_mixer2 as m2

    seen["tvm_mamba"] = all(mod.causal_conv1d_update.__module__.startswith("tvm_mamba") for mod in (m1, m2))
    for mod in (m1, m2):
        update, prefill = mod.causal_conv1d_update, mod.causal_conv1d_fn

        def on_update(*a, _f=update, **k):
            from tvm_mamba.runtime.target import cudasim_active

            seen["cuda_kernels_simulated"] = cudasim_active() is not None
            loc, accepted = k.get("query_start_loc"), k.get("num_accepted_tokens")
            if loc is not None and loc.numel() > 1:
                seen["longest_decode_query"] = max(seen["longest_decode_query"], int(loc.diff().max()))
            if accepted is not None and accepted.numel():
                seen["most_accepted"] = max(seen["most_accepted"], int(accepted.max()))
            return _f(*a, **k)

        def on_prefill(*a, _f=prefill, **k):
            init = k.get("has_initial_state")
            if init is not None and bool(init.any()):
                seen["continued_prefills"] += 1
            return _f(*a, **k)

        mod.causal_conv1d_update, mod.causal_conv1d_fn = on_update, on_prefill


def _record_accepted_tokens() -> None:
    """vLLM 0.32 counts a speculative step's accepted tokens only for hybrid models
    (GPUModelRunner._update_states_after_model_execute returns early otherwise), so an attention-free Mamba
    model's layers always get num_accepted_tokens = 1 and read the state after the step's first token even
    when drafts were accepted. This records the count for any model, as vLLM does for hybrid ones."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    update = GPUModelRunner._update_states_after_model_execute

    def recording(self, output_token_ids, *args, **kwargs):
        result = update(self, output_token_ids, *args, **kwargs)
        if self.speculative_config and not self.model_config.is_hybrid:
            n = output_token_ids.size(0)
            self.num_accepted_tokens.gpu[:n] = (output_token_ids != -1).sum(dim=1)
            self.input_batch.num_accepted_tokens_cpu_tensor[:n].copy_(self.num_accepted_tokens.gpu[:n])
        return result

    GPUModelRunner._update_states_after_model_execute = recording


def main(spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    if spec.get("record_accepted_tokens"):
        _record_accepted_tokens()
    if spec.get("simulate_cuda"):  # every tvm_mamba kernel of this process: the CUDA one, through the harness
        import tvm_mamba

        spec["_simulation"] = tvm_mamba.simulate_cuda("sm_90")  # kept: a dropped one would close at once
        spec["_simulation"].__enter__()

    llm = LLM(model=spec["model"], dtype="float32", skip_tokenizer_init=True, seed=0, **spec.get("engine", {}))
    seen = {"continued_prefills": 0, "longest_decode_query": 1, "most_accepted": 0, "tvm_mamba": False,
            "cuda_kernels_simulated": False}
    _watch(seen)
    greedy = lambda n: SamplingParams(temperature=0, max_tokens=n, detokenize=False)  # noqa: E731
    if spec.get("warm"):
        llm.generate([{"prompt_token_ids": p} for p in spec["warm"]], greedy(1))
        seen["continued_prefills"] = 0
    outs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]],
                        [greedy(n) for n in spec["max_tokens"]])
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs], "seen": seen}


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(json.loads(sys.argv[1]))), flush=True)
