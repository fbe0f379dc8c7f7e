"""The native decode-attention kernel against the portable attention (jaxgen.cache.attention),
and generate() running it through the CPU backend's cache classes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgen.backends.cpu.kernels import decode_attention as kernel
from jaxgen.cache.attention import KeyBlock, attend_blocks
from jaxgen.cache.attention import heads_out as _heads
from jaxgen.cache.attention import query_rows as _rows
from jaxgen.cache.int8 import quantize

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU kernel")


@pytest.fixture(autouse=True)
def _built(monkeypatch):
    monkeypatch.delenv("JAXGEN_CPU_KERNELS", raising=False)
    assert kernel.available(), "the kernel must build on the test machine (a C++ compiler)"


def _random(shape, seed):
    return jnp.asarray(np.random.RandomState(seed).standard_normal(shape), jnp.float32)


# (batch, queries, heads, kv heads, keys, head_dim, window): one and several queries, grouped
# heads, key counts off the chunk sizes and the 4-stream split, windows inside a chunk, one
# head in 64 chunks, 64 heads in chunks of the largest size; rows by the score and value
# tiles (several rows a pass) with rows a window hides from a chunk between them; a chunk's
# rows in parts (a short context's few KV heads, a window hiding keys from some parts)
CASES = [(1, 1, 9, 3, 700, 64, None), (2, 4, 4, 2, 1000, 32, None), (1, 3, 2, 1, 600, 8, 100),
         (3, 1, 8, 8, 257, 64, None), (2, 16, 6, 2, 300, 16, 7), (1, 2, 1, 1, 5, 128, None),
         (1, 1, 1, 1, 20000, 8, None), (1, 1, 64, 64, 9000, 8, 8500),
         (1, 8, 6, 2, 900, 64, 50), (2, 5, 4, 1, 300, 128, None),
         (1, 8, 9, 3, 136, 64, 60)]


@pytest.mark.parametrize("batch, seq, heads, kv_heads, keys, dim, window", CASES)
def test_dense_kernel_equals_the_portable_attention(batch, seq, heads, kv_heads, keys, dim,
                                                     window):
    q = _random((batch, seq, heads, dim), 0)
    k, v = _random((batch, kv_heads, keys, dim), 1), _random((batch, kv_heads, keys, dim), 2)
    start = np.random.RandomState(3).randint(0, keys - seq + 1, size=(batch, 1))
    positions = jnp.asarray(start + np.arange(seq)[None], jnp.int32)  # [B, S]
    block = KeyBlock(k=k, v=v, positions=jnp.arange(keys, dtype=jnp.int32), ordered=True)
    want = attend_blocks(q, positions, [block], scale=dim ** -0.5, window=window)
    got = jax.jit(lambda q: _heads(kernel.decode_attention(
        _rows(q, kv_heads), k, v, positions, scale=dim ** -0.5, window=window), q))(q)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("batch, seq, heads, kv_heads, keys, dim, window",
                         CASES[:4] + CASES[-1:])
def test_int8_kernel_equals_the_portable_attention_over_codes(batch, seq, heads, kv_heads,
                                                              keys, dim, window):
    q = _random((batch, seq, heads, dim), 4)
    k, v = _random((batch, kv_heads, keys, dim), 5), _random((batch, kv_heads, keys, dim), 6)
    groups = (max(dim // 16, 1), max(dim // 32, 1))
    kq, ks = quantize(k, 8, groups[0], jnp.float32)  # [B, Hkv, T, D], [B, Hkv, T, Nk]
    vq, vs = quantize(v, 8, groups[1], jnp.float32)
    positions = jnp.full((batch, 1), keys - seq, jnp.int32) + jnp.arange(seq)  # [B, S]
    block = KeyBlock(k=kq, v=vq, positions=jnp.arange(keys, dtype=jnp.int32), k_scale=ks,
                     v_scale=vs)
    # the query as the kernel sees it (int16 codes against groups of 16 channels on AVX2)
    seen = _heads(kernel.rounded_queries(_rows(q, kv_heads), groups[0]), q)  # [B, S, H, D]
    want = attend_blocks(seen, positions, [block], scale=0.25, window=window)
    got = _heads(kernel.decode_attention(_rows(q, kv_heads), kq, vq, positions, scale=0.25,
                                         window=window, k_scale=ks, v_scale=vs), q)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)
    # and the rounding is far below the keys' own: within their error of the float query's
    exact = attend_blocks(q, positions, [block], scale=0.25, window=window)
    np.testing.assert_allclose(got, exact, rtol=0, atol=2e-4)


def test_int8_kernel_rounds_queries_to_int16_only_where_it_says():
    # a query with one channel far larger than the rest: int16 codes of it lose the small ones
    q = jnp.zeros((1, 1, 1, 16)).at[..., 0].set(1e4).at[..., 1].set(0.1)  # [B, H, R, D]
    k = jnp.zeros((1, 1, 2, 16)).at[0, 0, 1, 1].set(1.0)  # key 1 reacts to channel 1 only
    v = jnp.zeros((1, 1, 2, 16)).at[0, 0, 1, 0].set(1.0)
    kq, ks = quantize(k, 8, 1, jnp.float32)
    vq, vs = quantize(v, 8, 1, jnp.float32)
    out = kernel.decode_attention(q, kq, vq, jnp.array([[1]]), scale=100.0, k_scale=ks,
                                  v_scale=vs)
    # float query: score 10 for key 1 (weight ~1); int16 codes: 0.1 rounds to 0 (weight 1/2)
    want = 0.5 if kernel.query_bits() == 16 else 1.0
    assert abs(float(out[0, 0, 0, 0]) - want) < 1e-3
    assert (kernel.rounded_queries(q, 1)[..., 1] == 0.0).all() == (kernel.query_bits() == 16)


def test_a_query_that_sees_no_key_gets_zeros_and_others_are_unaffected():
    q, k, v = _random((2, 1, 2, 8), 7), _random((2, 2, 9, 8), 8), _random((2, 2, 9, 8), 9)
    positions = jnp.array([[-1], [4]], jnp.int32)  # row 0: an empty slot
    out = _heads(kernel.decode_attention(_rows(q, 2), k, v, positions, scale=1.0), q)
    assert not np.asarray(out[0]).any()
    block = KeyBlock(k=k[1:], v=v[1:], positions=jnp.arange(9, dtype=jnp.int32))
    want = attend_blocks(q[1:], positions[1:], [block], scale=1.0)
    np.testing.assert_allclose(out[1:], want, rtol=1e-5, atol=1e-6)


def test_rows_that_see_no_key_between_rows_that_do_get_zeros():
    q = _random((1, 4, 2, 64), 10)
    k, v = _random((1, 1, 40, 64), 11), _random((1, 1, 40, 64), 12)
    positions = jnp.array([[5, -1, 30, -1]], jnp.int32)  # [B, S]: rows 1 and 3 see nothing
    out = _heads(kernel.decode_attention(_rows(q, 1), k, v, positions, scale=0.125), q)
    assert not np.asarray(out[:, 1::2]).any()
    block = KeyBlock(k=k, v=v, positions=jnp.arange(40, dtype=jnp.int32))
    want = attend_blocks(q[:, 0::2], positions[:, 0::2], [block], scale=0.125)
    np.testing.assert_allclose(out[:, 0::2], want, rtol=1e-5, atol=2e-6)


def test_keys_past_the_query_position_are_never_read():
    # garbage (NaN) beyond the last visible key must not reach the output
    q, k, v = _random((1, 1, 1, 8), 10), _random((1, 1, 600, 8), 11), _random((1, 1, 600, 8), 12)
    k, v = k.at[:, :, 300:].set(jnp.nan), v.at[:, :, 300:].set(jnp.nan)
    out = kernel.decode_attention(_rows(q, 1), k, v, jnp.array([[299]]), scale=1.0)
    assert np.isfinite(np.asarray(out)).all()


def test_kernel_under_vmap_equals_each_mapped_row():
    q, k, v = _random((3, 1, 2, 1, 8), 13), _random((3, 1, 2, 20, 8), 14), _random((3, 1, 2, 20, 8), 15)
    positions = jnp.array([[[5]], [[19]], [[0]]], jnp.int32)
    mapped = jax.vmap(lambda *a: kernel.decode_attention(*a, scale=0.5))(q, k, v, positions)
    for index in range(3):
        one = kernel.decode_attention(q[index], k[index], v[index], positions[index], scale=0.5)
        np.testing.assert_allclose(mapped[index], one, rtol=1e-6)


def test_rows_and_head_dims_the_kernel_does_not_take_are_refused():
    assert kernel.runs(1, 64) and kernel.runs(kernel.MAX_ROWS, 64, 4, 2)
    assert not kernel.runs(kernel.MAX_ROWS + 1, 64)
    assert not kernel.runs(1, 60)  # not a multiple of 8
    assert not kernel.runs(1, 64, 16, 2)  # key groups of 4 channels


def _setup(monkeypatch, cache, **settings):
    import jaxgen
    from jaxgen.backends.cpu import layer_split
    from jaxgen.models import tiny_llama

    monkeypatch.setattr(layer_split, "SPLIT_MIN_BYTES", 0)
    model, params = tiny_llama(num_layers=2, num_heads=6, num_kv_heads=2, head_dim=32,
                               hidden_size=48, vocab_size=300, max_position_embeddings=512)
    extra = {} if cache is None else dict(cache_implementation=cache[0], cache_config=cache[1])
    cfg = jaxgen.GenerationConfig(max_new_tokens=24, pad_token_id=0, eos_token_id=None,
                                  **extra, **settings)
    state = jaxgen.init_state(model, [[5, 7, 9, 11, 13], [3, 4]], cfg, key=jax.random.key(1))
    return params, state, cfg


@pytest.mark.parametrize("cache, target", [
    (None, "jaxgen_decode_attention_dense"), (("dynamic", None), "jaxgen_decode_attention_dense"),
    (("quantized", {"nbits": 8}), "jaxgen_decode_attention_codes")])
@pytest.mark.parametrize("settings", [{}, {"do_sample": True}])
def test_generate_through_the_kernel_gives_the_portable_tokens(monkeypatch, cache, target,
                                                               settings):
    import jaxgen
    from jaxgen.loops.decode import DecodeLoop
    from jaxgen.runtime import compiled

    params, state, cfg = _setup(monkeypatch, cache, **settings)
    if cache is None or cache[0] != "dynamic":  # the growing driver runs programs of its own
        program = compiled._run_kept.lower(params, state, cfg, None, loop=DecodeLoop(),
                                           layout="split").as_text()
        assert target in program, "the CPU layout's program does not call the kernel"
    split = jaxgen.generate(params, state, cfg, layout="split")
    params, state, cfg = _setup(monkeypatch, cache, **settings)  # the state was donated
    portable = jaxgen.generate(params, state, cfg, layout="portable")
    assert jnp.array_equal(split.sequences, portable.sequences)


def test_the_caller_gets_its_own_cache_class_back(monkeypatch):
    import jaxgen
    from jaxgen.backends.cpu.kernel_attention import with_kernel_attention
    from jaxgen.backends.cpu.prepare import finish
    from jaxgen.cache import KVCache, QuantizedKVCache
    from jaxgen.cache.layer_forms import holds_layer_tuples, to_layer_tuples

    for cache in (KVCache.init(num_layers=2, batch=1, max_len=8, num_kv_heads=1, head_dim=8),
                  QuantizedKVCache.init(num_layers=2, batch=1, max_len=8, num_kv_heads=1,
                                        head_dim=8)):
        swapped = with_kernel_attention(to_layer_tuples(cache))
        assert type(swapped) is not type(cache) and isinstance(swapped, type(cache))
        state = jaxgen.core.state.DecodeState.__new__  # noqa: F841  (the state is any .replace)

        class Held:
            def __init__(self, cache):
                self.cache = cache

            def replace(self, cache):
                return Held(cache)

        stacked, kept = finish(Held(swapped)).cache, finish(Held(swapped), stack=False).cache
        assert type(stacked) is type(cache) and not holds_layer_tuples(stacked)
        assert type(kept) is type(cache) and holds_layer_tuples(kept)


def test_kernels_off_keeps_xla_attention(monkeypatch):
    from jaxgen.backends.cpu.kernel_attention import with_kernel_attention
    from jaxgen.cache import KVCache
    from jaxgen.cache.layer_forms import to_layer_tuples

    cache = to_layer_tuples(KVCache.init(num_layers=1, batch=1, max_len=8, num_kv_heads=1,
                                         head_dim=8))
    monkeypatch.setenv("JAXGEN_CPU_KERNELS", "off")
    assert type(with_kernel_attention(cache)) is KVCache


def test_positions_past_the_cache_see_every_key():
    q, k, v = _random((1, 1, 2, 8), 16), _random((1, 2, 40, 8), 17), _random((1, 2, 40, 8), 18)
    block = KeyBlock(k=k, v=v, positions=jnp.arange(40, dtype=jnp.int32))
    for position in (39, 1000, 2**31 - 1):
        positions = jnp.array([[position]], jnp.int32)
        got = _heads(kernel.decode_attention(_rows(q, 2), k, v, positions, scale=0.5), q)
        want = attend_blocks(q, positions, [block], scale=0.5)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_an_unrolled_forward_computes_rope_once_whatever_its_layers():
    from jaxgen.backends.cpu.kernel_attention import with_kernel_attention
    from jaxgen.cache.layer_forms import to_layer_tuples
    from jaxgen.models import tiny_llama
    from jaxgen.models.llama import unstack_layers

    model, params = tiny_llama(num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
                               hidden_size=32, vocab_size=64)
    per_layer = unstack_layers(model, params)
    tokens, positions = jnp.array([[3, 1, 4, 1]]), jnp.arange(5, 9)[None]  # [1, 4] each

    def forward(p, cache, positions):
        return model(p, tokens, positions, cache).logits  # [1, 4, V]

    cache = with_kernel_attention(to_layer_tuples(model.init_cache(1, 16)))
    assert hasattr(type(cache), "compute_once")
    program = jax.jit(forward).lower(per_layer, cache, positions).compile().as_text()
    # cos and sin once each per side of the branch, not once per layer's query and key
    assert program.count(" cosine(") <= 2 and program.count(" sine(") <= 2
    got = jax.jit(forward)(per_layer, cache, positions)
    want = jax.jit(forward)(params, model.init_cache(1, 16), positions)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
