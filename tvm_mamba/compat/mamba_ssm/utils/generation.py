"""mamba_ssm.utils.generation on tvm_mamba (CUDA-graph capture, update_graph_cache / capture_graph, is not
provided: ``decode(cg=True)`` runs the eager loop)."""
from ....modules.generation import (GenerateDecoderOnlyOutput, GenerationMixin, InferenceParams, decode,  # noqa: F401
                                    modify_logit_for_repetition_penalty, modify_logits_for_min_p_filtering,
                                    modify_logits_for_top_k_filtering, modify_logits_for_top_p_filtering, sample)

__all__ = ["InferenceParams", "GenerationMixin", "GenerateDecoderOnlyOutput", "decode", "sample",
           "modify_logits_for_min_p_filtering", "modify_logits_for_top_k_filtering",
           "modify_logits_for_top_p_filtering", "modify_logit_for_repetition_penalty"]
