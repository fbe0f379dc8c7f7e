"""The quantized (int8 / 4-bit) KV cache: kernel exactness, SmolLM2 quality, memory."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxgen
from jaxgen.api.quantized_agreement import TIE_GAP
from jaxgen.cache.attention import KeyBlock, attend_blocks
from jaxgen.cache.int8 import dequantize, hadamard, pack4, quantize, unpack4
from jaxgen.config.generation import GenerationConfig

PROMPTS = [
    "The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):",
    "Explain photosynthesis in simple terms.", "List three uses of a paperclip.",
    "Translate 'good morning' into Spanish.", "What is 17 times 23?",
    "Give me a recipe for pancakes.", "Why is the sky blue?", "Summarize the plot of Hamlet.",
    "Write a short poem about autumn leaves.", "How do I reverse a list in Python?",
    "What are the planets of the solar system?", "Describe a cat to someone who has never "
    "seen one.", "Tell me a joke about computers.", "What causes earthquakes?",
    "Write an email asking for a day off.", "What is the difference between a virus and "
    "a bacterium?", "Explain recursion to a child.", "Name five famous painters.",
]


# ----------------------------------------------------------------------------- kernel
@pytest.mark.parametrize("nbits,group", [(8, 16), (8, 8), (4, 16), (4, 4)])
def test_quantize_roundtrip_within_half_a_step(nbits, group):
    x = jax.random.normal(jax.random.key(0), (3, 5, 2, 16)) * 3.0
    codes, scale = quantize(x, nbits, 16 // group, jnp.float32)
    assert codes.dtype == (jnp.int8 if nbits == 8 else jnp.uint8)
    back = dequantize(codes, scale, nbits)
    step = np.repeat(np.asarray(scale), group, axis=-1)  # [..., Dh]
    assert np.all(np.abs(np.asarray(back - x)) <= step / 2 + 1e-6)


def test_pack4_roundtrip():
    codes = jnp.arange(-8, 8, dtype=jnp.int8).reshape(2, 8)
    np.testing.assert_array_equal(unpack4(pack4(codes)), codes)


def test_hadamard_is_orthonormal():
    h = hadamard(16)
    np.testing.assert_allclose(h @ h.T, np.eye(16), atol=1e-6)
    assert hadamard(12) is None


@pytest.mark.parametrize("groups,rotate", [(1, False), (4, False), (4, True), (2, True)])
def test_scaled_attention_equals_attention_over_dequantized_keys(groups, rotate):
    """The kernel never dequantizes (nor un-rotates the cache), but must equal dense
    attention on the dequantized (and rotated back) K/V."""
    kq_, kv_, kk = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(kq_, (2, 3, 4, 16))  # [B, S, H, Dh], GQA group 2
    k = jax.random.normal(kk, (2, 2, 10, 16))  # [B, Hkv, T, Dh]
    v = jax.random.normal(kv_, (2, 2, 10, 16))
    rot = jnp.asarray(hadamard(16)) if rotate else jnp.eye(16)  # [Dh, Dh]
    kc, ks = quantize(k @ rot, 8, groups, jnp.float32)
    vc, vs = quantize(v @ rot, 8, groups // 2 or 1, jnp.float32)
    positions = jnp.arange(10, dtype=jnp.int32)
    q_pos = jnp.array([[4, 5, 6], [7, 8, 9]], jnp.int32)
    got = attend_blocks(q, q_pos, [KeyBlock(k=kc, v=vc, positions=positions, k_scale=ks,
                                            v_scale=vs, rotation=rot if rotate else None)],
                        scale=0.25, window=5)
    k_back, v_back = dequantize(kc, ks, 8) @ rot.T, dequantize(vc, vs, 8) @ rot.T
    ref = attend_blocks(q, q_pos, [KeyBlock(k=k_back, v=v_back, positions=positions)],
                        scale=0.25, window=5)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_residual_window_is_chunking_independent():
    """Keys younger than residual_length are read in full precision: a prefill of the whole
    sequence equals token-by-token decoding, and equals the dense cache on recent keys."""
    model = jaxgen.models.Llama(jaxgen.models.LlamaConfig(
        vocab_size=32, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=8))
    params = model.init_params(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (1, 12), 0, 32)
    positions = jnp.arange(12, dtype=jnp.int32)[None]
    jitted = jax.jit(lambda prm, c, t, p: model(prm, t, p, c))
    forward = lambda c, t, p: jitted(params, c, t, p)  # noqa: E731
    cfg = {"residual_length": 4, "rollback_slack": 0}
    full = forward(model.init_cache(1, 16, kind="quantized", cache_config=cfg), tokens, positions)
    cache = model.init_cache(1, 16, kind="quantized", cache_config=cfg)
    steps = []
    for i in range(12):
        out = forward(cache, tokens[:, i:i + 1], positions[:, i:i + 1])
        cache = out.cache
        steps.append(out.logits[0, 0])
    np.testing.assert_allclose(np.stack(steps), full.logits[0], rtol=2e-5, atol=2e-5)
    dense = forward(model.init_cache(1, 16), tokens, positions)
    # Up to 4 tokens every key is inside the full-precision window: exactly the dense result.
    np.testing.assert_allclose(full.logits[0, :4], dense.logits[0, :4], rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- SmolLM2
@pytest.fixture(scope="module")
def smollm2():
    return jaxgen.models.load("smollm2-135m-instruct")


def greedy(model, params, prompts, new_tokens, kind=None, cache_config=None):
    cfg = GenerationConfig(max_new_tokens=new_tokens, cache_implementation=kind,
                           cache_config=cache_config, eos_token_id=None, pad_token_id=2)
    out = jaxgen.generate(params, jaxgen.init_state(model, prompts, cfg), cfg)
    return np.asarray(out.sequences), np.asarray(out.prompt_lengths), out.state.cache


def generated(seq, plen, n):
    return np.stack([seq[b, plen[b]:plen[b] + n] for b in range(seq.shape[0])])  # [B, n]


def agreement_report(model, params, tok, prompts, new_tokens, cache_config=None) -> dict:
    """Dense vs quantized: free-running greedy agreement, and teacher-forced logits
    (max |diff|, KL(dense || quantized), argmax agreement) on the dense continuation."""
    ids = [tok.encode(p) for p in prompts]
    dense_seq, plen, dense_cache = greedy(model, params, ids, new_tokens)
    q_seq, _, q_cache = greedy(model, params, ids, new_tokens, "quantized", cache_config)
    dense_new, q_new = generated(dense_seq, plen, new_tokens), generated(q_seq, plen, new_tokens)
    # Teacher forcing: one forward over prompt + dense continuation with each cache kind.
    width = dense_seq.shape[1]
    tokens = jnp.asarray(dense_seq)
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), tokens.shape)
    forward = jax.jit(lambda p, t, pos, c: model(p, t, pos, c).logits)
    ref = np.asarray(forward(params, tokens, positions, model.init_cache(len(ids), width)))
    got = np.asarray(forward(params, tokens, positions, model.init_cache(
        len(ids), width, kind="quantized", cache_config=cache_config)))
    rows = [np.arange(plen[b] - 1, plen[b] - 1 + new_tokens) for b in range(len(ids))]
    ref = np.stack([ref[b, r] for b, r in enumerate(rows)])  # [B, n, V]
    got = np.stack([got[b, r] for b, r in enumerate(rows)])
    logp = jax.nn.log_softmax(ref, -1)
    logq = jax.nn.log_softmax(got, -1)
    kl = np.asarray(jnp.sum(jnp.exp(logp) * (logp - logq), -1))  # [B, n]
    # jaxgen/api/quantized_agreement.py's rule: a row agrees when its continuation equals the dense
    # one or first departs where the dense logit of the quantized choice is within TIE_GAP
    # of the dense top logit (up to there the prefixes, so the teacher-forced logits, match)
    near_tie = []
    for b in range(len(ids)):
        differ = np.flatnonzero(dense_new[b] != q_new[b])
        first = int(differ[0]) if differ.size else None
        near_tie.append(first is None or float(
            ref[b, first, dense_new[b, first]] - ref[b, first, q_new[b, first]]) < TIE_GAP)
    return dict(
        rows_equal_or_near_tie=float(np.mean(near_tie)),
        free_running=float(np.mean(dense_new == q_new)),
        teacher_forced=float(np.mean(ref.argmax(-1) == got.argmax(-1))),
        max_abs_logit_diff=float(np.max(np.abs(ref - got))),
        mean_kl=float(kl.mean()), max_kl=float(kl.max()),
        bytes_ratio=q_cache.nbytes() / dense_cache.nbytes())


@pytest.mark.slow
def test_int8_smollm2_logits_agreement_and_bytes(smollm2):
    model, params, tok = smollm2
    report = agreement_report(model, params, tok, PROMPTS[:4], 32)
    print("\nint8 vs dense, SmolLM2-135M, 4 prompts x 32 tokens:", report)
    assert report["teacher_forced"] >= 0.97
    assert report["free_running"] >= 0.90
    # Per-token absmax without rotation: mean KL ~1.2e-3, max |diff| ~3.6 (20 x 128).
    assert report["mean_kl"] < 6e-4 and report["max_abs_logit_diff"] < 1.5
    assert report["bytes_ratio"] <= 0.30


def test_int8_cache_bytes_vs_fp32_and_bf16(smollm2):
    model = smollm2[0]
    shapes = lambda kind, dtype: jax.eval_shape(  # noqa: E731
        lambda: model.init_cache(4, 1024, dtype, kind=kind))
    nbytes = lambda tree: sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))  # noqa
    for dtype, bound in ((jnp.float32, 0.30), (jnp.bfloat16, 0.55)):
        ratio = nbytes(shapes("quantized", dtype)) / nbytes(shapes("static", dtype))
        assert ratio <= bound, (dtype, ratio)


@pytest.mark.slow
def test_int8_smollm2_greedy_agreement_20_prompts_x_128(smollm2):
    model, params, tok = smollm2
    report = agreement_report(model, params, tok, PROMPTS, 128)
    print("\nint8 vs dense, SmolLM2-135M, 20 prompts x 128 tokens:", report)
    # Measured (rotated K/V, 4 key + 2 value scales): free-running 0.75-0.80 (it moves with
    # the weights' layout: the dense continuations hold 7 positions with a top-2 logit gap
    # < 0.005, and one flip there makes every later position of the row differ),
    # teacher-forced 0.997, mean KL 1.7e-4, max |diff| 0.8, bytes 0.297. Unrotated per-token
    # absmax: free-running 0.55, 0.988, 1.2e-3, 3.6. So rows are judged by where they first
    # depart (jaxgen/api/quantized_agreement.py's near-tie rule), and free-running agreement only
    # has to stay well above the unrotated scheme's.
    assert report["rows_equal_or_near_tie"] >= 0.95
    assert report["free_running"] >= 0.65
    assert report["teacher_forced"] >= 0.99
    assert report["mean_kl"] < 4e-4
    assert report["bytes_ratio"] <= 0.30


@pytest.mark.parametrize("config", [
    {"nbits": 8, "residual_length": 40},
    pytest.param({"nbits": 8}, marks=pytest.mark.slow),
    pytest.param({"nbits": 8, "q_group_size": 16}, marks=pytest.mark.slow)])
def test_long_quantized_layers_read_in_key_chunks_give_the_whole_layer_attention(
        config, monkeypatch):
    """Past 2 * KEY_CHUNK keys int8 codes are read chunk by chunk (online softmax, the last
    chunk overlapping the one before); outputs equal the one-softmax read of the layer."""
    from jaxgen.cache import attention, make_cache

    cache = make_cache("quantized", num_layers=1, batch=2, max_len=1100, num_kv_heads=2,
                       head_dim=32, cache_config=config)
    keys = jax.random.normal(jax.random.key(0), (2, 2, 1100, 2, 32))  # [K|V, B, T, Hkv, Dh]
    cache = cache.update(0, keys[0], keys[1], jnp.arange(1100)[None].repeat(2, 0))
    lengths = jnp.array([1090, 700])  # one row inside the overlap, one short
    cache = cache.with_length(lengths)
    q = jax.random.normal(jax.random.key(1), (2, 3, 4, 32))  # [B, S, H, Dh]: 3 queries
    positions = lengths[:, None] - 3 + jnp.arange(3)[None]  # [B, S]
    for window in (None, 600):
        with monkeypatch.context() as patch:
            patch.setattr(attention, "KEY_CHUNK", 512)  # 3 chunks, the last overlapping
            chunked = cache.attend(0, q, positions, scale=0.2, window=window)  # [B, S, H, Dh]
        with monkeypatch.context() as patch:
            patch.setattr(attention, "KEY_CHUNK", 4096)  # one block, one softmax
            whole = cache.attend(0, q, positions, scale=0.2, window=window)
        np.testing.assert_allclose(chunked, whole, atol=2e-5, rtol=1e-4)
