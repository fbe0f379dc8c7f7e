"""Universal assisted decoding with a Gemma 2 target: a tiny Llama assistant with another
tokenizer (the byte-level BPEs of tests/test_uad.py), jaxgen's tokens against transformers'
UAD (`generate(..., assistant_model=, tokenizer=, assistant_tokenizer=)`), fp32."""
from __future__ import annotations

import pytest
import torch
from model_fixtures import make_hf_model
from test_gemma import make_hf_gemma
from test_uad import FEWER_RAW, FEWER_TOK, TARGET_RAW, TARGET_TOK, TEXTS

import jaxgen
from jaxgen.models import load

transformers = pytest.importorskip("transformers")

PROMPTS = [TARGET_TOK.encode(t) for t in TEXTS]
EOS = TARGET_TOK.eos_token_id
GREEDY = dict(max_new_tokens=16, num_assistant_tokens=3, eos_token_id=EOS, pad_token_id=0)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(jaxgen target, params, HF target, jaxgen assistant, HF assistant)."""
    hf_target = make_hf_gemma("gemma2", seed=3, vocab_size=len(TARGET_TOK), eos_token_id=EOS)
    hf_assistant = make_hf_model("llama", seed=4, vocab_size=len(FEWER_TOK),
                                 eos_token_id=FEWER_TOK.eos_token_id, bos_token_id=None,
                                 num_hidden_layers=1)
    folders = [str(tmp_path_factory.mktemp(name)) for name in ("target", "assistant")]
    hf_target.save_pretrained(folders[0])
    hf_assistant.save_pretrained(folders[1])
    target, params, _ = load(folders[0])
    assistant, assistant_params, _ = load(folders[1])
    return target, params, hf_target, (assistant, assistant_params), hf_assistant


def fast(raw):
    return transformers.PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>")


@pytest.mark.slow  # about 90 s on 2 cores: UAD's four programs, transformers' UAD
def test_uad_tokens_equal_transformers_uad_and_plain_greedy(models):
    target, params, hf_target, assistant, hf_assistant = models
    ours = jaxgen.generate_ids(target, params, PROMPTS, assistant_model=assistant,
                               tokenizer=TARGET_TOK, assistant_tokenizer=FEWER_TOK,
                               assistant_confidence_threshold=0.0, **GREEDY)
    plain = jaxgen.generate_ids(target, params, PROMPTS, **{
        k: v for k, v in GREEDY.items() if k != "num_assistant_tokens"})
    assert ours == plain
    for b in (0, 3):  # HF's UAD runs one row at a time
        prompt = PROMPTS[b]
        with torch.no_grad():
            hf = hf_target.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                                                  dtype=torch.long),
                assistant_model=hf_assistant, tokenizer=fast(TARGET_RAW),
                assistant_tokenizer=fast(FEWER_RAW), do_sample=False, **GREEDY)
        row = hf[0].tolist()
        if EOS in row[len(prompt):]:
            row = row[:row.index(EOS, len(prompt)) + 1]
        assert ours[b] == row, f"row {b}"
