"""Export jaxgen weights to a transformers model (for parity tests and benchmarks).

Needs torch and transformers (the `test` extra); they are imported only when called.

Example:
    >>> model, params, _ = jaxgen.models.load("smollm2-135m-instruct")
    >>> hf = hf_from_jaxgen(model, params)        # a LlamaForCausalLM with the same weights
"""
from __future__ import annotations

import numpy as np


def to_hf_state_dict(model, params) -> dict:
    """jaxgen params -> a HF Llama-family state dict (fp32 torch tensors)."""
    cfg = model.config
    import torch

    as_t = lambda a: torch.from_numpy(np.array(a, dtype=np.float32))  # noqa: E731
    names = {"attn_norm": ("input_layernorm.weight", False),
             "mlp_norm": ("post_attention_layernorm.weight", False),
             "wq": ("self_attn.q_proj.weight", True), "wk": ("self_attn.k_proj.weight", True),
             "wv": ("self_attn.v_proj.weight", True), "wo": ("self_attn.o_proj.weight", True),
             "bq": ("self_attn.q_proj.bias", False), "bk": ("self_attn.k_proj.bias", False),
             "bv": ("self_attn.v_proj.bias", False), "bo": ("self_attn.o_proj.bias", False),
             "q_norm": ("self_attn.q_norm.weight", False),
             "k_norm": ("self_attn.k_norm.weight", False),
             "w_gate": ("mlp.gate_proj.weight", True), "w_up": ("mlp.up_proj.weight", True),
             "w_down": ("mlp.down_proj.weight", True)}
    state = {"model.embed_tokens.weight": as_t(params["embed"]),
             "model.norm.weight": as_t(params["final_norm"])}
    for key, stacked in params["layers"].items():
        suffix, transpose = names[key]
        for i in range(cfg.num_layers):
            arr = np.asarray(stacked[i], dtype=np.float32)
            state[f"model.layers.{i}.{suffix}"] = as_t(arr.T if transpose else arr)
    state["lm_head.weight"] = as_t(params["embed"] if cfg.tie_word_embeddings
                                   else np.asarray(params["lm_head"]).T)
    return state


def hf_from_jaxgen(model, params):
    """A transformers Llama-family model (fp32, eager attention) holding jaxgen's weights."""
    import transformers

    cfg = model.config
    classes = {"LlamaForCausalLM": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
               "MistralForCausalLM": (transformers.MistralConfig, transformers.MistralForCausalLM),
               "Qwen2ForCausalLM": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
               "Qwen3ForCausalLM": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}
    config_cls, model_cls = classes[cfg.architecture]
    extra = {}
    if cfg.architecture == "LlamaForCausalLM":
        extra["attention_bias"] = cfg.attention_bias
    if cfg.rope_scaling is not None:
        extra["rope_scaling"] = dict(cfg.rope_scaling)
    hf_config = config_cls(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings, **extra)
    hf_config._attn_implementation = "eager"
    hf = model_cls(hf_config).eval()
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(model, params), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if cfg.tie_word_embeddings:
        hf.tie_weights()
    return hf
