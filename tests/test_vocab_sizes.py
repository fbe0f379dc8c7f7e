"""A model with more ids than its tokenizer: one warning at load naming both sizes, and the
extra ids decode as transformers decodes them (to nothing; the ids stay in the output)."""
from __future__ import annotations

import json
import os
import warnings

import pytest

from jaxgen.models import load, tiny_llama, tiny_tokenizer
from jaxgen.models.hf_export import save_hf_checkpoint
from jaxgen.models.tiny import TINY_VOCAB


def _folder(tmp_path, vocab_size: int) -> str:
    model, params = tiny_llama(seed=1, vocab_size=vocab_size)
    folder = save_hf_checkpoint(model, params, str(tmp_path / f"v{vocab_size}"))
    tiny_tokenizer().backend.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "</s>"}, f)
    return folder


def _vocab_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "has a vocabulary of" in str(w.message)]


def test_a_larger_model_vocabulary_warns_once_naming_both_sizes(tmp_path):
    folder = _folder(tmp_path, 300)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, _, tokenizer = load(folder)
        load(folder)
    [message] = _vocab_warnings(caught)
    assert f"{folder!r} has a vocabulary of 300 ids but its tokenizer only {TINY_VOCAB}" \
        in message
    assert f"ids {TINY_VOCAB}..299 decode to nothing (as in transformers" in message
    assert "\n" not in message
    assert model.vocab_size == 300 and len(tokenizer) == TINY_VOCAB


def test_extra_ids_decode_as_transformers_decodes_them(tmp_path):
    transformers = pytest.importorskip("transformers")
    folder = _folder(tmp_path, 300)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, _, tokenizer = load(folder)
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=os.path.join(
        folder, "tokenizer.json"), eos_token="</s>")
    ids = tokenizer.encode("the stop") + [280, 299] + tokenizer.encode(" op")
    assert tokenizer.decode(ids) == theirs.decode(ids) == "the stop op"
    assert tokenizer.convert_ids_to_tokens([280]) == theirs.convert_ids_to_tokens([280]) == [None]


@pytest.mark.parametrize("vocab_size", [TINY_VOCAB, 200])
def test_no_warning_when_the_tokenizer_covers_the_model(tmp_path, vocab_size):
    folder = _folder(tmp_path, vocab_size)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load(folder)
    assert _vocab_warnings(caught) == []
