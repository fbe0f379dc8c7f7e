"""DeepSeek-V3 (MLA over a latent cache, MoE, MTP layers) against transformers'
DeepseekV3ForCausalLM: a tiny random model built with transformers, saved with
save_pretrained (plus MTP tensors at model.layers.{L}), read back with jaxgen.models.load.

Logits to fp32 tolerance (prefill + cached decode steps, with and without q_lora_rank, YaRN
and plain RoPE, interleaved or not); the latent cache holds what transformers' cache holds
(c_kv after kv_a_layernorm, the rotated k_pe) at fewer bytes per token than expanded K/V;
greedy and beam tokens on a ragged batch; use_mtp=True tokens and accepted drafts round for
round; lossless use_mtp sampling (chi-square); the same tokens on simulated 8-device meshes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from exact_sampling import (
    SMALL_V,
    TEMPERATURE,
    TOP_K,
    assert_follows,
    first_three_counts,
    three_token_joint,
)
from model_fixtures import assert_logits_close, hf_greedy_logits, jax_greedy_logits
from test_beam import assert_same, hf_beam, jax_beam, pick_eos
from test_generate_parity import RAGGED, assert_same_generation, likely_eos
from test_mtp import _hf_rounds, _jaxgen_rounds

import jaxgen
from jaxgen.models import DeepseekV3, DeepseekV3Config, load
from jaxgen.models.deepseek_mtp import teacher_forced_logits
from jaxgen.models.moe import MoeConfig
from jaxgen.models.safetensors_io import read_safetensors, write_safetensors

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LAYERS = 3
TINY_DS = dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
               num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
               n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=16,
               qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12, n_group=2, topk_group=1,
               num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=256,
               rms_norm_eps=1e-6, pad_token_id=0, bos_token_id=1, eos_token_id=2)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
        "mscale_all_dim": 0.7, "original_max_position_embeddings": 32, "beta_fast": 16,
        "beta_slow": 1}
CASES = {  # name -> config overrides
    "q_lora_interleaved": dict(q_lora_rank=24),
    "no_q_lora_yarn_bias_tied": dict(q_lora_rank=None, rope_parameters=YARN,
                                     rope_interleave=False, attention_bias=True,
                                     tie_word_embeddings=True),
}
PROMPT = [5, 17, 33, 2, 60, 61, 8, 90, 44, 3, 12, 70, 71]


def build_folder(folder: str, seed: int = 0, **overrides):
    """A random DeepseekV3ForCausalLM with L = LAYERS layers and one MTP depth, saved to
    `folder`; returns transformers' model read back from it (eager attention, fp32). The MTP
    depth is a (L+1)-th MoE layer of the same random model, renamed model.layers.{L}, with
    enorm / hnorm / shared_head.norm and an eh_proj that passes the token's embedding
    through (plus noise): its drafts are sometimes accepted, sometimes not."""
    config = transformers.DeepseekV3Config(**{**TINY_DS, **overrides},
                                           num_hidden_layers=LAYERS + 1,
                                           num_nextn_predict_layers=1)
    torch.manual_seed(seed)
    hf = transformers.DeepseekV3ForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn(param.shape, generator=gen))
            elif name.endswith("gate.weight"):  # router: well separated expert scores
                param.copy_(0.5 * torch.randn(param.shape, generator=gen))
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
            else:
                param.mul_(3.0)
        for name, buffer in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=gen))
    hf.save_pretrained(folder, safe_serialization=True)
    path = os.path.join(folder, "model.safetensors")
    tensors = read_safetensors(path)
    rng = np.random.default_rng(seed)
    d = TINY_DS["hidden_size"]
    mtp = f"model.layers.{LAYERS}."
    eye = np.concatenate([np.eye(d), np.zeros((d, d))], axis=1)  # [D, 2D]: the embedding
    tensors.update({mtp + "enorm.weight": 1 + 0.2 * rng.standard_normal(d),
                    mtp + "hnorm.weight": 1 + 0.2 * rng.standard_normal(d),
                    mtp + "eh_proj.weight": eye + 0.05 * rng.standard_normal((d, 2 * d)),
                    mtp + "shared_head.norm.weight": 1 + 0.2 * rng.standard_normal(d)})
    tensors = {k: np.asarray(v, np.float32) for k, v in tensors.items()}
    write_safetensors(path, tensors, metadata={"format": "pt"})
    config_path = os.path.join(folder, "config.json")
    saved = json.loads(open(config_path).read())
    saved["num_hidden_layers"] = LAYERS
    with open(config_path, "w") as f:
        json.dump(saved, f)
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(
        folder, attn_implementation="eager").eval()
    hf._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{LAYERS}\..*"]  # MtpModel's
    return hf


_BUILT: dict = {}


def built(name: str, tmp_path_factory):
    """(transformers' model, jaxgen model, params) of case `name`, built once per session."""
    if name not in _BUILT:
        folder = str(tmp_path_factory.mktemp(name))
        hf = build_folder(folder, seed=3, **CASES[name])
        model, params, _ = load(folder)
        _BUILT[name] = (hf, model, params)
    return _BUILT[name]


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    return (request.param, *built(request.param, tmp_path_factory))


@pytest.fixture(scope="module")
def main_case(tmp_path_factory):
    return built("q_lora_interleaved", tmp_path_factory)


# ------------------------------------------------------------------------- logits
def test_prefill_and_cached_decode_logits_match_transformers(case):
    name, hf, model, params = case
    assert isinstance(model, DeepseekV3) and model.config.num_mtp_layers == 1
    assert (model.config.q_lora_rank is None) == (name.startswith("no_q_lora"))
    expected = hf_greedy_logits(hf, PROMPT, steps=6)
    actual = jax_greedy_logits(model, params, PROMPT, steps=6, tokens_from=expected)
    for step, (a, b) in enumerate(zip(actual, expected)):
        assert_logits_close(a, b), (name, step)


def test_the_cache_holds_the_latent_at_fewer_bytes_per_token(main_case):
    hf, model, params = main_case
    with torch.no_grad():
        out = hf(torch.tensor([PROMPT]), use_cache=True)
    hf_cache = getattr(out, "cache", None) or out.past_key_values
    length = len(PROMPT)
    ours = model(params, jnp.asarray([PROMPT]), jnp.arange(length)[None],
                 model.init_cache(1, 16)).cache
    assert ours.latent.shape == (LAYERS, 1, 1, 16, 16 + 8)  # [L, B, 1, T, R + P]
    for layer in range(LAYERS):  # transformers caches (kv_nope, k_rot) as (keys, values)
        keys = hf_cache.layers[layer].keys[0, 0].numpy()  # [S, R]
        values = hf_cache.layers[layer].values[0, 0].numpy()  # [S, P]
        np.testing.assert_allclose(np.asarray(ours.c_kv[layer, 0, :length]), keys, atol=1e-5)
        np.testing.assert_allclose(np.asarray(ours.k_pe[layer, 0, :length]), values, atol=1e-5)
    sizes = model.cache_bytes_per_token()
    assert ours.bytes_per_token() == sizes["latent"] == LAYERS * (16 + 8) * 4
    assert sizes["expanded"] == LAYERS * 4 * (8 + 8 + 12) * 4  # H * (Dqk + Dv) per layer
    assert sizes["latent"] < sizes["expanded"]
    assert ours.nbytes() == 16 * sizes["latent"] + 4  # T positions of one row, + length


# ------------------------------------------------------------------------- generation
def test_greedy_tokens_match_transformers_on_a_ragged_batch(main_case):
    hf, model, params = main_case
    assert_same_generation(model, params, hf, RAGGED, likely_eos(hf, RAGGED, 0))


def test_beam_tokens_and_scores_match_transformers_on_a_ragged_batch(main_case):
    hf, model, params = main_case
    prompts = [[7, 3, 11, 5, 9], [4, 8], [21, 30, 6]]
    eos = pick_eos(hf, prompts[0])
    kw = dict(num_beams=3, max_new_tokens=8, early_stopping=False, length_penalty=1.0,
              num_return_sequences=2, eos_token_id=eos)
    cfg = jaxgen.GenerationConfig(pad_token_id=0, return_dict_in_generate=True, **kw)
    alone, _ = hf_beam(hf, prompts, batched=False, **kw)
    ragged, _ = jax_beam(model, params, prompts, cfg)
    assert_same(ragged, alone, "ragged")


@pytest.mark.slow
def test_dynamic_cache_grows_and_gives_the_static_tokens(main_case):
    _, model, params = main_case
    base = dict(max_new_tokens=12, pad_token_id=0)
    static = jaxgen.generate_ids(model, params, RAGGED, **base)
    grown = jaxgen.generate_ids(model, params, RAGGED, cache_implementation="dynamic",
                                cache_config={"initial_length": 16, "chunk_size": 4}, **base)
    assert grown == static


# ------------------------------------------------------------------------- MTP
@pytest.mark.slow
def test_mtp_depth_logits_match_transformers_mtp_model(main_case):
    from transformers.cache_utils import MtpCache
    from transformers.modeling_layers import MtpModel

    hf, model, params = main_case
    mtp = MtpModel.from_pretrained(hf)
    tokens = np.array([PROMPT])
    count = tokens.shape[1] - 1
    hidden = model(params, jnp.asarray(tokens[:, :count]), jnp.arange(count)[None],
                   model.init_cache(1, count)).hidden  # [1, P, D]
    ours = teacher_forced_logits(model.mtp_layers(), params, jnp.asarray(tokens), hidden)
    with torch.no_grad():
        state = hf(torch.tensor(tokens[:, :count]), output_hidden_states=True).hidden_states[-1]
        cache = MtpCache(config=hf.config.get_mtp_config())
        state = mtp.forward_layer(0, state, torch.arange(1, count + 1)[None], cache,
                                  input_ids=torch.tensor(tokens[:, 1:count + 1]))
        want = mtp._project_to_logits(state).numpy()  # [1, P, V]
    assert_logits_close(np.asarray(ours[0]), want)


def test_hf_generate_use_mtp_gives_the_same_tokens_and_rounds(main_case):
    hf, model, params = main_case
    prompt, new = [5, 3, 7, 1, 9], 24
    hf_tokens, hf_accepted = _hf_rounds(hf, prompt, new)
    tokens, accepted = _jaxgen_rounds((model, params), prompt, new, assistant_fallback=False)
    assert tokens == hf_tokens
    assert 0 < sum(accepted) < len(accepted)  # one depth: accepted and rejected drafts
    assert accepted[:len(hf_accepted)] == hf_accepted


@pytest.mark.slow
def test_mtp_greedy_equals_plain_greedy_on_a_ragged_batch(main_case):
    _, model, params = main_case
    cfg = jaxgen.GenerationConfig(max_new_tokens=16, use_mtp=True, num_assistant_tokens=2,
                                  assistant_fallback=False, pad_token_id=0)
    plain = jaxgen.generate(params, jaxgen.init_state(model, RAGGED, cfg.replace(use_mtp=False)),
                            cfg.replace(use_mtp=False))
    out = jaxgen.generate(params, jaxgen.init_state(model, RAGGED, cfg), cfg)
    np.testing.assert_array_equal(np.asarray(out.sequences), np.asarray(plain.sequences))
    assert 0 < int(np.sum(out.speculative.accepted)) < int(np.sum(out.speculative.drafted))


def small_vocab_model():
    """A jaxgen DeepSeek-V3 over SMALL_V tokens with one MTP depth whose projection passes
    the embedding through: a peaked, context-dependent target and a drafter near it."""
    model = small_vocab_shape()
    params = jax.tree_util.tree_map(lambda a: a * 6.0 if a.ndim >= 2 else a,
                                    model.init_params(jax.random.key(9)))
    eye = jnp.concatenate([jnp.eye(16), jnp.zeros((16, 16))])[None]  # [1, 2D, D]
    params["mtp"]["eh_proj"] = params["mtp"]["eh_proj"] + eye
    return model, params


def small_vocab_shape():
    return DeepseekV3(DeepseekV3Config(
        vocab_size=SMALL_V, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
        q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4,
        first_k_dense_replace=1, num_mtp_layers=1,
        moe=MoeConfig(num_experts=4, experts_per_token=2, expert_size=8, shared_experts=1,
                      groups=2, groups_per_token=1, normalize_weights=True, scaling=2.5)))


@pytest.mark.slow
def test_mtp_sampling_is_lossless():
    model, params = small_vocab_model()
    prompt = [2, 3, 2, 3, 2]
    exact = three_token_joint(model, params, prompt)  # [V, V, V]
    cfg = jaxgen.GenerationConfig(do_sample=True, temperature=TEMPERATURE, top_k=TOP_K,
                                  max_new_tokens=4, use_mtp=True, num_assistant_tokens=2)
    out = jaxgen.generate(params, jaxgen.init_state(model, [prompt] * 6000, cfg,
                                                    jax.random.key(11)), cfg)
    assert_follows(first_three_counts(out.sequences, len(prompt), SMALL_V), exact)
    accepted, drafted = int(np.sum(out.speculative.accepted)), int(np.sum(out.speculative.drafted))
    assert 0 < accepted < drafted


# ------------------------------------------------------------------------- mesh
@pytest.mark.slow
def test_meshes_give_one_devices_tokens():
    """Greedy, beam, sampling and use_mtp on (2, 4) and (1, 8) meshes of simulated CPU
    devices give one device's tokens (tests/deepseek_mesh_script.py, in a subprocess)."""
    script = os.path.join(os.path.dirname(__file__), "deepseek_mesh_script.py")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root)
    done = subprocess.run([sys.executable, script], capture_output=True, text=True, env=env,
                          cwd=root, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    checks = json.loads(lines[-1])
    assert len(checks) >= 9 and all(checks.values()), checks


# ------------------------------------------------------------------------- bad input
def test_bad_config_and_cache_kinds_are_refused(tmp_path):
    model = small_vocab_shape()
    params = jax.eval_shape(model.init_params, jax.random.key(0))  # shapes only
    with pytest.raises(ValueError, match=r"cache_implementation='quantized' is not supported "
                                         r"by DeepSeek-V3's latent cache.*allowed: static, "
                                         r"dynamic"):
        model.init_cache(1, 8, kind="quantized")
    cfg = jaxgen.GenerationConfig(max_new_tokens=2, cache_implementation="sliding_window",
                                  cache_config={"sliding_window": 4})
    with pytest.raises(ValueError, match=r"latent cache"):
        jaxgen.init_state(model, [[1, 2]], cfg)
    good = {**TINY_DS, "model_type": "deepseek_v3", "num_hidden_layers": 2}
    for change, needle in [({"num_key_value_heads": 2}, r"num_key_value_heads=2.*allowed"),
                           ({"hidden_act": "gelu"}, r"hidden_act='gelu'; allowed: 'silu'"),
                           ({"first_k_dense_replace": 3}, r"first_k_dense_replace=3"),
                           ({"n_group": 3}, r"n_group=3"),
                           ({"rope_parameters": {"rope_type": "longrope"}},
                            r"rope_type='longrope'; allowed"),
                           ({"kv_lora_rank": 0}, r"kv_lora_rank=0"),
                           ({"scoring_func": "softmax"}, r"scoring_func='softmax'"),
                           ({"quantization_config": {"quant_method": "fp8"}},
                            r"quantized checkpoints")]:
        with pytest.raises(ValueError, match=needle):
            DeepseekV3Config.from_hf_dict({**good, **change})
    with pytest.raises(ValueError, match=r"params\['mtp'\]\['layers'\]\['wkv_b'\] has shape"):
        model.check_params({**params, "mtp": {**params["mtp"], "layers": {
            **params["mtp"]["layers"], "wkv_b": jax.ShapeDtypeStruct((1, 2, 16), jnp.float32)}}})
    model.check_params(params)
    with pytest.raises(ValueError, match=r"params have no 'mtp' entry"):
        model.check_params({k: v for k, v in params.items() if k != "mtp"})


def test_int8_weights_are_refused_by_name(main_case):
    _, model, params = main_case
    from jaxgen.models.quantize import quantize_params, quantized_params

    with pytest.raises(ValueError, match=r"weights='int8' is not available for DeepseekV3 "
                                         r"models; allowed: 'float'"):
        quantized_params(model, params, "int8")
    with pytest.raises(ValueError, match=r"params\['layers'\]\['w.*Int8Matrix: DeepSeek-V3 "
                                         r"runs float weights only"):
        model.check_params(quantize_params(model.config, params))
