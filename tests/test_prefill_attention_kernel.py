"""The native prefill-attention kernel against the portable attention (jaxgen.cache.attention),
and generate() running it through the CPU backend's cache classes for long prompts."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgen.backends.cpu.kernels import prefill_attention as kernel
from jaxgen.cache.attention import KeyBlock, attend_blocks
from test_decode_attention_kernel import _random

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU kernel")


@pytest.fixture(autouse=True)
def _built(monkeypatch):
    monkeypatch.delenv("JAXGEN_CPU_KERNELS", raising=False)
    assert kernel.available(), "the kernel must build on the test machine (a C++ compiler)"


def _portable(q, k, v, positions, scale, window=None):
    keys = k.shape[2]
    block = KeyBlock(k=k, v=v, positions=jnp.arange(keys, dtype=jnp.int32), ordered=True)
    return attend_blocks(q, positions, [block], scale=scale, window=window)


# (batch, queries, heads, kv heads, keys, head_dim, window, first position): a prefill from 0
# (SmolLM2's grouping), a later chunk of one over the keys before it, single and many heads a
# group, head dims a multiple of 8 but not of 16 or of 64, key counts off the 32 / 64-key
# chunks, query counts off the unit and row-tile sizes, windows inside and across chunks
CASES = [(1, 512, 9, 3, 513, 64, None, 0), (2, 100, 4, 2, 300, 72, None, 150),
         (1, 70, 8, 1, 70, 128, 20, 0), (1, 200, 6, 6, 260, 40, None, 5),
         (1, 33, 16, 2, 65, 8, None, 31), (3, 130, 2, 1, 400, 256, 97, 200),
         (1, 257, 12, 4, 1000, 64, 64, 700)]


@pytest.mark.parametrize("batch, seq, heads, kv_heads, keys, dim, window, first", CASES)
def test_kernel_equals_the_portable_attention(batch, seq, heads, kv_heads, keys, dim, window,
                                              first):
    q = _random((batch, seq, heads, dim), 0)
    k, v = _random((batch, kv_heads, keys, dim), 1), _random((batch, kv_heads, keys, dim), 2)
    starts = first + np.arange(batch)[:, None] * 7 % max(keys - seq - first, 1)
    positions = jnp.asarray(starts + np.arange(seq)[None], jnp.int32)  # [B, S]
    want = _portable(q, k, v, positions, dim ** -0.5, window)
    got = jax.jit(lambda q: kernel.prefill_attention(q, k, v, positions, scale=dim ** -0.5,
                                                     window=window))(q)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("batch, seq, heads, kv_heads, keys, dim, window, first", CASES[:4])
def test_int8_kernel_equals_the_portable_attention_over_codes(batch, seq, heads, kv_heads,
                                                              keys, dim, window, first):
    from jaxgen.cache.int8 import quantize

    q = _random((batch, seq, heads, dim), 20)
    k, v = _random((batch, kv_heads, keys, dim), 21), _random((batch, kv_heads, keys, dim), 22)
    groups = (max(dim // 16, 1), max(dim // 32, 1)) if dim % 16 == 0 else (1, dim // 8)
    kq, ks = quantize(k, 8, groups[0], jnp.float32)  # [B, Hkv, T, D], [B, Hkv, T, Nk]
    vq, vs = quantize(v, 8, groups[1], jnp.float32)
    positions = jnp.asarray(first + np.arange(seq)[None].repeat(batch, 0), jnp.int32)  # [B, S]
    block = KeyBlock(k=kq, v=vq, positions=jnp.arange(keys, dtype=jnp.int32), k_scale=ks,
                     v_scale=vs)
    want = attend_blocks(q, positions, [block], scale=dim ** -0.5, window=window)
    got = kernel.prefill_attention(q, kq, vq, positions, scale=dim ** -0.5, window=window,
                                   k_scale=ks, v_scale=vs)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("scale", [0.25, 1.0])
def test_scores_that_keep_rising_along_the_keys_rescale_the_running_sums(scale):
    """Keys whose size grows along the sequence: each later chunk's scores pass the running
    reference max by more than its margin, so rows rescale what they summed (the kernel's
    exponentials then also see arguments up to the margin above 0)."""
    q = _random((1, 150, 4, 16), 13)
    growth = jnp.linspace(0.1, 30.0, 300)[None, None, :, None]  # [1, 1, T, 1]
    k, v = _random((1, 2, 300, 16), 14) * growth, _random((1, 2, 300, 16), 15)
    positions = jnp.arange(150, 300, dtype=jnp.int32)[None]  # [B, S]
    got = kernel.prefill_attention(q, k, v, positions, scale=scale)
    np.testing.assert_allclose(got, _portable(q, k, v, positions, scale), rtol=2e-4, atol=1e-5)


def test_queries_in_any_order_and_rows_that_see_nothing():
    """Positions need not increase along the sequence; a query at -1 (an empty slot) gets
    zeros, its neighbours in the same row tile are unaffected."""
    q = _random((1, 40, 6, 16), 3)
    k, v = _random((1, 2, 90, 16), 4), _random((1, 2, 90, 16), 5)
    order = np.random.RandomState(6).permutation(80)[:40]
    positions = jnp.asarray(order[None], jnp.int32).at[0, 7].set(-1).at[0, 30].set(-1)
    got = kernel.prefill_attention(q, k, v, positions, scale=0.25)
    assert not np.asarray(got[0, 7]).any() and not np.asarray(got[0, 30]).any()
    seen = np.asarray(positions[0]) >= 0
    want = _portable(q[:, seen], k, v, positions[:, seen], 0.25)
    np.testing.assert_allclose(got[:, seen], want, rtol=1e-5, atol=2e-6)


def test_positions_past_the_cache_see_every_key_and_later_keys_are_never_read():
    q = _random((1, 30, 2, 8), 7)
    k, v = _random((1, 1, 200, 8), 8), _random((1, 1, 200, 8), 9)
    positions = jnp.asarray([list(range(100, 129)) + [2**31 - 1]], jnp.int32)
    want = _portable(q, k, v, positions, 0.5)
    np.testing.assert_allclose(kernel.prefill_attention(q, k, v, positions, scale=0.5), want,
                               rtol=1e-5, atol=2e-6)
    # keys past every query's position: garbage there must not reach the output
    positions = jnp.arange(50, 80, dtype=jnp.int32)[None]
    spoiled = [a.at[:, :, 80:].set(jnp.nan) for a in (k, v)]
    got = kernel.prefill_attention(q, *spoiled, positions, scale=0.5)
    np.testing.assert_allclose(got, _portable(q, k, v, positions, 0.5), rtol=1e-5, atol=2e-6)


def test_kernel_under_vmap_equals_each_mapped_row():
    q = _random((2, 1, 24, 4, 8), 10)  # [A, B, S, H, D]
    k, v = _random((2, 1, 2, 30, 8), 11), _random((2, 1, 2, 30, 8), 12)  # [A, B, Hkv, T, D]
    positions = jnp.stack([jnp.arange(24)[None], jnp.arange(6, 30)[None]]).astype(jnp.int32)
    mapped = jax.vmap(lambda *a: kernel.prefill_attention(*a, scale=0.5))(q, k, v, positions)
    for index in range(2):
        one = kernel.prefill_attention(q[index], k[index], v[index], positions[index], scale=0.5)
        np.testing.assert_allclose(mapped[index], one, rtol=1e-6)


def test_shapes_the_kernel_does_not_take_are_refused():
    assert kernel.runs(9, 3, 64) and kernel.runs(8, 8, 72)
    assert not kernel.runs(9, 2, 64)  # heads not a multiple of the KV heads
    assert not kernel.runs(4, 2, 60)  # not a multiple of 8


def _setup(monkeypatch, prompt_length: int, window=None, cache=None):
    import jaxgen
    from jaxgen.backends.cpu import layer_split
    from jaxgen.models import tiny_llama

    monkeypatch.setattr(layer_split, "SPLIT_MIN_BYTES", 0)
    model, params = tiny_llama(num_layers=2, num_heads=6, num_kv_heads=2, head_dim=32,
                               hidden_size=48, vocab_size=300, max_position_embeddings=512,
                               sliding_window=window)
    extra = {} if cache is None else dict(cache_implementation=cache[0], cache_config=cache[1])
    cfg = jaxgen.GenerationConfig(max_new_tokens=8, pad_token_id=0, eos_token_id=None, **extra)
    rows = np.random.RandomState(13).randint(1, 300, size=(2, prompt_length)).tolist()
    state = jaxgen.init_state(model, [rows[0], rows[1][:prompt_length // 2]], cfg)
    return params, state, cfg


@pytest.mark.parametrize("window, cache, target", [
    (None, None, "jaxgen_prefill_attention_dense"), (24, None, "jaxgen_prefill_attention_dense"),
    (None, ("quantized", {"nbits": 8}), "jaxgen_prefill_attention_codes")])
def test_generate_with_a_long_prompt_runs_the_kernel_and_gives_the_portable_tokens(monkeypatch,
                                                                                  window, cache,
                                                                                  target):
    import jaxgen
    from jaxgen.loops.decode import DecodeLoop
    from jaxgen.runtime import compiled

    params, state, cfg = _setup(monkeypatch, 90, window, cache)
    program = compiled._run_kept.lower(params, state, cfg, None, loop=DecodeLoop(),
                                       layout="split").as_text()
    assert target in program, "the CPU prefill skips the kernel"
    split = jaxgen.generate(params, state, cfg, layout="split")
    params, state, cfg = _setup(monkeypatch, 90, window, cache)  # the state was donated
    portable = jaxgen.generate(params, state, cfg, layout="portable")
    assert jnp.array_equal(split.sequences, portable.sequences)
