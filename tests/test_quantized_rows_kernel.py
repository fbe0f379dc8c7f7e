"""The native quantized kernel (jaxgen/backends/cpu/kernels/quantized_rows) against XLA's products with the
expanded weights, QuantizedKernelMatrix, and generate() running it on int8 and GGUF weights."""
import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgen.backends.cpu.kernel_matrix import kernel_layers, kernel_stacks
from jaxgen.backends.cpu.kernels.quantized_rows import (
    available,
    expand,
    quantized_product,
    rounded_row_limit,
    rounded_rows,
    runs,
    stacked_max_rows,
)
from jaxgen.backends.cpu.quantized_kernel_matrix import (
    QuantizedKernelMatrix,
    kernel_takes,
)
from jaxgen.backends.cpu.tuning import (
    INTEL_AVX512_STACKED_KERNEL_MAX_ROWS,
    INTEL_AVX512_STACKED_NIBBLE_KERNEL_MAX_ROWS,
    KERNEL_MAX_ROWS,
    STACKED_KERNEL_MAX_ROWS,
)
from jaxgen.models.gguf_blocks import block_matrix
from jaxgen.models.quantize import Int8Matrix, quantize_matrix

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU kernel")
TARGET = "jaxgen_quantized_rows"


@pytest.fixture(autouse=True)
def _built(monkeypatch):
    monkeypatch.delenv("JAXGEN_CPU_KERNELS", raising=False)
    assert available(), "the kernel must build on the test machine (a C++ compiler is there)"


def _weights(kind, lead, n, k, groups, seed):
    """(codes, scale, offset, code_offset) of `kind` with random codes [*lead, N, ...]."""
    rng = np.random.default_rng(seed)
    scale_dtype = jnp.float32 if kind.startswith("int8") else jnp.float16
    scale = jnp.asarray(rng.random(lead + (n, groups)) * 0.1 + 0.01, scale_dtype)  # [..., N, G]
    if kind.startswith("int8") or kind == "Q8_0":
        return jnp.asarray(rng.integers(-127, 128, lead + (n, k)), jnp.int8), scale, None, 0
    codes = jnp.asarray(rng.integers(0, 256, lead + (n, k // 2)), jnp.uint8)  # [..., N, K / 2]
    if kind == "Q4_0":
        return codes, scale, None, 8
    return codes, scale, jnp.asarray(rng.standard_normal(lead + (n, groups)) * 0.1,
                                     jnp.float16), 0


# (kind, K, groups): per-channel and grouped int8 (groups of 8: the 8-input tail path; of 32:
# the blocks' path; of 104: three blocks, two a turn with AVX-512's 16 lanes and one left, then
# an 8-input tail), GGUF's 32-input blocks; N off the 64-row blocks.
FORMATS = [("int8", 96, 1), ("int8-groups", 96, 12), ("int8-blocks", 96, 3),
           ("int8-long", 208, 2), ("Q8_0", 64, 2), ("Q4_0", 64, 2), ("Q4_1", 128, 4)]


@pytest.mark.parametrize("kind, k, groups", FORMATS, ids=[f[0] for f in FORMATS])
@pytest.mark.parametrize("lead", [(1,), (2,), (3,), (4,), (5,), (9,), (2, 4),
                                  (KERNEL_MAX_ROWS,)])
def test_product_equals_xla_with_the_expanded_weight(kind, k, groups, lead):
    # the fused path's rows and past them the widened tiles, on either side of each build's
    # bound (fused_max_rows: 3 rows on AVX2; 8 with AVX-512, on Intel 1 of 4-bit codes and 4 of
    # Q8_0 blocks)
    codes, scale, offset, code_offset = _weights(kind, (), 131, k, groups, seed=len(lead))
    x = jnp.asarray(np.random.default_rng(1).standard_normal(lead + (k,)), jnp.float32)
    got = jax.jit(quantized_product, static_argnums=(4, 5))(x, codes, scale, offset,
                                                            code_offset, None)  # [..., N]
    weight = expand(codes, scale, offset, code_offset)  # [N, K]
    # the rows as the kernel sees them (int16 codes of each 32-input block on AVX2 builds)
    seen = rounded_rows(x, groups)  # [..., K]
    want = jnp.einsum("...k,nk->...n", seen, weight, precision="highest")
    assert got.shape == lead + (131,)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))
    # and within the rounding's bound of the float rows' product: K x max|x| / 65534 x max|w|
    exact = jnp.einsum("...k,nk->...n", x, weight, precision="highest")
    bound = k * float(jnp.abs(x).max()) / 65534 * float(jnp.abs(weight).max())
    np.testing.assert_allclose(got, exact, rtol=1e-5, atol=bound + 1e-5 * float(jnp.abs(exact).max()))


def test_rows_are_rounded_per_block_only_up_to_the_limit():
    # one block with a large input beside a small one: its own step loses the small one,
    # the next block's small inputs keep theirs
    codes, scale, _, _ = _weights("int8", (), 1, 64, 1, seed=9)
    codes = jnp.ones_like(codes)  # w = scale: the product sums the inputs
    x = jnp.zeros((1, 64)).at[0, 0].set(1e4).at[0, 1].set(0.1).at[0, 33].set(0.1)  # [1, K]
    got = float(quantized_product(x, codes, scale)[0, 0] / scale[0, 0])
    rounds = rounded_row_limit() >= 1
    want = 1e4 + (0.1 if rounds else 0.2)  # 0.1 in block 0 is below its step (0.31)
    assert abs(got - want) < 0.05  # float32 around 1e4: steps of 1e-3
    assert (rounded_rows(x, 1)[0, 1] == 0.0) == rounds
    many = jnp.tile(x, (rounded_row_limit() + 1, 1))  # past the limit: float rows
    np.testing.assert_array_equal(rounded_rows(many, 1), many)


def test_expand_follows_the_gguf_nibble_order_and_the_code_offset():
    # byte j of a 32-input block: input j in the low nibble, input j + 16 in the high one
    raw = np.zeros((1, 16), np.uint8)
    raw[0, 0], raw[0, 3] = 0x21, 0xF0  # inputs 0 and 16 = 1 and 2; input 19 = 15
    values = expand(jnp.asarray(raw), jnp.ones((1, 1)), None, code_offset=8)[0]  # [32]
    want = np.full(32, -8.0)
    want[[0, 16, 3, 19]] = [-7.0, -6.0, -8.0, 7.0]
    np.testing.assert_array_equal(np.asarray(values), want)


def test_the_named_layer_of_a_stack_is_read_in_place_and_a_bad_layer_is_an_error():
    codes, scale, offset, code_offset = _weights("Q4_1", (3,), 70, 64, 2, seed=2)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 64)), jnp.float32)
    for layer in range(3):
        got = quantized_product(x, codes, scale, offset, code_offset, layer)  # [2, 70]
        want = rounded_rows(x, 2) @ expand(codes[layer], scale[layer], offset[layer]).T
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    with pytest.raises(Exception, match="layer outside the weight stack"):
        jax.block_until_ready(quantized_product(x, codes, scale, offset, code_offset, 3))


def test_under_vmap_with_a_shared_and_a_mapped_weight():
    codes, scale, _, _ = _weights("int8", (), 20, 32, 1, seed=4)
    x = jnp.asarray(np.random.default_rng(5).standard_normal((3, 2, 32)), jnp.float32)
    shared = jax.vmap(quantized_product, in_axes=(0, None, None))(x, codes, scale)
    np.testing.assert_allclose(shared, x @ expand(codes, scale).T, rtol=1e-5, atol=1e-4)
    stacked_codes, stacked_scale, _, _ = _weights("int8", (3,), 20, 32, 1, seed=6)
    mapped = jax.vmap(quantized_product)(x, stacked_codes, stacked_scale)
    want = jnp.einsum("amk,ank->amn", x, expand(stacked_codes, stacked_scale))
    np.testing.assert_allclose(mapped, want, rtol=1e-5, atol=1e-4)


def test_which_groups_the_kernel_takes():
    assert runs(96, jnp.int8, 12) and runs(96, jnp.int8, 1) and runs(64, jnp.uint8, 2)
    assert not runs(96, jnp.int8, 24)  # groups of 4 inputs
    assert not runs(96, jnp.uint8, 2)  # 4-bit groups of 48: blocks of 32 would straddle them
    assert not runs(0, jnp.int8, 1) and not runs(96, jnp.int8, 0)
    w = jax.random.normal(jax.random.key(0), (24, 8))  # [K, N]
    assert kernel_takes(quantize_matrix(w)) and kernel_takes(quantize_matrix(w, group=8))
    assert not kernel_takes(quantize_matrix(w, group=4)) and not kernel_takes(w)


def _block(kind, out, inputs, seed):
    w = np.random.default_rng(seed).standard_normal((out, inputs)).astype(np.float32)  # [N, K]
    return block_matrix(gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind]), kind,
                        (out, inputs))


@pytest.mark.parametrize("source", ["int8", "int8-groups", "Q8_0", "Q4_0", "Q4_1"])
def test_quantized_kernel_matrix_stands_for_its_weight_and_falls_back_past_the_bound(source):
    if source.startswith("int8"):
        weight = jax.random.normal(jax.random.key(1), (3, 64, 40))  # [L, K, N]
        matrix = quantize_matrix(weight, group=16 if source == "int8-groups" else None)
    else:
        matrix = jax.tree_util.tree_map(lambda *a: jnp.stack(a),
                                        *[_block(source, 40, 64, seed) for seed in range(3)])
    transposed, others = kernel_stacks({"wq": matrix, "attn_norm": jnp.ones((3, 64))})
    per_layer = kernel_layers(transposed, others)
    stacked = per_layer[2]["wq"]
    assert isinstance(stacked, QuantizedKernelMatrix) and stacked.layer == 2
    assert stacked.shape == (64, 40) and stacked.dtype == jnp.float32
    own = QuantizedKernelMatrix.of(jax.tree_util.tree_map(lambda a: a[2], matrix))
    dense = matrix.dequantize()[2]  # [K, N]
    np.testing.assert_array_equal(np.asarray(own.dequantize()), np.asarray(dense))
    groups = {"int8": 1, "int8-groups": 4}.get(source, 2)  # of the 64 inputs
    stacked_bound = stacked_max_rows(stacked.codes_nk.dtype)  # this host's (tuning.py)
    for rows in (1, 2, KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 1, stacked_bound, stacked_bound + 1):
        x = jax.random.normal(jax.random.key(rows), (rows, 1, 64))
        seen = rounded_rows(x, groups) if rows <= stacked_bound else x
        for m, bound in ((stacked, stacked_bound), (own, KERNEL_MAX_ROWS)):
            lowered = jax.jit(lambda x, m: x @ m).lower(x, m).as_text()
            assert (TARGET in lowered) == (rows <= bound), (rows, m.layer)
            np.testing.assert_allclose(x @ m, (seen if rows <= bound else x) @ dense,
                                       rtol=1e-5, atol=1e-4)


def test_a_matrix_the_kernel_does_not_take_stays_as_it_is():
    matrix = quantize_matrix(jax.random.normal(jax.random.key(2), (2, 24, 8)), group=4)
    transposed, others = kernel_stacks({"wq": matrix})
    assert transposed == {} and isinstance(others[1]["wq"], Int8Matrix)


def _tiny_gguf(tmp_path, kind):
    from tests.test_weights_gguf import quantized_file

    return quantized_file(tmp_path, gguf.GGMLQuantizationType[kind], tied=kind != "Q4_1",
                          head_kind=gguf.GGMLQuantizationType.Q8_0 if kind == "Q4_1" else None)


def test_one_row_programs_take_the_kernel_whatever_the_row_group(monkeypatch):
    # the kernel streams each weight row whole for one input row: measured faster than XLA's
    # matrix-vector products on the 4-row (AVX2) and the 8-row (AVX-512) builds, and XLA
    # expands quantized weights in memory before each product
    from jaxgen.backends.cpu import layer_split
    from jaxgen.models import tiny_llama
    from jaxgen.models.quantize import quantize_params

    monkeypatch.setattr(layer_split, "SPLIT_MIN_BYTES", 0)
    model, params = tiny_llama(hidden_size=24, intermediate_size=40)
    for group in (4, 8):
        monkeypatch.setattr(layer_split.few_rows, "group_rows", lambda group=group: group)
        assert layer_split.decoding_plan(model, params, 1)["kernel"]
        assert layer_split.decoding_plan(model, quantize_params(model.config, params), 1)["kernel"]
    monkeypatch.setattr(layer_split.few_rows, "available", lambda: False)
    assert layer_split.decoding_plan(model, params, 1)["kernel"] is False


def _params(tmp_path, source):
    from jaxgen.models import load, tiny_llama
    from jaxgen.models.quantize import quantize_params

    if source.startswith("int8"):
        model, params = tiny_llama(num_layers=3, intermediate_size=40, hidden_size=24)
        return model, quantize_params(model.config, params, group=8 if "groups" in source else None)
    model, params, _ = load(_tiny_gguf(tmp_path, source), weights="gguf")
    return model, params


@pytest.mark.parametrize("source, batch, settings", [
    ("int8", 1, {}), ("int8-groups", 3, {}), ("Q4_0", 2, {}), ("Q8_0", 8, {}),
    ("Q4_1", 1, {"num_beams": 3}),
    pytest.param("int8", 2, {"prompt_lookup_num_tokens": 2}, marks=pytest.mark.slow),
])
def test_generate_on_quantized_weights_with_the_kernel_gives_xla_s_tokens(
        monkeypatch, tmp_path, source, batch, settings):
    import jaxgen
    from jaxgen.backends.cpu import layer_split
    from jaxgen.loops.decode import DecodeLoop
    from jaxgen.runtime import compiled

    monkeypatch.setattr(layer_split, "SPLIT_MIN_BYTES", 0)
    model, params = _params(tmp_path, source)
    prompts = [[3, 1, 4, 1, 5][: 2 + b % 3] for b in range(batch)]
    cfg = jaxgen.GenerationConfig(max_new_tokens=6, pad_token_id=0, **settings)
    runs_ = {}
    for setting in ("auto", "off"):
        monkeypatch.setenv("JAXGEN_CPU_KERNELS", setting)
        jax.clear_caches()  # the setting is read at trace time
        compiled._LAID_OUT.clear()
        state = jaxgen.init_state(model, prompts, cfg)
        lowered = compiled._run_kept.lower(params, state, cfg, None, loop=DecodeLoop(),
                                           layout="auto").as_text()
        assert (TARGET in lowered) == (setting == "auto"), setting
        runs_[setting] = jaxgen.generate(params, state, cfg)
    assert jnp.array_equal(runs_["auto"].sequences, runs_["off"].sequences)
    if "num_beams" in settings:
        np.testing.assert_allclose(runs_["auto"].sequences_scores, runs_["off"].sequences_scores,
                                   atol=1e-5)


def test_second_call_on_quantized_weights_does_not_recompile(monkeypatch, tmp_path):
    import jaxgen
    from jaxgen.backends.cpu import layer_split
    from jaxgen.runtime.compiled import trace_count

    monkeypatch.setattr(layer_split, "SPLIT_MIN_BYTES", 0)
    model, params = _params(tmp_path, "Q4_1")
    cfg = jaxgen.GenerationConfig(max_new_tokens=4, pad_token_id=0)
    first = jaxgen.generate(params, jaxgen.init_state(model, [[3, 1], [4, 1, 5]], cfg), cfg)
    before = trace_count()
    again = jaxgen.generate(params, jaxgen.init_state(model, [[2, 7], [9, 1, 5]], cfg), cfg)
    assert trace_count() == before and again.sequences.shape == first.sequences.shape


def test_draft_vocab_reads_the_kernel_layout_head(tmp_path):
    from jaxgen.backends.cpu.layer_split import split_layers
    from jaxgen.models.draft_vocab import restricted_logits

    model, params = _params(tmp_path, "Q4_1")  # an untied Q8_0 head
    laid_out = split_layers(params, fuse=True, kernel=True)
    assert isinstance(laid_out["lm_head"], QuantizedKernelMatrix)
    vocab = tuple(range(0, 48, 5))
    hidden = jax.random.normal(jax.random.key(3), (1, 2, 32))  # [B, S, D]
    np.testing.assert_allclose(restricted_logits(model, laid_out, hidden, vocab),
                               restricted_logits(model, params, hidden, vocab),
                               rtol=1e-5, atol=1e-5)  # [B, S, V_d]


def test_a_stacked_layers_row_bound_is_this_hosts():
    """Intel AVX-512 hosts hand a quantized stack's layer to XLA sooner (tuning.py), int8
    codes sooner than 4-bit ones."""
    import platform

    from jaxgen.backends.cpu.kernels.build import arch_flags

    cpuinfo = open("/proc/cpuinfo").read() if platform.system() == "Linux" else ""
    native = arch_flags() == ("-march=native",)  # else an AVX2 build (test_kernel_arch)
    intel_avx512 = "avx512f" in cpuinfo.split() and "GenuineIntel" in cpuinfo and native
    want = ((INTEL_AVX512_STACKED_KERNEL_MAX_ROWS, INTEL_AVX512_STACKED_NIBBLE_KERNEL_MAX_ROWS)
            if intel_avx512 else (STACKED_KERNEL_MAX_ROWS, STACKED_KERNEL_MAX_ROWS))
    assert (stacked_max_rows(jnp.int8), stacked_max_rows(jnp.uint8)) == want
