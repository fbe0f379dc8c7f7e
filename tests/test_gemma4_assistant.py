"""Gemma 4's assistant (`assistant_model=(Gemma4Assistant, params)`) drafting for a Gemma 4
target, against transformers' Gemma4AssistantForCausalLM driving Gemma4ForCausalLM (greedy,
batch 1: transformers' assisted generation takes one row): the same tokens, rounds, drafts and
accepted drafts per draft position, with plain and ordered (centroid-masked) embeddings, on
prompts shorter and longer than the sliding windows. A ragged batch equals jaxgen's own
batch-1 runs, and sampling follows the target's exact distribution (chi-square).
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
from exact_sampling import (  # noqa: E402
    SMALL_V,
    TEMPERATURE,
    TOP_K,
    assert_follows,
    first_three_counts,
    three_token_joint,
)
from test_gemma4 import make_hf_gemma4  # noqa: E402
from transformers.generation import candidate_generator  # noqa: E402

import jaxgen  # noqa: E402
from jaxgen.models import load  # noqa: E402
from jaxgen.models.gemma4 import Gemma4  # noqa: E402
from jaxgen.models.gemma4_assistant import Gemma4Assistant, Gemma4AssistantConfig  # noqa: E402
from jaxgen.models.gemma4_checkpoint import gemma4_config  # noqa: E402

K, NEW = 3, 24
PROMPTS = [[5, 17, 33, 2, 60, 61, 8, 90, 44, 3, 12], [7, 8, 9]]
ASSISTANT_TEXT = dict(vocab_size=96, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                      global_head_dim=16, sliding_window=3,
                      layer_types=["sliding_attention", "full_attention"],
                      hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
                      attention_k_eq_v=True, num_global_key_value_heads=2)


def hf_pair(ordered: bool):
    """A target (window 6) and an assistant that passes the token's embedding through to the
    target's own embedding table, perturbed: some drafts are accepted, some rejected."""
    hf = make_hf_gemma4(seed=3, sliding_window=6)
    config = transformers.Gemma4AssistantConfig(
        text_config=dict(ASSISTANT_TEXT), backbone_hidden_size=32,
        use_ordered_embeddings=ordered, num_centroids=8, centroid_intermediate_top_k=3)
    config.text_config._attn_implementation = "eager"
    assistant = transformers.Gemma4AssistantForCausalLM(config)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in assistant.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(p + 0.3 * noise if "norm" in name else 0.1 * noise)
        assistant.model.embed_tokens.weight.copy_(hf.model.embed_tokens.weight)
        assistant.pre_projection.weight[:, :32] += torch.eye(32)
        if ordered:
            assistant.masked_embedding.token_ordering.copy_(torch.randperm(96, generator=gen))
    assistant.eval().generation_config.num_assistant_tokens = K
    return hf, assistant


def hf_assisted(hf, assistant, prompt, monkeypatch):
    """transformers' tokens and, per round, the number of drafts and of accepted drafts."""
    rounds = []
    original = candidate_generator.SinglePositionMultiTokenCandidateGenerator.get_candidates

    def recording(self, input_ids, **kw):
        out = original(self, input_ids, **kw)
        if out[1] is not None:
            rounds.append((input_ids.shape[1], out[0][0, input_ids.shape[1]:].tolist()))
        return out

    monkeypatch.setattr(candidate_generator.SinglePositionMultiTokenCandidateGenerator,
                        "get_candidates", recording)
    with torch.no_grad():
        seq = hf.generate(torch.tensor([prompt]), assistant_model=assistant,
                          max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0].tolist()
    accepted = []
    for length, drafts in rounds:
        n = 0
        while n < len(drafts) and seq[length + n] == drafts[n]:
            n += 1
        accepted.append((len(drafts), n))
    return seq, accepted


CFG = jaxgen.GenerationConfig(max_new_tokens=NEW, num_assistant_tokens=K,
                              num_assistant_tokens_schedule="constant", assistant_fallback=False,
                              assistant_confidence_threshold=0.0, pad_token_id=0)


def jax_assisted(model, params, assistant, prompts, cfg=CFG, key=None):
    return jaxgen.generate(params, jaxgen.init_state(model, prompts, cfg, key), cfg,
                           assistant_model=assistant)


@pytest.fixture(scope="module", params=["plain", pytest.param("ordered", marks=pytest.mark.slow)])
def loaded(request, tmp_path_factory):
    hf, assistant = hf_pair(request.param == "ordered")
    folder = tmp_path_factory.mktemp(f"gemma4_{request.param}")
    hf.save_pretrained(str(folder / "target"))
    assistant.save_pretrained(str(folder / "assistant"))
    model, params, _ = load(str(folder / "target"))
    drafter, drafter_params, _ = load(str(folder / "assistant"))
    return hf, assistant, model, params, (drafter, drafter_params)


@pytest.mark.parametrize("prompt", PROMPTS, ids=["past_the_windows", "short"])
def test_tokens_drafts_and_accepted_counts_match_transformers(loaded, prompt, monkeypatch):
    hf, hf_assistant, model, params, assistant = loaded
    assert isinstance(assistant[0], Gemma4Assistant)
    expected, rounds = hf_assisted(hf, hf_assistant, prompt, monkeypatch)
    out = jax_assisted(model, params, assistant, [prompt])
    assert np.asarray(out.sequences)[0, :int(out.lengths[0])].tolist() == expected
    stats = out.speculative
    # transformers records no round for a last step without room for drafts; jaxgen does
    assert int(stats.rounds[0]) in (len(rounds), len(rounds) + 1)
    assert int(stats.drafted[0]) == sum(d for d, _ in rounds)
    assert int(stats.accepted[0]) == sum(n for _, n in rounds)
    per_position = [sum(n > j for _, n in rounds) for j in range(K)]
    assert np.asarray(stats.position_accepted)[0].tolist() == per_position
    assert 0 < sum(n for _, n in rounds) < sum(d for d, _ in rounds)  # both paths ran


@pytest.mark.slow
def test_ragged_batch_equals_each_row_alone(loaded):
    _, _, model, params, assistant = loaded
    prompts = PROMPTS + [[40, 41, 42, 43, 44, 45, 46], [9]]
    batched = jax_assisted(model, params, assistant, prompts)
    for b, prompt in enumerate(prompts):
        alone = jax_assisted(model, params, assistant, [prompt])
        length = int(alone.lengths[0])
        assert int(batched.lengths[b]) == length
        assert np.asarray(batched.sequences)[b, :length].tolist() == \
            np.asarray(alone.sequences)[0, :length].tolist()
        for field in ("drafted", "accepted"):
            assert int(getattr(batched.speculative, field)[b]) == \
                int(getattr(alone.speculative, field)[0])


@pytest.mark.slow
def test_sampling_is_lossless():
    text = dict(vocab_size=SMALL_V, hidden_size=16, intermediate_size=16,
                num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                global_head_dim=8, sliding_window=2, hidden_size_per_layer_input=4,
                vocab_size_per_layer_input=SMALL_V, num_kv_shared_layers=1,
                layer_types=["sliding_attention", "full_attention", "full_attention"])
    model = Gemma4(gemma4_config(text))
    params = model.init_params(jax.random.key(0))
    params = jax.tree_util.tree_map(lambda a: a * 25.0 if a.ndim == 2 else a, params)  # peaked
    drafter = Gemma4Assistant(Gemma4AssistantConfig(
        text=gemma4_config({**text, "hidden_size": 8, "num_hidden_layers": 2,
                            "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0,
                            "layer_types": ["sliding_attention", "full_attention"]}),
        backbone_hidden_size=16))
    assistant = (drafter, drafter.init_params(jax.random.key(3), scale=0.8))
    prompt = [2, 3, 2, 3, 2]
    exact = three_token_joint(model, params, prompt)  # [V, V, V]
    cfg = jaxgen.GenerationConfig(do_sample=True, temperature=TEMPERATURE, top_k=TOP_K,
                                  max_new_tokens=4, num_assistant_tokens=2,
                                  assistant_confidence_threshold=0.0, pad_token_id=0)
    out = jax_assisted(model, params, assistant, [prompt] * 12000, cfg, jax.random.key(11))
    assert_follows(first_three_counts(out.sequences, len(prompt), SMALL_V), exact)
    accepted = int(np.sum(out.speculative.accepted))
    assert 0 < accepted < int(np.sum(out.speculative.drafted))


def test_a_non_gemma4_target_is_refused():
    drafter = Gemma4Assistant(Gemma4AssistantConfig(
        text=gemma4_config(dict(ASSISTANT_TEXT)), backbone_hidden_size=32))
    target, params = jaxgen.models.tiny_llama()
    with pytest.raises(ValueError, match="Gemma 4 target"):
        jax_assisted(target, params, (drafter, drafter.init_params(jax.random.key(0))),
                     [[1, 2]])
