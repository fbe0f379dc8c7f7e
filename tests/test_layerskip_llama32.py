"""Self-speculative early exit on a Llama 3.2-shaped checkpoint (the architecture of Hugging
Face's example `facebook/layerskip-llama3.2-1B`: llama3 RoPE scaling, tied embeddings, grouped
KV heads): a tiny random model saved by transformers and loaded with `jaxgen.models.load`
gives transformers' `generate(assistant_early_exit=E)` tokens and accepted drafts round for
round."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from model_fixtures import LLAMA3_SCALING, make_hf_model, save_hf_model
from test_chunked import Collect

import jaxgen
from jaxgen.drivers.chunked import ChunkTimings
from jaxgen.models import load

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LLAMA32 = dict(num_hidden_layers=4, num_key_value_heads=2, tie_word_embeddings=True,
               rope_scaling=LLAMA3_SCALING, rope_theta=500000.0, head_dim=16)
PROMPT, NEW, DRAFTS = [5, 3, 7, 1, 9, 5, 3], 24, 4


def _hf_rounds(hf, exit_layer):
    """transformers' greedy early-exit generate: (tokens, accepted drafts per round)."""
    from transformers.generation.candidate_generator import AssistedCandidateGenerator

    matches, original = [], AssistedCandidateGenerator.update_candidate_strategy

    def record(self, input_ids, scores, num_matches):
        matches.append(int(num_matches))
        return original(self, input_ids, scores, num_matches)

    AssistedCandidateGenerator.update_candidate_strategy = record
    try:
        with torch.no_grad():
            out = hf.generate(torch.tensor([PROMPT]), assistant_early_exit=exit_layer,
                              do_sample=False, max_new_tokens=NEW, pad_token_id=0,
                              num_assistant_tokens=DRAFTS,
                              num_assistant_tokens_schedule="constant")
    finally:
        AssistedCandidateGenerator.update_candidate_strategy = original
    return out[0].tolist(), matches


def _jaxgen_rounds(model, params, exit_layer):
    """jaxgen's greedy early-exit run, one round per chunk: (tokens, accepted per round)."""
    cfg = jaxgen.GenerationConfig(max_new_tokens=NEW, assistant_early_exit=exit_layer,
                                  num_assistant_tokens=DRAFTS,
                                  num_assistant_tokens_schedule="constant",
                                  assistant_fallback=False, pad_token_id=0)
    timings = ChunkTimings()

    class ByChunk(Collect):  # each token put, tagged with the chunk (round) it came in
        chunk_of: list = []

        def put(self, value):
            super().put(value)
            self.chunk_of.append(len(timings.chunk_s))

    out = jaxgen.generate(params, jaxgen.init_state(model, [PROMPT], cfg), cfg,
                          streamer=ByChunk(), chunk_size=1, timings=timings)
    emitted = [len(list(group)) for _, group in itertools.groupby(ByChunk.chunk_of)]
    # the first chunk is the prompt and the prefill's token; each later one a round
    return (np.asarray(out.sequences[0, :int(out.lengths[0])]).tolist(),
            [count - 1 for count in emitted[1:]])


def test_layerskip_llama32_matches_transformers_round_for_round(tmp_path):
    exit_layer = 3  # of 4 (at 2 this random model's early exit never agrees with the target)
    hf = make_hf_model("llama", seed=3, **LLAMA32)
    hf.generation_config.eos_token_id = None  # run the whole budget
    model, params, _ = load(save_hf_model(hf, str(tmp_path)))
    assert dict(model.config.rope_scaling)["rope_type"] == "llama3"
    assert model.config.tie_word_embeddings and "lm_head" not in params
    hf_tokens, hf_accepted = _hf_rounds(hf, exit_layer)
    tokens, accepted = _jaxgen_rounds(model, params, exit_layer)
    assert tokens == hf_tokens
    assert 0 < sum(accepted) < DRAFTS * len(accepted)  # accepted and rejected drafts
    # transformers has no separate prefill: its first round drafts the first new token from
    # the prompt, which jaxgen's prefill emits. With none of that round's drafts accepted (as
    # here) it emits that one token too, and its later rounds are jaxgen's rounds.
    assert hf_accepted[0] == 0
    assert hf_accepted[1:] == accepted
