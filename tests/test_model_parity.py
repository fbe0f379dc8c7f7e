"""Logit parity of jaxgen's Llama family with Hugging Face transformers (fp32, CPU)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from model_fixtures import (
    SHARED_CASES,
    assert_logits_close,
    hf_greedy_logits,
    jax_greedy_logits,
    make_hf_model,
    save_hf_model,
    smollm2_pair,
)

from jaxgen.models import DEFAULT_MODEL, Llama, LlamaConfig, load
from jaxgen.models.hf_checkpoint import load_hf_checkpoint

CASES = {
    **SHARED_CASES,
    "llama_tied_linear": ("llama", dict(tie_word_embeddings=True,
                                        rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "llama_attention_bias": ("llama", dict(attention_bias=True)),  # q/k/v/o biases
    "mistral": ("mistral", dict(num_key_value_heads=1, sliding_window=None)),
}
PROMPT = [5, 17, 33, 2, 60, 61, 8, 90, 44, 3, 12]


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    arch, overrides = CASES[request.param]
    hf = make_hf_model(arch, **overrides)
    folder = str(tmp_path_factory.mktemp(request.param))
    # Every other case is saved sharded, which exercises model.safetensors.index.json.
    shard = "40KB" if sorted(CASES).index(request.param) % 2 else None
    save_hf_model(hf, folder, max_shard_size=shard)
    model, params = load_hf_checkpoint(folder)
    return request.param, hf, model, params


def test_prefill_and_20_cached_decode_steps_match_hf(case):
    name, hf, model, params = case
    expected = hf_greedy_logits(hf, PROMPT, steps=20)
    actual = jax_greedy_logits(model, params, PROMPT, steps=20, tokens_from=expected)
    assert len(actual) == 21
    for step, (a, b) in enumerate(zip(actual, expected)):
        assert_logits_close(a, b), (name, step)


def test_config_flags_follow_architecture(case):
    name, hf, model, _ = case
    cfg = model.config
    assert cfg.attention_bias == (name.startswith("qwen2") or name == "llama_attention_bias")
    assert cfg.attention_out_bias == (name == "llama_attention_bias")
    assert cfg.qk_norm == name.startswith("qwen3")
    assert cfg.num_kv_heads == hf.config.num_key_value_heads
    assert cfg.tie_word_embeddings == bool(hf.config.tie_word_embeddings)
    hash(cfg)


def test_dynamic_ntk_rope_beyond_max_positions(tmp_path):
    """Sequences longer than max_position_embeddings: HF recomputes inv_freq from seq_len."""
    hf = make_hf_model("llama", max_position_embeddings=16,
                       rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    save_hf_model(hf, str(tmp_path))
    model, params = load_hf_checkpoint(str(tmp_path))
    assert dict(model.config.rope_scaling)["rope_type"] == "dynamic"
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, 96, size=40)]
    expected = hf_greedy_logits(hf, prompt, steps=4)  # growing seq_len at every step
    actual = jax_greedy_logits(model, params, prompt, steps=4, tokens_from=expected)
    for a, b in zip(actual, expected):
        assert_logits_close(a, b)
    # Within max_position_embeddings dynamic equals plain RoPE.
    short_hf = make_hf_model("llama", max_position_embeddings=16)
    short_hf.load_state_dict(hf.state_dict())
    assert_logits_close(jax_greedy_logits(model, params, prompt[:10], 0)[0],
                        hf_greedy_logits(short_hf, prompt[:10], 0)[0])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf = make_hf_model("llama", num_key_value_heads=2)
    folder = str(tmp_path_factory.mktemp("tiny"))
    save_hf_model(hf, folder)
    model, params = load_hf_checkpoint(folder)
    return hf, model, params


def test_ragged_rows_equal_each_row_alone(tiny):
    _, model, params = tiny
    rng = np.random.default_rng(1)
    lengths = [7, 4, 9]
    width = max(lengths)
    rows = [list(rng.integers(3, 96, size=n)) for n in lengths]
    tokens = np.zeros((len(rows), width), np.int32)  # right-padded with 0
    for b, row in enumerate(rows):
        tokens[b, :len(row)] = row
    positions = np.broadcast_to(np.arange(width, dtype=np.int32), tokens.shape)
    forward = jax.jit(lambda p, t, pos, c: model(p, t, pos, c))
    out = forward(params, jnp.asarray(tokens), jnp.asarray(positions),
                  model.init_cache(len(rows), 16))
    nxt = np.asarray([[10 + b] for b in range(len(rows))], np.int32)  # [B, 1]
    step = forward(params, jnp.asarray(nxt), jnp.asarray([[n] for n in lengths], jnp.int32),
                   out.cache)
    for b, row in enumerate(rows):
        alone = forward(params, jnp.asarray([row], jnp.int32),
                        jnp.arange(len(row), dtype=jnp.int32)[None], model.init_cache(1, 16))
        np.testing.assert_allclose(out.logits[b, :len(row)], alone.logits[0], rtol=1e-5,
                                   atol=1e-5)
        alone_step = forward(params, jnp.asarray(nxt[b:b + 1]),
                             jnp.asarray([[len(row)]], jnp.int32), alone.cache)
        np.testing.assert_allclose(step.logits[b], alone_step.logits[0], rtol=1e-5, atol=1e-5)


def test_exit_layer_hidden_and_logits_match_hf_intermediate_state(tiny):
    hf, model, params = tiny
    tokens = jnp.asarray([PROMPT], jnp.int32)
    positions = jnp.arange(len(PROMPT), dtype=jnp.int32)[None]
    out = model(params, tokens, positions, model.init_cache(1, 16), exit_layer=1)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT]), output_hidden_states=True)
        after_first = ref.hidden_states[1]
        ref_logits = hf.lm_head(hf.model.norm(after_first))[0].numpy()
    assert_logits_close(np.asarray(out.hidden[0]), after_first[0].numpy())
    assert_logits_close(np.asarray(out.logits[0]), ref_logits)
    full = model(params, tokens, positions, model.init_cache(1, 16),
                 exit_layer=model.config.num_layers)
    assert_logits_close(np.asarray(full.logits[0]), ref.logits[0].numpy())
    with pytest.raises(ValueError, match="exit_layer"):
        model(params, tokens, positions, model.init_cache(1, 16), exit_layer=0)


def test_logits_index_selects_positions_and_cache_length(tiny):
    _, model, params = tiny
    tokens = jnp.asarray([PROMPT, PROMPT[::-1]], jnp.int32)  # [2, S]
    positions = jnp.broadcast_to(jnp.arange(len(PROMPT), dtype=jnp.int32), tokens.shape)
    cache = model.init_cache(2, 16)
    full = model(params, tokens, positions, cache)
    index = jnp.asarray([[10], [3]], jnp.int32)  # [2, 1]
    part = model(params, tokens, positions, cache, logits_index=index)
    assert part.logits.shape == (2, 1, model.vocab_size)
    assert part.hidden.shape == full.hidden.shape
    np.testing.assert_allclose(part.logits[0, 0], full.logits[0, 10], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(part.logits[1, 0], full.logits[1, 3], rtol=1e-5, atol=1e-6)
    assert full.logits.dtype == jnp.float32
    np.testing.assert_array_equal(full.cache.length, [len(PROMPT)] * 2)


def test_vmap_over_rows_matches_batch(tiny):
    _, model, params = tiny
    tokens = jnp.asarray([PROMPT, PROMPT[::-1]], jnp.int32)[:, None]  # [2, 1, S]
    positions = jnp.broadcast_to(jnp.arange(len(PROMPT), dtype=jnp.int32), tokens.shape)
    caches = jax.vmap(lambda _: model.init_cache(1, 16))(jnp.arange(2))
    mapped = jax.vmap(lambda t, p, c: model(params, t, p, c))(tokens, positions, caches)
    batched = model(params, tokens[:, 0], positions[:, 0], model.init_cache(2, 16))
    np.testing.assert_allclose(mapped.logits[:, 0], batched.logits, rtol=1e-5, atol=1e-6)


def test_random_init_params_cache_kinds_and_bf16():
    cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_layers=3,
                      num_heads=4, num_kv_heads=2, head_dim=8, attention_bias=True, qk_norm=True)
    model = Llama(cfg)
    assert hash(model) == hash(Llama(cfg))
    params = model.init_params(jax.random.key(0), jnp.bfloat16)
    assert params["layers"]["wq"].shape == (3, 32, 32)
    assert params["layers"]["q_norm"].shape == (3, 8)
    assert "lm_head" in params
    with pytest.raises(ValueError, match="static"):
        model.init_cache(1, 8, kind="paged")
    out = jax.jit(lambda p, t, pos, c: model(p, t, pos, c))(
        params, jnp.ones((2, 5), jnp.int32), jnp.broadcast_to(jnp.arange(5), (2, 5)),
        model.init_cache(2, 8, jnp.bfloat16))
    assert out.logits.dtype == jnp.float32 and out.hidden.dtype == jnp.bfloat16
    assert out.logits.shape == (2, 5, 40)
    assert bool(jnp.all(jnp.isfinite(out.logits)))


def test_smollm2_matches_hf_llama_on_dequantized_weights():
    model, params, tokenizer, hf = smollm2_pair()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Name a color."}])
    expected = hf_greedy_logits(hf, prompt, steps=20)
    actual = jax_greedy_logits(model, params, prompt, steps=20, tokens_from=expected)
    for a, b in zip(actual, expected):
        assert_logits_close(a, b)


@pytest.mark.slow
def test_smollm2_greedy_answers_paris():
    model, params, tokenizer = load(DEFAULT_MODEL)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}])
    forward = jax.jit(lambda p, t, pos, c: model(p, t, pos, c))
    out = forward(params, jnp.asarray([prompt], jnp.int32),
                  jnp.arange(len(prompt), dtype=jnp.int32)[None],
                  model.init_cache(1, len(prompt) + 24))
    generated = []
    for step in range(20):
        token = int(jnp.argmax(out.logits[0, -1]))
        generated.append(token)
        if token in model.config.eos_token_id:
            break
        out = forward(params, jnp.asarray([[token]], jnp.int32),
                      jnp.asarray([[len(prompt) + step]], jnp.int32), out.cache)
    answer = tokenizer.decode(generated, skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_unstacked_layers_give_the_same_logits_and_tokens(tiny):
    import jaxgen
    from jaxgen.models import unstack_layers

    _, model, params = tiny
    fast = unstack_layers(model, params)
    assert isinstance(fast["layers"], list) and len(fast["layers"]) == model.config.num_layers
    assert fast["lm_head"].shape == (model.config.hidden_size, model.config.vocab_size)
    tokens = jnp.asarray([[5, 17, 33, 2, 60]], jnp.int32)
    positions = jnp.arange(5, dtype=jnp.int32)[None]
    stacked = model(params, tokens, positions, model.init_cache(1, 8))
    unstacked = model(fast, tokens, positions, model.init_cache(1, 8))
    np.testing.assert_allclose(unstacked.logits, stacked.logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(unstacked.cache.k, stacked.cache.k, rtol=1e-5, atol=1e-6)
    early = model(fast, tokens, positions, model.init_cache(1, 8), exit_layer=1)
    np.testing.assert_allclose(early.logits, model(params, tokens, positions, model.init_cache(
        1, 8), exit_layer=1).logits, rtol=1e-5, atol=1e-5)
    cfg = jaxgen.GenerationConfig(max_new_tokens=12)
    assert (jaxgen.generate_ids(model, fast, [[5, 17, 33], [9]], cfg)
            == jaxgen.generate_ids(model, params, [[5, 17, 33], [9]], cfg))
