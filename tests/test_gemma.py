"""Gemma 2 and Gemma 3 (text) against transformers, and jaxgen's modes on them (fp32, CPU).

Each family: a tiny random model built by transformers (3 layers: sliding, global, sliding;
sliding_window 4, shorter than the prompts; weights scaled up so the soft-caps bind), saved
with save_pretrained and loaded with jaxgen.models.load.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from model_fixtures import (
    assert_logits_close,
    hf_generate_rows,
    hf_greedy_logits,
    jax_greedy_logits,
)

import jaxgen
from jaxgen.models import Gemma, load, tiny_tokenizer, unstack_layers
from jaxgen.models.tiny import TINY_VOCAB

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=128, sliding_window=4, query_pre_attn_scalar=16,
              final_logit_softcapping=5.0, bos_token_id=1, eos_token_id=256, pad_token_id=0)
FAMILIES = {
    "gemma2": dict(attn_logit_softcapping=1.0),  # layer_types: Gemma 2's every-other default
    "gemma3": dict(layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   rope_parameters={"sliding_attention": {"rope_type": "default",
                                                          "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                       "rope_theta": 1000000.0}}),
}
PROMPT = [5, 17, 33, 2, 60, 61, 8, 90, 44, 3, 12]
RAGGED = [[5, 17, 33, 2, 60, 61, 8, 90, 44, 3, 12], [7, 8], [40, 41, 42, 43, 44, 45], [9]]
NEW = 12


def make_hf_gemma(family: str, seed: int = 0, **overrides):
    """A random transformers Gemma 2 / Gemma 3 text model (eager, fp32), weights x3 and
    perturbed norms, so the soft-caps and the norms all matter."""
    if family == "gemma2":
        config = transformers.Gemma2Config(**{**COMMON, **FAMILIES[family], **overrides})
        cls = transformers.Gemma2ForCausalLM
    else:
        config = transformers.Gemma3TextConfig(**{**COMMON, **FAMILIES[family], **overrides})
        cls = transformers.Gemma3ForCausalLM
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn(param.shape, generator=gen))
            else:
                param.mul_(3.0)
    return model


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request, tmp_path_factory):
    hf = make_hf_gemma(request.param)
    folder = str(tmp_path_factory.mktemp(request.param))
    hf.save_pretrained(folder)
    model, params, _ = load(folder)
    return request.param, hf, model, params, folder


def test_config_reads_the_family(pair):
    family, hf, model, _, _ = pair
    cfg = model.config
    assert isinstance(model, Gemma)
    assert cfg.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert cfg.sliding_window == 4 and cfg.query_pre_attn_scalar == 16
    assert cfg.final_logit_softcapping == 5.0
    assert cfg.qk_norm == (family == "gemma3")
    if family == "gemma2":
        assert cfg.attn_logit_softcapping == 1.0
        assert cfg.rope_theta == cfg.rope_local_theta
    else:
        assert cfg.rope_scaling == (("factor", 8.0), ("rope_type", "linear"))
        assert (cfg.rope_theta, cfg.rope_local_theta) == (1e6, 1e4)


def test_prefill_and_cached_decode_logits_match_transformers(pair):
    family, hf, model, params, _ = pair
    expected = hf_greedy_logits(hf, PROMPT, steps=6)
    actual = jax_greedy_logits(model, params, PROMPT, steps=6, tokens_from=expected)
    for a, b in zip(actual, expected):
        assert_logits_close(a, b)
    assert float(np.max(np.abs(expected[0]))) <= 5.0  # the final cap holds
    unrolled = jax_greedy_logits(model, unstack_layers(model, params), PROMPT, steps=2,
                                 tokens_from=expected)  # per-layer params: static windows
    for a, b in zip(unrolled, expected):
        assert_logits_close(a, b)


def test_soft_caps_and_window_change_the_logits(pair):
    """Each of the attention cap (Gemma 2), the final cap and the window binds: without it
    the logits move well past the parity tolerance."""
    family, _, model, params, _ = pair
    base = jax_greedy_logits(model, params, PROMPT, steps=0)[0]
    changes = {"final_logit_softcapping": None, "sliding_window": 64}
    if family == "gemma2":
        changes["attn_logit_softcapping"] = None
    for field, value in changes.items():
        other = Gemma(dataclasses.replace(model.config, **{field: value}))
        moved = jax_greedy_logits(other, params, PROMPT, steps=0)[0]
        assert float(np.max(np.abs(moved - base))) > 1e-2, field


def test_greedy_and_beam_match_transformers_on_a_ragged_batch(pair):
    _, hf, model, params, _ = pair
    probe = hf_generate_rows(hf, RAGGED, 0, max_new_tokens=6, do_sample=False,
                             eos_token_id=None)
    eos = probe[0][len(RAGGED[0]) + 3]  # a token greedy emits mid-way: rows stop early
    for kw in (dict(), dict(num_beams=3)):
        expected = hf_generate_rows(hf, RAGGED, 0, max_new_tokens=NEW, do_sample=False,
                                    eos_token_id=eos, top_k=None, top_p=None,
                                    temperature=None, **kw)
        got = jaxgen.generate_ids(model, params, RAGGED, max_new_tokens=NEW, eos_token_id=eos,
                                  pad_token_id=0, **kw)
        assert got == expected, kw


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    """The Gemma 2 model, its greedy rows (no EOS) and a smaller Gemma 2 draft model."""
    hf = make_hf_gemma("gemma2")
    folder = str(tmp_path_factory.mktemp("gemma2_modes"))
    hf.save_pretrained(folder)
    model, params, _ = load(folder)
    draft_folder = str(tmp_path_factory.mktemp("gemma2_draft"))
    make_hf_gemma("gemma2", seed=5, num_hidden_layers=2).save_pretrained(draft_folder)
    draft, draft_params, _ = load(draft_folder)
    greedy = jaxgen.generate_ids(model, params, RAGGED, max_new_tokens=NEW, pad_token_id=0,
                                 eos_token_id=None)
    return model, params, greedy, (draft, draft_params), folder


@pytest.mark.parametrize("mode", ["prompt_lookup", "early_exit",
                                  pytest.param("draft_model", marks=pytest.mark.slow)])
def test_assisted_greedy_equals_plain_greedy(gemma2, mode):
    model, params, greedy, draft, _ = gemma2
    kw = {"prompt_lookup": dict(prompt_lookup_num_tokens=3),
          "draft_model": dict(assistant_model=draft, num_assistant_tokens=3),
          "early_exit": dict(assistant_early_exit=1, num_assistant_tokens=3)}[mode]
    out = jaxgen.generate_ids(model, params, RAGGED, max_new_tokens=NEW, pad_token_id=0,
                              eos_token_id=None, **kw)
    assert out == greedy


@pytest.mark.parametrize("kind", ["offloaded", pytest.param("dynamic",
                                                             marks=pytest.mark.slow)])
def test_dense_cache_kinds_give_the_same_tokens(gemma2, kind):
    model, params, greedy, _, _ = gemma2
    got = jaxgen.generate_ids(model, params, RAGGED, max_new_tokens=NEW, pad_token_id=0,
                              eos_token_id=None, cache_implementation=kind,
                              cache_config={"initial_length": 16} if kind == "dynamic"
                              else {"offload_on_cpu": True})
    assert got == greedy


def test_quantized_cache_close_and_ring_cache_refused(gemma2):
    """quantized: logits close to the dense cache's; sliding_window (one ring for mixed
    layers): refused before anything runs."""
    model, params, _, _, _ = gemma2
    tokens = jnp.asarray([PROMPT], jnp.int32)
    positions = jnp.arange(len(PROMPT))[None]
    dense = model(params, tokens, positions, model.init_cache(1, 16)).logits
    quant = model(params, tokens, positions, model.init_cache(1, 16, kind="quantized")).logits
    scale = float(jnp.max(jnp.abs(dense)))
    err = float(jnp.max(jnp.abs(quant - dense)))
    assert 0 < err < 0.05 * scale
    with pytest.raises(ValueError, match="cache_implementation='sliding_window'.*allowed"):
        jaxgen.generate_ids(model, params, RAGGED, max_new_tokens=2,
                            cache_implementation="sliding_window")


@pytest.mark.slow
def test_int8_weights_logits_close(gemma2):
    model, params, _, _, folder = gemma2
    qmodel, qparams, _ = load(folder, weights="int8")
    qmodel.check_params(qparams)
    tokens, positions = jnp.asarray([PROMPT], jnp.int32), jnp.arange(len(PROMPT))[None]
    dense = model(params, tokens, positions, model.init_cache(1, 16)).logits
    quant = qmodel(qparams, tokens, positions, qmodel.init_cache(1, 16)).logits
    err = float(jnp.max(jnp.abs(quant - dense)))
    assert 0 < err < 0.05 * float(jnp.max(jnp.abs(dense)))


@pytest.mark.slow
def test_guidance_and_regex_outputs_are_valid(gemma2):
    model, params, greedy, _, _ = gemma2
    guided = jaxgen.generate_ids(model, params, RAGGED, max_new_tokens=NEW, pad_token_id=0,
                                 eos_token_id=None, guidance_scale=3.0)
    assert [len(r) for r in guided] == [len(r) for r in greedy]
    assert all(0 <= t < model.vocab_size for row in guided for t in row)
    assert guided != greedy  # guidance is not a no-op
    tok = tiny_tokenizer()
    pattern = "(ab|cd){2,4}x"
    prompts = [tok.encode("hello"), tok.encode("a")]
    rows = jaxgen.generate_ids(model, params, prompts, tokenizer=tok, regex=pattern,
                               max_new_tokens=24, eos_token_id=tok.eos_token_id)
    for prompt, row in zip(prompts, rows):
        new = row[len(prompt):]
        assert new[-1] == tok.eos_token_id
        assert re.fullmatch(pattern, tok.decode(new[:-1])), tok.decode(new)


@pytest.mark.slow
def test_sampling_with_a_draft_model_keeps_the_target_distribution(gemma2):
    """Sampling with a draft model: the second new token (drawn by the speculative accept /
    resample step) follows the target's exact marginal sum_a p(a) p(. | a) (chi-square)."""
    from exact_sampling import chi_square

    model, params, _, draft, _ = gemma2
    prompt, rows, vocab = RAGGED[1], 1000, model.vocab_size

    def probs(prefixes):
        tokens = jnp.asarray(prefixes, jnp.int32)  # [N, S]
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        logits = model(params, tokens, positions, model.init_cache(*tokens.shape)).logits
        return np.asarray(jax.nn.softmax(logits[:, -1]), np.float64)  # [N, V]

    first = probs([prompt])[0]  # [V]
    second = first @ probs([prompt + [a] for a in range(vocab)])  # [V]
    out = jaxgen.generate_ids(model, params, [prompt] * rows, max_new_tokens=3,
                              pad_token_id=0, eos_token_id=None, do_sample=True, top_k=0,
                              assistant_model=draft, num_assistant_tokens=2,
                              key=jax.random.key(11))
    counts = np.bincount([row[len(prompt) + 1] for row in out], minlength=vocab)
    assert chi_square(counts, second) > 1e-3


@pytest.mark.slow
def test_mesh_tokens_equal_one_device():
    """Greedy, beam and prompt lookup on 8 simulated devices ((2, 4) and (1, 8) meshes)
    give one device's tokens (tests/gemma_mesh_script.py, in a subprocess)."""
    script = os.path.join(os.path.dirname(__file__), "gemma_mesh_script.py")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root)
    done = subprocess.run([sys.executable, script], capture_output=True, text=True, env=env,
                          cwd=root, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    checks = json.loads(lines[-1])
    assert len(checks) >= 6 and all(checks.values()), checks
