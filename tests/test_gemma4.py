"""Gemma 4 (text) against transformers' Gemma4ForCausalLM, fp32, on a tiny random model with
both layer types (head_dim 8 sliding / 16 full, window 4), per-layer input embeddings, KV-shared
layers, a double-wide MLP, attention_k_eq_v, soft-capped logits and random norms / layer
scalars: logits (prefill + cached decode steps), greedy and beam tokens on a ragged batch,
sampling (chi-square of the first token against transformers' distribution), prompt lookup,
a multimodal gemma4 folder (its text model loads; the towers are skipped with a warning),
the refusal of what jaxgen does not implement, and the same tokens on 8 simulated devices.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from exact_sampling import chi_square  # noqa: E402
from model_fixtures import hf_generate_rows  # noqa: E402
from test_beam import assert_same, hf_beam, jax_beam  # noqa: E402

import jaxgen  # noqa: E402
from jaxgen.models import load  # noqa: E402
from jaxgen.models.gemma4 import Gemma4  # noqa: E402
from jaxgen.models.gemma4_checkpoint import gemma4_config  # noqa: E402

RAGGED = [[5, 17, 33, 2, 60, 61, 8, 90, 44, 3, 12], [7, 8], [40, 41, 42, 43, 44, 45], [9]]
PAD = 0

TEXT = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
            num_attention_heads=2, num_key_value_heads=1, head_dim=8, global_head_dim=16,
            sliding_window=4, layer_types=["sliding_attention", "full_attention",
                                           "sliding_attention", "full_attention"],
            hidden_size_per_layer_input=8, vocab_size_per_layer_input=96,
            num_kv_shared_layers=2, use_double_wide_mlp=True, attention_k_eq_v=True,
            num_global_key_value_heads=2, final_logit_softcapping=30.0,
            max_position_embeddings=256, pad_token_id=PAD, eos_token_id=1, bos_token_id=2)


def randomize(hf, seed: int):
    """Weights far from init (norms and layer scalars too), so every term of the math shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(p + 0.3 * noise if "norm" in name else 0.3 * noise)
        for layer in hf.model.layers if hasattr(hf.model, "layers") else \
                hf.model.language_model.layers:
            layer.layer_scalar.fill_(0.5 + float(torch.rand(1, generator=gen)))
    return hf.eval()


def make_hf_gemma4(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    config = transformers.Gemma4TextConfig(**{**TEXT, **overrides},
                                           attn_implementation="eager")
    return randomize(transformers.Gemma4ForCausalLM(config), seed)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf = make_hf_gemma4(seed=3)
    folder = str(tmp_path_factory.mktemp("gemma4"))
    hf.save_pretrained(folder)
    model, params, _ = load(folder)
    return hf, model, params


def jax_logits(model, params, prompt, prefill: int):
    """Logits of every position: a prefill of `prefill` tokens, then one-token decode steps."""
    cache = model.init_cache(1, len(prompt) + 4)
    tokens = jnp.asarray([prompt], jnp.int32)
    out = model(params, tokens[:, :prefill], jnp.arange(prefill)[None], cache)
    rows, cache = [np.asarray(out.logits[0])], out.cache
    for t in range(prefill, len(prompt)):
        out = model(params, tokens[:, t:t + 1], jnp.array([[t]]), cache)
        rows.append(np.asarray(out.logits[0]))
        cache = out.cache
    return np.concatenate(rows)


def test_logits_match_transformers_prefill_and_cached_decode(pair):
    hf, model, params = pair
    assert isinstance(model, Gemma4)
    assert model.config.head_dims == (8, 16, 8, 16) and model.config.kv_heads == (1, 2, 1, 2)
    prompt = RAGGED[0] + [70, 71, 72]  # 14 positions: well past the window of 4
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0].numpy()
    got = jax_logits(model, params, prompt, prefill=6)
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-4)
    assert np.abs(expected).max() > 1.0  # logits far from zero: the check means something


def test_greedy_ragged_batch_matches_transformers(pair):
    hf, model, params = pair
    probe = hf_generate_rows(hf, RAGGED, PAD, max_new_tokens=6, do_sample=False,
                             eos_token_id=None)
    eos = probe[0][len(RAGGED[0]) + 3]  # a token row 0 emits: EOS stops rows early
    expected = hf_generate_rows(hf, RAGGED, PAD, max_new_tokens=12, do_sample=False,
                                eos_token_id=eos, top_k=None, top_p=None, temperature=None)
    got = jaxgen.generate_ids(model, params, RAGGED, max_new_tokens=12, eos_token_id=eos,
                              pad_token_id=PAD)
    assert got == expected
    assert any(len(row) < len(p) + 12 for row, p in zip(got, RAGGED))  # EOS fired somewhere


@pytest.mark.slow
def test_beam_search_ragged_batch_matches_transformers(pair):
    hf, model, params = pair
    kw = dict(num_beams=3, max_new_tokens=8, num_return_sequences=2, eos_token_id=None)
    expected, _ = hf_beam(hf, RAGGED, batched=True, **kw)
    got, _ = jax_beam(model, params, RAGGED, jaxgen.GenerationConfig(pad_token_id=PAD, **kw))
    assert_same(got, expected, atol=1e-4)


@pytest.mark.slow
def test_prompt_lookup_equals_plain_greedy(pair):
    _, model, params = pair
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 9, 9, 9]]
    plain = jaxgen.generate_ids(model, params, prompts, max_new_tokens=10, pad_token_id=PAD)
    looked = jaxgen.generate(params, jaxgen.init_state(model, prompts, jaxgen.GenerationConfig(
        max_new_tokens=10, pad_token_id=PAD, prompt_lookup_num_tokens=3)),
        jaxgen.GenerationConfig(max_new_tokens=10, pad_token_id=PAD,
                                prompt_lookup_num_tokens=3))
    seqs, lengths = np.asarray(looked.sequences), np.asarray(looked.lengths)
    assert [seqs[b, :lengths[b]].tolist() for b in range(2)] == plain
    assert int(np.sum(looked.speculative.drafted)) > 0


@pytest.mark.slow
def test_first_sampled_token_follows_transformers_distribution(pair):
    hf, model, params = pair
    prompt, rows, temperature = RAGGED[2], 4000, 0.7
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, -1].double().numpy()
    probs = np.exp((logits - logits.max()) / temperature)
    probs /= probs.sum()
    cfg = jaxgen.GenerationConfig(do_sample=True, temperature=temperature, top_k=None,
                                  top_p=None, max_new_tokens=1, pad_token_id=PAD)
    out = jaxgen.generate(params, jaxgen.init_state(model, [prompt] * rows, cfg,
                                                    jax.random.key(5)), cfg)
    first = np.asarray(out.sequences)[:, len(prompt)]
    counts = np.bincount(first, minlength=model.vocab_size)
    assert chi_square(counts, probs) > 1e-3
    assert len(set(first.tolist())) > 3  # really sampled


@pytest.mark.slow
def test_multimodal_folder_loads_its_text_model(tmp_path):
    text = {**TEXT, "num_hidden_layers": 2, "layer_types": ["sliding_attention",
                                                             "full_attention"],
            "num_kv_shared_layers": 0}
    vision = transformers.Gemma4VisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, head_dim=8, position_embedding_size=64)
    audio = transformers.Gemma4AudioConfig(hidden_size=16, num_hidden_layers=1,
                                           num_attention_heads=2, output_proj_dims=16,
                                           subsampling_conv_channels=[4, 4])
    config = transformers.Gemma4Config(
        text_config=text, vision_config=vision, audio_config=audio, image_token_id=90,
        boi_token_id=91, eoi_token_id=92, video_token_id=93, boa_token_id=94,
        eoa_token_index=95, audio_token_id=89)
    torch.manual_seed(0)
    config.text_config._attn_implementation = "eager"
    hf = transformers.Gemma4ForConditionalGeneration(config)
    randomize(hf, 4)
    hf.save_pretrained(str(tmp_path))
    with pytest.warns(UserWarning, match="vision / audio towers"):
        model, params, _ = load(str(tmp_path))
    prompt = [5, 17, 33, 2, 60, 61, 8, 44, 3, 12]  # no image / audio placeholder ids (89-95)
    with torch.no_grad():
        expected = hf(input_ids=torch.tensor([prompt])).logits[0].numpy()
    np.testing.assert_allclose(jax_logits(model, params, prompt, prefill=len(prompt) - 2),
                               expected, atol=1e-4, rtol=1e-4)


def test_unsupported_config_fields_are_refused(tmp_path):
    with pytest.raises(ValueError, match="enable_moe_block"):
        gemma4_config({**TEXT, "enable_moe_block": True})
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        gemma4_config({**TEXT, "use_bidirectional_attention": "all"})
    with pytest.raises(ValueError, match="rope_type"):
        gemma4_config({**TEXT, "rope_parameters": {
            "sliding_attention": {"rope_type": "yarn", "rope_theta": 1e4},
            "full_attention": {"rope_type": "default", "rope_theta": 1e4}}})
    folder = tmp_path / "bad"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**TEXT, "model_type": "gemma4_text",
                                                    "hidden_activation": "relu"}))
    with pytest.raises(ValueError, match="hidden_activation"):
        load(str(folder))
    assert os.path.isdir(folder)
    with pytest.raises(ValueError, match="cache_implementation"):
        Gemma4(gemma4_config(TEXT)).init_cache(1, 8, kind="quantized")


def test_shard_places_heads_mlp_per_layer_inputs_and_vocab_on_model():
    """One device, a (1, 1) mesh: `shard` lays Gemma 4 out (the Llama rules per layer, the
    per-layer inputs by column, the vocabulary) and `init_state` splits each cache group's KV
    heads; the 8-device run is test_mesh_tokens_equal_one_device."""
    from jax.sharding import PartitionSpec as P

    from jaxgen.models.param_sharding import shard

    model = Gemma4(gemma4_config({**TEXT, "hidden_size": 16, "intermediate_size": 16}))
    mesh = jax.make_mesh((1, 1), ("data", "model"))
    placed = shard(model, model.init_params(jax.random.key(0)), mesh)
    specs = {name: placed["layers"][0][name].sharding.spec
             for name in ("wq", "wk", "wo", "w_gate", "w_down", "ple_gate", "ple_up", "q_norm")}
    assert specs == {"wq": P(None, "model"), "wk": P(None, "model"), "wo": P("model", None),
                     "w_gate": P(None, "model"), "w_down": P("model", None),
                     "ple_gate": P(None, "model"), "ple_up": P("model", None),
                     "q_norm": P(None)}
    assert placed["embed"].sharding.spec == P("model", None)
    assert placed["ple_embed"].sharding.spec == P(None, "model")
    assert placed["ple_projection"].sharding.spec == P(None, "model")
    assert placed["ple_projection_norm"].sharding.spec == P(None)
    cfg = jaxgen.GenerationConfig(max_new_tokens=2, pad_token_id=PAD)
    state = jaxgen.init_state(model, [[5, 6], [7]], cfg, mesh=mesh)
    assert [group.k.sharding.spec for group in state.cache.groups] == \
        [P(None, "data", "model", None, None)] * 2


@pytest.mark.slow  # about 3 min on 2 cores: 4 cases x 3 layouts, each compiled
def test_mesh_tokens_equal_one_device():
    """Greedy, beam and the Gemma 4 assistant's drafting (greedy and sampled) on 8 simulated
    devices ((2, 4) and (1, 8) meshes) give one device's tokens and draft counts; heads, MLP
    columns, per-layer inputs, vocabulary and the cache's KV heads sit on "model", and a size
    the model axis does not divide is refused by name (tests/gemma4_mesh_script.py, in a
    subprocess)."""
    script = os.path.join(os.path.dirname(__file__), "gemma4_mesh_script.py")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root)
    done = subprocess.run([sys.executable, script], capture_output=True, text=True, env=env,
                          cwd=root, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    checks = json.loads(lines[-1])
    assert len(checks) >= 20 and all(checks.values()), checks
