"""Export jaxgen weights in Hugging Face's layout: a checkpoint folder, or a transformers model.

`save_hf_checkpoint` writes config.json + model.safetensors with numpy only (the folder loads
back with `load_hf_checkpoint` and with transformers' from_pretrained). `to_hf_state_dict` and
`hf_from_jaxgen` need torch and transformers (the `test` extra), imported only when called.

Example:
    >>> import jax
    >>> from jaxgen.models import Llama, LlamaConfig
    >>> model = Llama(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
    ...                           num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8))
    >>> params = model.init_params(jax.random.key(0))
    >>> arrays = to_hf_arrays(model, params)
    >>> arrays["model.layers.1.self_attn.k_proj.weight"].shape    # HF's [out, in]
    (8, 16)
    >>> hf = hf_from_jaxgen(model, params)   # a LlamaForCausalLM with the same weights
    >>> tuple(hf.model.layers[1].self_attn.k_proj.weight.shape)
    (8, 16)
"""
from __future__ import annotations

import json
import os

import numpy as np

from jaxgen.models.quantize import dense
from jaxgen.models.safetensors_io import write_safetensors

HF_LAYER_NAMES = {  # params name -> (HF suffix under model.layers.{i}., transposed)
    "attn_norm": ("input_layernorm.weight", False),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True), "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True), "wo": ("self_attn.o_proj.weight", True),
    "bq": ("self_attn.q_proj.bias", False), "bk": ("self_attn.k_proj.bias", False),
    "bv": ("self_attn.v_proj.bias", False), "bo": ("self_attn.o_proj.bias", False),
    "q_norm": ("self_attn.q_norm.weight", False), "k_norm": ("self_attn.k_norm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True), "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
}

_MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


def to_hf_arrays(model, params, dtype=np.float32) -> dict[str, np.ndarray]:
    """jaxgen params (stacked layout) -> HF state dict as numpy arrays of `dtype`.

    A tied model gets no `lm_head.weight` (HF re-ties it from the embeddings). Quantized
    matrices (load(weights="int8" / "gguf")) are exported as the float values they stand for.
    """
    cfg = model.config
    as_np = lambda a: np.ascontiguousarray(np.asarray(dense(a)).astype(dtype))  # noqa: E731
    arrays = {"model.embed_tokens.weight": as_np(params["embed"]),
              "model.norm.weight": as_np(params["final_norm"])}
    for key, stacked in params["layers"].items():
        suffix, transpose = HF_LAYER_NAMES[key]
        stacked = np.asarray(dense(stacked))  # [L, ...]
        for i in range(cfg.num_layers):
            arr = stacked[i]
            arrays[f"model.layers.{i}.{suffix}"] = as_np(arr.T if transpose else arr)
    if not cfg.tie_word_embeddings:
        arrays["lm_head.weight"] = as_np(np.asarray(dense(params["lm_head"])).T)
    return arrays


def to_hf_state_dict(model, params) -> dict:
    """jaxgen params -> a HF Llama-family state dict (fp32 torch tensors, lm_head included)."""
    import torch

    arrays = to_hf_arrays(model, params)
    arrays.setdefault("lm_head.weight", arrays["model.embed_tokens.weight"])
    return {name: torch.from_numpy(array) for name, array in arrays.items()}


def hf_config_dict(config) -> dict:
    """The config.json that `LlamaConfig.from_hf_dict` reads back as `config`."""
    arch = config.architecture
    out = {"architectures": [arch], "model_type": _MODEL_TYPES[arch],
           "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
           "intermediate_size": config.intermediate_size,
           "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
           "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
           "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
           "max_position_embeddings": config.max_position_embeddings,
           "tie_word_embeddings": config.tie_word_embeddings,
           "bos_token_id": config.bos_token_id,
           "eos_token_id": (list(config.eos_token_id) if len(config.eos_token_id) > 1
                            else (config.eos_token_id[0] if config.eos_token_id else None)),
           "pad_token_id": config.pad_token_id}
    if arch != "Qwen2ForCausalLM":
        out["attention_bias"] = config.attention_bias
    if config.rope_scaling is not None:
        out["rope_scaling"] = dict(config.rope_scaling)
    if config.sliding_window is not None:
        out["sliding_window"] = config.sliding_window
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
            out.update(use_sliding_window=True, max_window_layers=0)
    return out


def save_hf_checkpoint(model, params, folder: str, dtype=np.float32) -> str:
    """Writes `folder`/config.json and `folder`/model.safetensors (numpy only); returns folder.

    params: the stacked layout (`load`, `init_params`). dtype: e.g. np.float32 or
    ml_dtypes.bfloat16. Generation defaults, when any, go to generation_config.json.
    """
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hf_config_dict(model.config), f, indent=2)
    defaults = model.config.generation_defaults_dict
    if defaults:
        with open(os.path.join(folder, "generation_config.json"), "w", encoding="utf-8") as f:
            json.dump(defaults, f, indent=2)
    write_safetensors(os.path.join(folder, "model.safetensors"),
                      to_hf_arrays(model, params, dtype), metadata={"format": "pt"})
    return folder


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
