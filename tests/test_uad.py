"""Universal assisted decoding: an assistant with another tokenizer (jaxgen.drivers.uad).

Byte-level BPEs are trained here on a small text (its characters only, so every token
decodes to valid text): the target's (265 tokens) and two assistants' — one with fewer merges
(240 tokens) and every id shifted by an extra special token, one trained on the reversed text
(267 tokens, other merges). The "mirrored" assistant copies the target's
embedding / head rows of every shared token string, so its drafts are often right and the
accept paths run; the other is random.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
from exact_sampling import chi_square
from stubs import BigramStub
from test_speculative import _exact_joint
from tokenizers import decoders, models, pre_tokenizers, trainers

import jaxgen
from jaxgen.api.generate import default_config, outputs_to_lists
from jaxgen.models import tiny_llama
from jaxgen.models.tokenizer import Tokenizer
from jaxgen.speculative.uad.align import GreedyRow, tokens_diag
from jaxgen.speculative.uad.bridge import TokenBridge

TEXT = ("the quick brown fox jumps over the lazy dog. a stitch in time saves nine. to be or "
        "not to be, that is the question. all that glitters is not gold. every cloud has a "
        "silver lining. when in rome, do as the romans do. the early bird catches the worm. "
        "actions speak louder than words. better late than never. birds of a feather flock "
        "together. curiosity killed the cat. do not count your chickens before they hatch. "
        "fortune favours the bold. honesty is the best policy. knowledge is power. practice "
        "makes perfect. where there is smoke there is fire. you can lead a horse to water. ") * 8


def byte_bpe(vocab_size: int, specials=(), text: str = TEXT) -> tokenizers.Tokenizer:
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[*specials, "</s>"],
                                  show_progress=False)  # the text's characters only: every
    #                                                     token decodes to valid text
    backend.train_from_iterator([text], trainer)
    return backend


TARGET_RAW = byte_bpe(300)
FEWER_RAW = byte_bpe(240, specials=("<pad>",))  # a subset of the merges, ids shifted by one
REVERSED_RAW = byte_bpe(280, text=TEXT[::-1])  # other merges
TARGET_TOK = Tokenizer(TARGET_RAW, special_tokens={"eos_token": "</s>"})
FEWER_TOK = Tokenizer(FEWER_RAW, special_tokens={"eos_token": "</s>"})
REVERSED_TOK = Tokenizer(REVERSED_RAW, special_tokens={"eos_token": "</s>"})
MODEL, PARAMS = tiny_llama(seed=1, vocab_size=len(TARGET_TOK), num_layers=2)
EOS = TARGET_TOK.eos_token_id


def mirrored_assistant(assistant_tok, seed: int = 2):
    """A one-layer assistant holding the target's embedding and head rows for every token
    string the two vocabularies share (random rows elsewhere)."""
    bridge = TokenBridge(TARGET_TOK, assistant_tok, MODEL.vocab_size, len(assistant_tok))
    model, params = tiny_llama(seed=seed, vocab_size=len(assistant_tok), num_layers=2)
    shared = bridge.to_target >= 0  # [Va]
    index = np.where(shared, bridge.to_target, 0)
    embed = np.where(shared[:, None], np.asarray(PARAMS["embed"])[index],
                     np.asarray(params["embed"]) * 0.1)
    head = np.where(shared[None, :], np.asarray(PARAMS["lm_head"])[:, index],
                    np.asarray(params["lm_head"]) * 0.1)
    return model, {**PARAMS, "embed": jnp.asarray(embed), "lm_head": jnp.asarray(head)}


MIRRORED = mirrored_assistant(FEWER_TOK)
RANDOM = tiny_llama(seed=3, vocab_size=len(REVERSED_TOK), num_layers=1)
TEXTS = ["the quick brown", "to be or not", "all", "a stitch in time saves nine. to"]
PROMPTS = [TARGET_TOK.encode(t) for t in TEXTS]
GREEDY = dict(max_new_tokens=24, num_assistant_tokens=3, eos_token_id=EOS, pad_token_id=0,
              assistant_confidence_threshold=0.0)


def greedy_rows(prompts, **kw):
    return jaxgen.generate_ids(MODEL, PARAMS, prompts, **{**GREEDY, **kw})


# ------------------------------------------------------------------ greedy == plain greedy
PAIRS = {"mirrored": (MIRRORED, FEWER_TOK), "random": (RANDOM, REVERSED_TOK)}


@functools.lru_cache(maxsize=None)
def uad_greedy(pair: str):
    """(rows, output, programs compiled) of greedy UAD on PROMPTS (a ragged batch of 4)."""
    assistant, tok = PAIRS[pair]
    before = jaxgen.trace_count()
    cfg = default_config(MODEL, None, **GREEDY)
    out = jaxgen.generate(PARAMS, jaxgen.init_state(MODEL, PROMPTS, cfg), cfg,
                          assistant_model=assistant, tokenizer=TARGET_TOK,
                          assistant_tokenizer=tok)
    return outputs_to_lists(out), out, jaxgen.trace_count() - before


@pytest.mark.parametrize("pair", ["mirrored", pytest.param("random", marks=pytest.mark.slow)])
def test_greedy_uad_equals_plain_greedy_ragged_batch(pair):
    rows, out, compiled = uad_greedy(pair)
    assert rows == greedy_rows(PROMPTS)
    stats = out.speculative
    assert int(np.sum(stats.drafted)) > 0
    if pair == "mirrored":  # the assistant often agrees: whole drafts pass
        assert int(np.sum(stats.accepted)) > 0
        assert float(np.mean(stats.tokens_per_round)) > 1.5
    # start, assistant prefill, draft, verify; new prompts of the same buckets (the
    # target's and the assistant's) reuse them all
    assert compiled == 4
    before = jaxgen.trace_count()
    other = [TARGET_TOK.encode(t) for t in ("that is", "not gold", "the lazy dog",
                                            "a stitch in time saves nine. be")]
    assistant, tok = PAIRS[pair]
    got = jaxgen.generate_ids(MODEL, PARAMS, other, assistant_model=assistant,
                              tokenizer=TARGET_TOK, assistant_tokenizer=tok, **GREEDY)
    assert jaxgen.trace_count() == before, "recompiled"
    assert got == greedy_rows(other)


@pytest.mark.slow
def test_greedy_uad_batch_one_and_raw_tokenizers():
    """Batch 1 and tokenizers.Tokenizer objects (no wrapper)."""
    for prompt in PROMPTS:
        got = jaxgen.generate_ids(MODEL, PARAMS, [prompt], assistant_model=MIRRORED,
                                  tokenizer=TARGET_RAW, assistant_tokenizer=FEWER_RAW, **GREEDY)
        assert got == greedy_rows([prompt])


# ------------------------------------------------------------------ Hugging Face's UAD
def test_same_tokens_as_hugging_face_uad():
    """HF's UAD runs one row at a time; each row of jaxgen's batch is checked against it."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from jaxgen.models.hf_export import hf_from_jaxgen

    def fast(raw):
        return transformers.PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>")

    hf_target, hf_assistant = hf_from_jaxgen(MODEL, PARAMS), hf_from_jaxgen(*MIRRORED)
    ours, _, _ = uad_greedy("mirrored")
    for b in (0, 3):
        prompt = PROMPTS[b]
        with torch.no_grad():
            hf = hf_target.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                                                  dtype=torch.long),
                assistant_model=hf_assistant, tokenizer=fast(TARGET_RAW),
                assistant_tokenizer=fast(FEWER_RAW), do_sample=False,
                max_new_tokens=GREEDY["max_new_tokens"], eos_token_id=EOS, pad_token_id=0,
                num_assistant_tokens=GREEDY["num_assistant_tokens"])
        assert ours[b] == hf[0].tolist(), f"row {b}"


def test_alignment_rules_match_hugging_face():
    """tokens_diag against HF's own static method, on random id pairs."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    reference = transformers.generation.candidate_generator \
        .AssistedCandidateGeneratorDifferentTokenizers._get_tokens_diag
    rng = np.random.default_rng(0)
    for _ in range(200):
        prompt = rng.integers(0, 4, size=rng.integers(1, 8)).tolist()
        extended = rng.integers(0, 4, size=rng.integers(1, 8)).tolist()
        want = reference(torch.tensor([prompt]), torch.tensor([extended]))
        got = tokens_diag(prompt, extended)
        if want[0] is None:
            assert got == (None, None, None)
        else:
            assert got == (int(want[0]), want[1][0].tolist(), want[2][0].tolist())


def test_greedy_row_replaces_rejected_drafts():
    row = GreedyRow(prev_assistant=[1, 2, 3, 9, 9], prev_target_len=12)
    # the target kept 1 2 3 then said 4 5: the two rejected drafts 9 9 give way to 4 5
    window, full = row.target_window(list(range(14)), lookbehind=10)
    assert not full and window == list(range(2, 14))
    assert row.assistant_input(list(range(14)), [2, 3, 4, 5], full) == [1, 2, 3, 4, 5]


def test_vocabulary_map_matches_hugging_face_and_normalises_space_marks():
    transformers = pytest.importorskip("transformers")
    fast = lambda raw: transformers.PreTrainedTokenizerFast(tokenizer_object=raw)  # noqa: E731
    translator = transformers.generation.candidate_generator.AssistantToTargetTranslator(
        fast(TARGET_RAW), fast(FEWER_RAW), MODEL.vocab_size)
    bridge = TokenBridge(TARGET_TOK, FEWER_TOK, MODEL.vocab_size, len(FEWER_TOK))
    want = translator._assistant_to_target_input_ids.numpy()
    np.testing.assert_array_equal(bridge.to_target[:len(want)], want)
    # a SentencePiece-style assistant ("▁the") maps onto byte-level target tokens ("Ġthe")
    vocab = {"▁": 0, "t": 1, "h": 2, "e": 3, "▁the": 4, "▁zz": 5}
    spm = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="▁"))
    spm.pre_tokenizer = pre_tokenizers.Metaspace()
    mapped = TokenBridge(TARGET_TOK, spm, MODEL.vocab_size, 6).to_target
    assert mapped[4] == TARGET_RAW.token_to_id("Ġthe") and mapped[5] == -1
    assert mapped[1] == TARGET_RAW.token_to_id("t")


# ------------------------------------------------------------------ lossless sampling
def char_bpe(chars, merges) -> tokenizers.Tokenizer:
    vocab = {c: i for i, c in enumerate(chars)}
    for left, right in merges:
        vocab[left + right] = len(vocab)
    backend = tokenizers.Tokenizer(models.BPE(vocab, merges))
    backend.decoder = decoders.Fuse()
    return backend


SMALL_TARGET = char_bpe(["a", "b", "c", "d", "e"], [("a", "b")])  # "ab": no assistant twin
SMALL_ASSISTANT = char_bpe(["e", "d", "c", "b", "a"], [("c", "d"), ("e", "e")])  # "cd", "ee":
#                                                                     no target twin


@pytest.mark.parametrize("draft_kind", ["random", "unmapped-heavy"])
def test_sampling_across_vocabularies_is_lossless(draft_kind):
    rng = np.random.default_rng(7)
    target = rng.normal(size=(6, 6)).astype(np.float32) * 1.5
    draft = rng.normal(size=(7, 7)).astype(np.float32) * 1.5
    if draft_kind == "unmapped-heavy":  # most of the draft's mass on "cd" / "ee"
        draft[:, 5:] += 3.0
    model, assistant = BigramStub(vocab_size=6, pad_token_id=0), BigramStub(vocab_size=7)
    prompt = SMALL_TARGET.encode("cdcdc").ids  # the assistant reads it as "cd" "cd" "c"
    rows = 12000
    cfg = jaxgen.GenerationConfig(do_sample=True, temperature=0.8, top_k=4, max_new_tokens=4,
                                  pad_token_id=0, num_assistant_tokens=2,
                                  assistant_confidence_threshold=0.0)
    state = jaxgen.init_state(model, [prompt] * rows, cfg, jax.random.key(11))
    out = jaxgen.generate({"table": jnp.asarray(target)}, state, cfg,
                          assistant_model=(assistant, {"table": jnp.asarray(draft)}),
                          tokenizer=SMALL_TARGET, assistant_tokenizer=SMALL_ASSISTANT)
    new = np.asarray(out.sequences)[:, len(prompt):len(prompt) + 3]  # [rows, 3]
    assert (np.asarray(out.lengths) == len(prompt) + 4).all()
    counts = np.zeros((6,) * 3)
    np.add.at(counts, (new[:, 0], new[:, 1], new[:, 2]), 1)
    exact = _exact_joint(target, prompt[-1], 3)
    assert chi_square(counts, exact) > 1e-3
    assert 0.5 * np.abs(counts / rows - exact).sum() < 0.05
    drafted, accepted = int(np.sum(out.speculative.drafted)), int(np.sum(out.speculative.accepted))
    assert 0 < accepted < drafted


@pytest.mark.slow
def test_sampled_rows_do_not_depend_on_the_batch():
    cfg = dict(do_sample=True, temperature=0.9, max_new_tokens=12, num_assistant_tokens=2,
               eos_token_id=EOS, pad_token_id=0)
    keys = jax.random.split(jax.random.key(5), 2)
    kw = dict(assistant_model=MIRRORED, tokenizer=TARGET_TOK, assistant_tokenizer=FEWER_TOK)
    both = jaxgen.generate_ids(MODEL, PARAMS, PROMPTS[:2], key=keys, **kw, **cfg)
    alone = jaxgen.generate_ids(MODEL, PARAMS, PROMPTS[1:2], key=keys[1:], **kw, **cfg)
    assert both[1] == alone[0]


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("kw, needle", [
    (dict(assistant_model=RANDOM), "assistant_tokenizer"),
    (dict(assistant_model=RANDOM, tokenizer=TARGET_TOK), "assistant_tokenizer"),
    (dict(assistant_model=RANDOM, assistant_tokenizer=REVERSED_TOK), "tokenizer="),
    (dict(assistant_tokenizer=REVERSED_TOK, tokenizer=TARGET_TOK), "assistant_model"),
    (dict(assistant_model=RANDOM, tokenizer=TARGET_TOK, assistant_tokenizer=REVERSED_TOK,
          num_beams=2), "num_beams"),
    (dict(assistant_model=RANDOM, tokenizer=TARGET_TOK, assistant_tokenizer=REVERSED_TOK,
          prompt_lookup_num_tokens=2), "one way of drafting"),
    (dict(assistant_model=tiny_llama(vocab_size=100), tokenizer=TARGET_TOK,
          assistant_tokenizer=REVERSED_TOK), "assistant model's vocabulary"),
    (dict(assistant_model=RANDOM, tokenizer=TARGET_TOK, assistant_tokenizer=object()),
     "must be a tokenizer"),
    (dict(assistant_model=RANDOM, tokenizer=TARGET_TOK, assistant_tokenizer=REVERSED_TOK,
          assistant_ensemble_weight=0.5), "assistant_ensemble_weight"),
])
def test_bad_input_fails_before_compiling(kw, needle):
    before = jaxgen.trace_count()
    with pytest.raises(ValueError, match=needle):
        jaxgen.generate_ids(MODEL, PARAMS, PROMPTS[:1], **{**GREEDY, **kw})
    assert jaxgen.trace_count() == before


def test_generate_text_with_an_assistant_tokenizer_and_streamers():
    from jaxgen.drivers.streamers import TextStreamer

    class Collect(TextStreamer):
        def __init__(self):
            super().__init__(TARGET_TOK, skip_prompt=True)
            self.pieces = []

        def on_finalized_text(self, text, stream_end=False):
            self.pieces.append(text)

    streamers = [Collect() for _ in TEXTS]
    texts = jaxgen.generate_text(MODEL, PARAMS, TARGET_TOK, TEXTS, assistant_model=MIRRORED,
                                 assistant_tokenizer=FEWER_TOK, streamer=streamers, **GREEDY)
    rows, _, _ = uad_greedy("mirrored")
    assert texts == [TARGET_TOK.decode(row[len(p):], skip_special_tokens=True)
                     for row, p in zip(rows, PROMPTS)]
    assert texts == ["".join(s.pieces) for s in streamers]
