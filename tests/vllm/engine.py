"""One vLLM engine run, in a process of its own (the plugin rebinds module globals for the whole process, and
vLLM's CPU engine is process-wide): ``python tests/vllm/engine.py SPEC_JSON`` prints one line
``RESULT {"tokens": [...], "seen": {...}}``.

SPEC: model (a directory saved by transformers), prompts (token ids), max_tokens (one per prompt), engine
(keyword arguments of vllm.LLM), warm (prompts generated first, for prefix-cache hits). ``seen`` counts what
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
            loc = k.get("query_start_loc")
            if loc is not None and loc.numel() > 1:
                seen["longest_decode_query"] = max(seen["longest_decode_query"], int(loc.diff().max()))
            return _f(*a, **k)

        def on_prefill(*a, _f=prefill, **k):
            init = k.get("has_initial_state")
            if init is not None and bool(init.any()):
                seen["continued_prefills"] += 1
            return _f(*a, **k)

        mod.causal_conv1d_update, mod.causal_conv1d_fn = on_update, on_prefill


def main(spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model=spec["model"], dtype="float32", skip_tokenizer_init=True, seed=0, **spec.get("engine", {}))
    seen = {"continued_prefills": 0, "longest_decode_query": 1, "tvm_mamba": False}
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
