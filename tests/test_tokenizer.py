"""Tokenizer parity with transformers (HF folders) and the GGUF-built SmolLM2 tokenizer."""
from __future__ import annotations

import json
import os

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from jaxgen.models import DEFAULT_MODEL, Tokenizer, load

CORPUS = ["Hello world, this is a tiny corpus for a tiny tokenizer.",
          "Numbers like 12345 and 2024 appear; café, naïve, 日本語, emoji 🎉.",
          "The quick brown fox jumps over the lazy dog. " * 3]
TEXTS = ["Hello world!", "  leading spaces and 42 numbers", "café 日本 🎉 <s>inline</s> end",
         "", "The lazy dog<|user|>"]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}"
            "{% if m['role'] not in ['user', 'assistant', 'system'] %}"
            "{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
            "<|{{ m['role'] }}|>\n  {{ m['content'] | trim }}{{ eos_token }}\n"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": " What is 2+2? 日本 "}]


def _write_tokenizer(folder: str, config: dict, post: str = "bytelevel") -> None:
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    if post == "bytelevel":
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(CORPUS, trainer)
    backend.add_special_tokens(["<|user|>", "<|assistant|>", "<|system|>"])
    if post == "template":  # Llama-3 style: tokenizer.json itself adds BOS
        bos = backend.token_to_id("<s>")
        backend.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    os.makedirs(folder, exist_ok=True)
    backend.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", **config}, f)


CONFIGS = {  # transformers>=5 ignores add_bos/eos_token when tokenizer.json exists
    "no_post_processor": dict(bos_token="<s>", eos_token="</s>", add_bos_token=True,
                              chat_template=TEMPLATE),
    "template_bos": dict(bos_token="<s>", eos_token="</s>", chat_template=TEMPLATE),
    "bos_explicit": dict(bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                         add_bos_token=True, chat_template=TEMPLATE),
    "bos_and_eos": dict(bos_token="<s>", eos_token="</s>", add_bos_token=True,
                        add_eos_token=True, chat_template=TEMPLATE),
    "keep_post_processor": dict(bos_token={"content": "<s>", "__type": "AddedToken"},
                                eos_token="</s>", unk_token="<unk_new>", chat_template=TEMPLATE),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    from transformers import AutoTokenizer

    folder = str(tmp_path_factory.mktemp(request.param))
    post = {"no_post_processor": "none", "template_bos": "template"}.get(request.param,
                                                                         "bytelevel")
    _write_tokenizer(folder, CONFIGS[request.param], post)
    return Tokenizer.from_hf_folder(folder), AutoTokenizer.from_pretrained(folder)


def test_encode_decode_match_transformers(pair):
    ours, theirs = pair
    for text in TEXTS:
        for add in (True, False):
            assert ours.encode(text, add_special_tokens=add) == \
                theirs.encode(text, add_special_tokens=add), (text, add)
        ids = theirs.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == \
                theirs.decode(ids, skip_special_tokens=skip)


def test_special_tokens_and_vocab_match_transformers(pair):
    ours, theirs = pair
    assert ours.bos_token_id == theirs.bos_token_id
    assert ours.eos_token_id == theirs.eos_token_id
    assert ours.pad_token_id == theirs.pad_token_id
    assert set(ours.all_special_ids) == set(theirs.all_special_ids)
    assert ours.vocab_size == theirs.vocab_size and len(ours) == len(theirs)
    assert ours.get_vocab() == theirs.get_vocab()
    ids = theirs.encode("Hello café")
    assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)
    assert isinstance(ours.backend, tokenizers.Tokenizer)


def test_chat_template_matches_transformers(pair):
    ours, theirs = pair
    for gen in (True, False):
        text = theirs.apply_chat_template(MESSAGES, add_generation_prompt=gen, tokenize=False)
        assert ours.apply_chat_template(MESSAGES, add_generation_prompt=gen,
                                        tokenize=False) == text
        assert ours.apply_chat_template(MESSAGES, add_generation_prompt=gen) == \
            theirs.encode(text, add_special_tokens=False)
    import jinja2

    with pytest.raises(jinja2.exceptions.TemplateError, match="bad role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])


@pytest.fixture(scope="module")
def smol():
    return load(DEFAULT_MODEL)[2]


@pytest.mark.parametrize("text", [
    "Hello, world! 1234567890 and 3.14159",
    "Accents: café, naïve, São Paulo, Ærøskøbing, straße",
    "日本語のテキストです。東京は大きい。",
    "Emoji: 🎉👍🏽 👨‍👩‍👧 ❤️",
    "  spaces\tand\nnewlines  \n\n",
    "Mixed: <|im_start|> not special unless exact? ok",
])
def test_gguf_tokenizer_round_trips(smol, text):
    assert smol.decode(smol.encode(text)) == text


def test_gguf_tokenizer_digits_and_specials(smol):
    digits = smol.encode("12345")
    assert len(digits) == 5 and smol.decode(digits) == "12345"
    assert smol.encode("<|im_start|>") == [1] and smol.encode("<|im_end|>") == [2]
    assert smol.bos_token_id == 1 and smol.eos_token_id == 2
    assert set(range(17)) <= set(smol.all_special_ids)
    assert smol.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]
    assert smol.encode("Hello") == smol.encode("Hello", add_special_tokens=False)  # no BOS


def test_gguf_chat_prompt(smol):
    text = smol.apply_chat_template([{"role": "user", "content": "Hi there"}], tokenize=False)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                    "Hugging Face<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = smol.apply_chat_template([{"role": "user", "content": "Hi there"}])
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2
    assert smol.decode(ids) == text
    assert "<|im_start|>" not in smol.decode(ids, skip_special_tokens=True)


def test_gguf_tokenizer_matches_transformers_gguf_conversion(smol):
    """transformers' own GGUF tokenizer conversion agrees on ids (independent check)."""
    from model_fixtures import smollm2_gguf_path
    from transformers import AutoTokenizer

    path = smollm2_gguf_path()
    theirs = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    for text in ["Hello, world! 1234567890 and 3.14159", "café naïve 日本語のテキスト 🎉👍🏽",
                 "  spaces\tand\nnew  \n\n x", "<|im_start|>user\nhi<|im_end|>\n"]:
        assert smol.encode(text) == theirs.encode(text), text
