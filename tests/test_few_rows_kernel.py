"""The native few-row kernel (jaxgen/kernels) against XLA's products, and generate() running it."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgen.backends.cpu.kernel_matrix import KernelMatrix, kernel_layers, kernel_stacks
from jaxgen.backends.cpu.kernels import build, few_rows
from jaxgen.backends.cpu.kernels.few_rows import available, few_rows_product
from jaxgen.backends.cpu.tuning import (
    INTEL_AVX512_KERNEL_MAX_ROWS,
    KERNEL_MAX_ROWS,
    STACKED_KERNEL_MAX_ROWS,
)

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU kernel")


@pytest.fixture(autouse=True)
def _built(monkeypatch):
    monkeypatch.delenv("JAXGEN_CPU_KERNELS", raising=False)
    assert available(), "the kernel must build on the test machine (a C++ compiler is there)"


def _random(shape, seed):
    return jnp.asarray(np.random.RandomState(seed).standard_normal(shape), jnp.float32)


@pytest.mark.parametrize("lead, k, n", [((1,), 16, 40), ((2,), 7, 3), ((3,), 577, 131),
                                        ((5,), 64, 65), ((2, 4), 24, 1), ((9,), 40, 257),
                                        ((1, 16), 72, 130), ((KERNEL_MAX_ROWS,), 33, 70),
                                        ((STACKED_KERNEL_MAX_ROWS - 3,), 40, 66),
                                        ((2,), 100, 67), ((10,), 50, 35), ((12,), 48, 70),
                                        ((5,), 2600, 45), ((24,), 1540, 300), ((17,), 576, 200),
                                        ((9,), 40, 4100)])
def test_kernel_product_equals_xla_for_row_counts_and_ragged_shapes(lead, k, n):
    # rows 1-32 (every 4- and 8-row group size and its tail, 8- and 16-row passes and their
    # tails; two rows, alone and as a group's tail, by the tiles or the stream as the host
    # takes them) and a stack's bound less 3, K and N off the tile sizes, weight shares long
    # enough that several passes walk them in blocks, rows too long for one pass's inputs
    # (walked in parts of K)
    x, w = _random(lead + (k,), 0), _random((n, k), 1)
    got = jax.jit(few_rows_product)(x, w)  # [..., N]
    want = jnp.einsum("...k,nk->...n", x, w, precision="highest")
    assert got.shape == lead + (n,)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_kernel_reads_the_named_layer_of_a_stack_in_place():
    stack, x = _random((3, 50, 24), 2), _random((4, 24), 3)  # [L, N, K], [M, K]
    for layer in range(3):
        got = jax.jit(few_rows_product, static_argnums=2)(x, stack, layer)
        np.testing.assert_allclose(got, x @ stack[layer].T, rtol=1e-5, atol=1e-4)
    with pytest.raises(Exception, match="layer outside the weight stack"):
        jax.block_until_ready(few_rows_product(x, stack, 3))


def test_kernel_under_vmap_with_a_shared_and_a_mapped_weight():
    x, w = _random((3, 2, 8), 4), _random((5, 8), 5)  # [A, M, K], [N, K]
    shared = jax.vmap(few_rows_product, in_axes=(0, None))(x, w)
    np.testing.assert_allclose(shared, x @ w.T, rtol=1e-5, atol=1e-5)
    ws = _random((3, 5, 8), 6)  # [A, N, K]
    mapped = jax.vmap(few_rows_product)(x, ws)
    np.testing.assert_allclose(mapped, jnp.einsum("amk,ank->amn", x, ws), rtol=1e-5, atol=1e-5)


def test_kernel_matrix_falls_back_past_the_row_bound_and_stands_for_its_k_by_n_weight():
    weight = _random((3, 12, 20), 7)  # [L, K, N]
    per_layer = kernel_layers(*kernel_stacks({"wq": weight, "attn_norm": _random((3, 12), 8)}))
    # the layout's float32 layers hold a buffer each: XLA's products read them in place
    own = per_layer[2]["wq"]
    assert isinstance(own, KernelMatrix) and own.shape == (12, 20) and own.layer is None
    np.testing.assert_array_equal(own.weight_nk, weight[2].T)
    matrix = KernelMatrix(jnp.swapaxes(weight, 1, 2), layer=2)  # a layer of a stack [L, N, K]
    assert matrix.shape == (12, 20)
    # a layer of a stack keeps the kernel further (XLA would copy the layer out first)
    own_bound = few_rows.max_rows()  # this host's (tuning.py)
    assert STACKED_KERNEL_MAX_ROWS > KERNEL_MAX_ROWS >= own_bound
    for rows in (1, own_bound, own_bound + 1, KERNEL_MAX_ROWS + 1, STACKED_KERNEL_MAX_ROWS,
                 STACKED_KERNEL_MAX_ROWS + 1):
        x = _random((rows, 1, 12), rows)
        for m, bound in ((matrix, STACKED_KERNEL_MAX_ROWS), (own, own_bound)):
            lowered = jax.jit(lambda x, m: x @ m).lower(x, m).as_text()
            assert ("jaxgen_few_rows" in lowered) == (rows <= bound), (rows, m.layer)
            np.testing.assert_allclose(x @ m, x @ weight[2], rtol=1e-5, atol=1e-4)
    assert jnp.array_equal(per_layer[1]["attn_norm"], _random((3, 12), 8)[1])


def _generate(monkeypatch, kernels, batch, **settings):
    import jaxgen
    from jaxgen.backends.cpu import layer_split
    from jaxgen.models import tiny_llama

    monkeypatch.setattr(layer_split, "SPLIT_MIN_BYTES", 0)
    monkeypatch.setenv("JAXGEN_CPU_KERNELS", "auto" if kernels else "off")
    model, params = tiny_llama(num_layers=3, intermediate_size=40, hidden_size=24)
    prompts = [[3, 1, 4, 1, 5][: 2 + b % 3] for b in range(batch)]
    cfg = jaxgen.GenerationConfig(max_new_tokens=6, pad_token_id=0, **settings)
    jax.clear_caches()  # the settings are read at trace time
    return jaxgen.generate(params, jaxgen.init_state(model, prompts, cfg), cfg), params, model


@pytest.mark.parametrize("batch, settings", [
    (3, {}), (8, {}), (1, {"num_beams": 3, "num_return_sequences": 2}),
    (2, {"prompt_lookup_num_tokens": 2}),
    pytest.param(2, {"do_sample": True, "top_k": 5}, marks=pytest.mark.slow),
])
def test_generate_with_the_kernel_gives_xla_s_tokens(monkeypatch, batch, settings):
    with_kernel, params, model = _generate(monkeypatch, True, batch, **settings)
    plain, _, _ = _generate(monkeypatch, False, batch, **settings)
    assert jnp.array_equal(with_kernel.sequences, plain.sequences)
    if "num_beams" in settings:
        np.testing.assert_allclose(with_kernel.sequences_scores, plain.sequences_scores, atol=1e-5)


def test_one_and_multi_row_programs_call_the_kernel_on_either_row_group(monkeypatch):
    import jaxgen
    from jaxgen.backends.cpu import layer_split
    from jaxgen.loops.decode import DecodeLoop
    from jaxgen.models import tiny_llama
    from jaxgen.runtime import compiled

    monkeypatch.setattr(layer_split, "SPLIT_MIN_BYTES", 0)
    model, params = tiny_llama()
    cfg = jaxgen.GenerationConfig(max_new_tokens=2, pad_token_id=0)

    def program(batch) -> str:
        jax.clear_caches()  # the setting is read at trace time
        state = jaxgen.init_state(model, [[3, 1, 4]] * batch, cfg)
        return compiled._run_kept.lower(params, state, cfg, None, loop=DecodeLoop(),
                                        layout="auto").as_text()

    assert "jaxgen_few_rows" in program(2)
    for group in (4, 8):  # one row takes the kernel on the 4-row (AVX2) build too
        monkeypatch.setattr(few_rows, "group_rows", lambda group=group: group)
        assert "jaxgen_few_rows" in program(1)
    monkeypatch.setenv("JAXGEN_CPU_KERNELS", "off")
    assert "jaxgen_few_rows" not in program(2) and "jaxgen_few_rows" not in program(1)


def test_the_build_reports_its_row_group_from_the_cpu_it_was_built_for(monkeypatch):
    import platform

    cpuinfo = open("/proc/cpuinfo").read() if platform.system() == "Linux" else ""
    flags = cpuinfo.split()
    native = build.arch_flags() == ("-march=native",)  # else an AVX2 build (test_kernel_arch)
    avx512 = "avx512f" in flags and native
    assert few_rows.group_rows() == (8 if avx512 else 4)
    intel_avx512 = avx512 and "GenuineIntel" in cpuinfo
    assert build.intel_avx512_host() == intel_avx512
    bound = INTEL_AVX512_KERNEL_MAX_ROWS if intel_avx512 else KERNEL_MAX_ROWS
    assert few_rows.max_rows() == bound
    monkeypatch.setenv("JAXGEN_CPU_KERNELS", "off")
    assert few_rows.group_rows() == 0 and few_rows.max_rows() == KERNEL_MAX_ROWS


def test_second_call_with_the_kernel_does_not_recompile(monkeypatch):
    import jaxgen
    from jaxgen.runtime.compiled import trace_count

    out, params, model = _generate(monkeypatch, True, 2)
    before = trace_count()
    cfg = jaxgen.GenerationConfig(max_new_tokens=6, pad_token_id=0)
    again = jaxgen.generate(params, jaxgen.init_state(model, [[3, 1], [4, 1, 5]], cfg), cfg)
    assert trace_count() == before
    assert again.sequences.shape == out.sequences.shape


def test_a_bad_setting_names_the_variable(monkeypatch):
    monkeypatch.setenv("JAXGEN_CPU_KERNELS", "fast")
    with pytest.raises(ValueError, match=r"JAXGEN_CPU_KERNELS='fast'.*auto, on, .*off, 0"):
        available()


def test_a_failed_build_warns_with_the_reason_and_falls_back(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXGEN_KERNEL_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(build, "_BUILDS", {})  # not a background build another test started
    with pytest.warns(RuntimeWarning, match="few-row kernel is not available.*no-such-compiler"):
        assert build._registered_target.__wrapped__() is None
    assert list(tmp_path.iterdir()) == []  # nothing half-written left behind


def test_per_layer_params_run_the_kernel_too(monkeypatch):
    # unstack_layers' layout (what the benchmarks and the CLI decode) gets the kernel's layout
    import jaxgen
    from jaxgen.backends.cpu import layer_split
    from jaxgen.loops.decode import DecodeLoop
    from jaxgen.models import tiny_llama, unstack_layers
    from jaxgen.runtime import compiled

    monkeypatch.setattr(layer_split, "SPLIT_MIN_BYTES", 0)
    model, params = tiny_llama(num_layers=2, intermediate_size=40)
    per_layer = unstack_layers(model, params)
    cfg = jaxgen.GenerationConfig(max_new_tokens=5, pad_token_id=0)
    state = jaxgen.init_state(model, [[3, 1, 4], [1, 5]], cfg)
    laid_out = compiled._laid_out(per_layer, state, DecodeLoop(), cfg, "auto")
    assert isinstance(laid_out["layers"][1]["wqkv"], KernelMatrix)
    assert layer_split.decoding_plan(model, laid_out, 2) is None  # laid out: left as it is
    got = jaxgen.generate(per_layer, state, cfg)
    monkeypatch.setenv("JAXGEN_CPU_KERNELS", "off")
    jax.clear_caches()
    compiled._LAID_OUT.clear()
    want = jaxgen.generate(per_layer, jaxgen.init_state(model, [[3, 1, 4], [1, 5]], cfg), cfg)
    assert jnp.array_equal(got.sequences, want.sequences)
