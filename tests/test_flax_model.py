"""A researcher's Flax model through the contract (jaxgen.models.from_flax): the NNX Llama of
examples/flax_nnx_llama.py on a jaxgen Llama's weights decodes the same tokens as that Llama
in greedy, beam search, prompt lookup and assisted decoding (tiny weights by default,
SmolLM2-135M-Instruct slow); a Linen module through `apply` too; modules that break the
protocol get a clear error before anything compiles; new prompts reuse the program."""
from __future__ import annotations

import importlib
import pathlib
import sys

import jax
import jax.numpy as jnp
import pytest

import jaxgen
from jaxgen.api.generate import default_config
from jaxgen.models import from_flax, tiny_llama

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
PROMPTS = [[1, 2, 3, 4, 1, 2, 3], [5, 6, 7, 5, 6]]  # ragged, with repeats for prompt lookup


def _example():
    """examples/flax_nnx_llama.py, imported with its folder on sys.path."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    return importlib.import_module("flax_nnx_llama")


def _sharp(params):
    """The weights scaled up (norms kept at 1) so greedy choices are far from ties."""
    layers = {k: v if "norm" in k else 8.0 * v for k, v in params["layers"].items()}
    return {**params, "layers": layers, "embed": 8.0 * params["embed"],
            **({"lm_head": 8.0 * params["lm_head"]} if "lm_head" in params else {})}


def _tiny_pair(seed: int = 0, **overrides):
    """((jaxgen Llama, params), (its Flax twin, params)) on the same tiny random weights."""
    llama, params = tiny_llama(seed, num_layers=2, **overrides)
    params = _sharp(params)
    module = _example().from_jaxgen_llama(llama.config, params)
    return (llama, params), from_flax(module)


def _ids(pair, cfg, **kw):
    model, params = pair
    return jaxgen.generate_ids(model, params, PROMPTS, cfg, **kw)


@pytest.fixture(scope="module")
def tiny():
    return _tiny_pair(0), _tiny_pair(1, tie_word_embeddings=True)


def test_adapted_nnx_model_holds_the_weights_as_a_traced_state(tiny):
    (llama, params), (model, flax_params) = tiny[0]
    assert type(flax_params).__name__ == "State"
    leaves = jax.tree_util.tree_leaves(flax_params)
    assert sum(leaf.size for leaf in leaves) == sum(
        leaf.size for leaf in jax.tree_util.tree_leaves(params))
    tokens, positions = jnp.asarray([[3, 1, 4]]), jnp.arange(3)[None]
    ours = jax.jit(model.__call__)(flax_params, tokens, positions, model.init_cache(1, 8))
    ref = jax.jit(llama.__call__)(params, tokens, positions, llama.init_cache(1, 8))
    assert jnp.allclose(ours.logits, ref.logits, atol=1e-4)
    assert ours.cache.length.tolist() == [3]
    # the params are an argument of the program: other weights, other logits, same model
    other = jax.tree_util.tree_map(lambda a: a * 0.5, flax_params)
    again = jax.jit(model.__call__)(other, tokens, positions, model.init_cache(1, 8))
    assert not jnp.allclose(again.logits, ours.logits)


@pytest.mark.parametrize("mode", ["greedy", "beam", "prompt_lookup", "draft_model"])
def test_nnx_llama_decodes_the_same_tokens_as_jaxgen_llama(tiny, mode):
    """The jaxgen Llama's tokens in this mode; greedy assisted decoding's are greedy's (the
    assisted loop keeps that promise for jaxgen's Llama: tests/test_speculative.py), so the
    Flax target runs the assisted modes and the Llama its one greedy program."""
    (target, flax_target), (_, flax_draft) = tiny
    greedy = jaxgen.GenerationConfig(max_new_tokens=12)
    cfg, kw = greedy, {}
    if mode == "beam":
        cfg = greedy = greedy.replace(num_beams=3)
    elif mode == "prompt_lookup":
        cfg = cfg.replace(prompt_lookup_num_tokens=3)
    elif mode == "draft_model":  # a Flax draft (other weights, tied head) for a Flax target
        cfg, kw = cfg.replace(num_assistant_tokens=3), dict(assistant_model=flax_draft)
    assert _ids(flax_target, cfg, **kw) == _ids(target, greedy)


@pytest.mark.slow
def test_flax_draft_model_for_a_jaxgen_target(tiny):
    (target, _), (draft, flax_draft) = tiny
    cfg = jaxgen.GenerationConfig(max_new_tokens=10, num_assistant_tokens=2)
    assert _ids(target, cfg, assistant_model=flax_draft) == _ids(target, cfg,
                                                                 assistant_model=draft)


def test_new_prompts_reuse_the_program(tiny):
    _, flax_target = tiny[0]
    cfg = jaxgen.GenerationConfig(max_new_tokens=6)
    model, params = flax_target
    jaxgen.generate_ids(model, params, [[1, 2, 3]], cfg)
    before = jaxgen.trace_count()
    jaxgen.generate_ids(model, params, [[7, 8, 9, 10]], cfg)
    jaxgen.generate_ids(model, params, [[4, 4]], cfg)
    # a freshly adapted module with the same structure is the same model: same program
    again, again_params = from_flax(_example().from_jaxgen_llama(tiny[0][0][0].config,
                                                                 tiny[0][0][1]))
    assert again == model
    jaxgen.generate_ids(again, again_params, [[5, 6]], cfg)
    assert jaxgen.trace_count() == before


def _linen_llama(args):
    """A Linen Llama (the example's RoPE and the jaxgen cache) and a function mapping a
    jaxgen Llama's params to its variables."""
    from flax import linen as nn

    ex = _example()

    def rms(x, weight, eps):
        x32 = x.astype(jnp.float32)
        return weight * (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps))

    class LinenLlama(nn.Module):
        args: ex.LlamaArgs

        @nn.compact
        def __call__(self, tokens, positions, cache):
            a = self.args
            dense = lambda width, name: nn.Dense(width, use_bias=False, name=name)  # noqa: E731
            norm = lambda name: self.param(name, nn.initializers.ones,  # noqa: E731
                                           (a.hidden_size,))
            embed = nn.Embed(a.vocab_size, a.hidden_size, name="embed")
            x = embed(tokens)  # [B, S, D]
            batch, seq = tokens.shape
            cos, sin = ex.rope_cos_sin(positions, a.head_dim, a.rope_theta, x.dtype)
            for i in range(a.num_layers):
                h = rms(x, norm(f"attn_norm_{i}"), a.rms_norm_eps)
                q = dense(a.num_heads * a.head_dim, f"wq_{i}")(h).reshape(
                    batch, seq, a.num_heads, a.head_dim)  # [B, S, H, Dh]
                k = dense(a.num_kv_heads * a.head_dim, f"wk_{i}")(h).reshape(
                    batch, seq, a.num_kv_heads, a.head_dim)  # [B, S, K, Dh]
                v = dense(a.num_kv_heads * a.head_dim, f"wv_{i}")(h).reshape(
                    batch, seq, a.num_kv_heads, a.head_dim)  # [B, S, K, Dh]
                q, k = ex.apply_rope(q, cos, sin), ex.apply_rope(k, cos, sin)
                out, cache = jaxgen.models.cached_attention(cache, i, q, k, v, positions)
                x = x + dense(a.hidden_size, f"wo_{i}")(out.reshape(batch, seq, -1))
                h = rms(x, norm(f"mlp_norm_{i}"), a.rms_norm_eps)
                gated = jax.nn.silu(dense(a.intermediate_size, f"w_gate_{i}")(h)) * dense(
                    a.intermediate_size, f"w_up_{i}")(h)
                x = x + dense(a.hidden_size, f"w_down_{i}")(gated)
            x = rms(x, norm("final_norm"), a.rms_norm_eps)
            return dense(a.vocab_size, "lm_head")(x), cache  # [B, S, V]

    def variables(params):
        out = {"embed": {"embedding": params["embed"]}, "final_norm": params["final_norm"],
               "lm_head": {"kernel": params["lm_head"]}}
        for name, stacked in params["layers"].items():
            for i in range(args.num_layers):
                out[f"{name}_{i}"] = stacked[i] if "norm" in name else {"kernel": stacked[i]}
        return {"params": out}

    return LinenLlama(args), variables


def test_linen_module_through_apply_gives_the_same_greedy_tokens(tiny):
    (llama, params), (_, _) = tiny[0]
    module = _example().from_jaxgen_llama(llama.config, params)
    linen_module, variables = _linen_llama(module.config)
    sizes = {name: getattr(llama.config, name)
             for name in ("vocab_size", "num_layers", "num_kv_heads", "head_dim")}
    model, linen_params = from_flax(linen_module, variables(params), **sizes,
                                    max_positions=llama.config.max_position_embeddings)
    assert model.module is linen_module and model.graphdef is None
    cfg = jaxgen.GenerationConfig(max_new_tokens=12)
    assert _ids((model, linen_params), cfg) == _ids((llama, params), cfg)


# ------------------------------------------------------------------ protocol errors
def _broken(kind: str):
    """An NNX module that breaks the protocol one way."""
    from flax import nnx

    class Broken(nnx.Module):
        num_layers, num_kv_heads, head_dim = 1, 1, 4

        def __init__(self):
            self.embed = nnx.Embed(8, 4, rngs=nnx.Rngs(0))
            if kind != "no_vocab":
                self.vocab_size = 8

        def __call__(self, tokens, positions, cache):
            logits = self.embed.attend(self.embed(tokens))  # [B, S, 8]
            if kind == "wide_logits":
                return jnp.concatenate([logits, logits], -1), cache
            if kind == "last_logits_only":
                return logits[:, -1], cache
            if kind == "logits_only":
                return logits
            if kind == "no_cache":
                return logits, None
            return logits, cache

    class OneArgument(nnx.Module):
        vocab_size, num_layers, num_kv_heads, head_dim = 8, 1, 1, 4

        def __call__(self, tokens):
            return jnp.zeros(tokens.shape + (8,)), None

    return OneArgument() if kind == "signature" else Broken()


@pytest.mark.parametrize("kind, error, message", [
    ("not_flax", TypeError, "must be a Flax module"),
    ("signature", ValueError, r"__call__\(self, tokens\) does not take \(tokens, positions, "
                              r"cache\)"),
    ("no_vocab", ValueError, "missing vocab_size"),
    ("wide_logits", ValueError, r"logits are \(1, 1, 16\).*vocab_size=8"),
    ("last_logits_only", ValueError, r"logits are \(1, 8\)"),
    ("logits_only", ValueError, r"returned a ShapeDtypeStruct; the protocol"),
    ("no_cache", ValueError, "must return the jaxgen cache it was given"),
    ("linen_without_params", ValueError, "params: a Linen module needs its variables"),
])
def test_a_module_that_breaks_the_protocol_gets_a_clear_error(kind, error, message):
    before = jaxgen.trace_count()
    if kind == "not_flax":
        module = lambda tokens, positions, cache: (tokens, cache)  # noqa: E731
    elif kind == "linen_without_params":
        from flax import linen as nn
        module = nn.Dense(4)
    else:
        module = _broken(kind)
    with pytest.raises(error, match=message):
        from_flax(module)
    assert jaxgen.trace_count() == before  # refused before anything compiled
    if kind == "wide_logits":  # a keyword overrides the module's attribute
        assert from_flax(module, vocab_size=16)[0].vocab_size == 16


def test_params_that_do_not_fit_are_named(tiny):
    _, (model, params) = tiny[0]
    other = _tiny_pair(0, intermediate_size=48)[1][1]
    with pytest.raises(ValueError, match=r"down_proj'\]\['kernel'\].* has shape \(48, 16\), "
                                         r"expected \(32, 16\)"):
        model.check_params(other)


# ------------------------------------------------------------------ SmolLM2 (slow)
@pytest.fixture(scope="module")
def smollm2():
    from model_fixtures import smollm2_load

    llama, params, tokenizer = smollm2_load()
    module = _example().from_jaxgen_llama(llama.config, params)
    texts = ["The capital of France is", "List three colors: red, green, blue. Again: red,"]
    prompts = [tokenizer.encode(text) for text in texts]
    draft_llama, draft_params = tiny_llama(0, vocab_size=llama.vocab_size, hidden_size=64,
                                           intermediate_size=128, num_layers=2, num_heads=4,
                                           num_kv_heads=2, head_dim=16)
    draft = _example().from_jaxgen_llama(draft_llama.config, draft_params)
    return (llama, params), from_flax(module), prompts, from_flax(draft)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["greedy", "beam", "prompt_lookup", "draft_model"])
def test_nnx_smollm2_decodes_the_same_tokens(smollm2, mode):
    (llama, params), flax_pair, prompts, flax_draft = smollm2
    cfg = default_config(llama, None, max_new_tokens=32)
    kw = {}
    if mode == "beam":
        cfg = cfg.replace(num_beams=3, max_new_tokens=12)
    elif mode == "prompt_lookup":
        cfg = cfg.replace(prompt_lookup_num_tokens=3)
    elif mode == "draft_model":
        cfg = cfg.replace(num_assistant_tokens=3)
        kw = dict(assistant_model=flax_draft)
    flax_model, flax_params = flax_pair
    ref = jaxgen.generate_ids(llama, params, prompts, cfg.replace(prompt_lookup_num_tokens=None)
                              if mode != "beam" else cfg, layout="portable")
    got = jaxgen.generate_ids(flax_model, flax_params, prompts, cfg, **kw)
    assert got == ref
