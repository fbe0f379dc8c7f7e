"""Tokenizer parity with transformers (HF folders) and the GGUF-built SmolLM2 tokenizer."""
from __future__ import annotations

import json
import os

import jax
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


# ----------------------------------------------------------------------------- side files
TOKENIZER_CONFIG, SPECIAL_MAP = "tokenizer_config.json", "special_tokens_map.json"
SIDE_FILE_CASES = [  # (file name, content: JSON value or raw bytes) -> what the error names
    (TOKENIZER_CONFIG, [], r"tokenizer_config\.json: the top level is a list; allowed: a JSON "
                           r"object"),
    (TOKENIZER_CONFIG, None, r"tokenizer_config\.json: the top level is null"),
    (SPECIAL_MAP, [], r"special_tokens_map\.json: the top level is a list"),
    (TOKENIZER_CONFIG, {"chat_template": [{"name": "x"}]},
     r"chat_template\[0\]=\{'name': 'x'\}; allowed: \{\"name\": str, \"template\": str\}"),
    (TOKENIZER_CONFIG, {"chat_template": ["abc"]}, r"chat_template\[0\]='abc'; allowed"),
    (TOKENIZER_CONFIG, {"chat_template": 5}, r"chat_template=5; allowed: a string, or a list"),
    (TOKENIZER_CONFIG, {"additional_special_tokens": 5},
     r"additional_special_tokens=5; allowed: a list"),
    (TOKENIZER_CONFIG, {"additional_special_tokens": "<extra>"},  # was: one token a character
     r"additional_special_tokens='<extra>'; allowed: a list"),
    (TOKENIZER_CONFIG, {"additional_special_tokens": ["<x>", None]},
     r"additional_special_tokens\[1\]=None; allowed: a string or an AddedToken"),
    (TOKENIZER_CONFIG, {"extra_special_tokens": {"image": 5}},
     r"extra_special_tokens\['image'\]=5; allowed"),
    (TOKENIZER_CONFIG, {"bos_token": 5}, r"bos_token=5; allowed: a string or an AddedToken "
                                         r"object \{\"content\": str, \.\.\.\}, or null"),
    (TOKENIZER_CONFIG, {"bos_token": ["<s>"]}, r"bos_token=\['<s>'\]; allowed"),
    (TOKENIZER_CONFIG, {"eos_token": {"content": 5}}, r"eos_token=\{'content': 5\}; allowed"),
    (SPECIAL_MAP, {"pad_token": 3}, r"special_tokens_map\.json: pad_token=3; allowed"),
    (TOKENIZER_CONFIG, {"clean_up_tokenization_spaces": "no"},
     r"clean_up_tokenization_spaces='no'; allowed: true, false or null"),
    (TOKENIZER_CONFIG, b'{"bos_token": "<s>\xff"}', r"tokenizer_config\.json: not UTF-8 text"),
    ("chat_template.jinja", b"{{ bos_token }}\xff", r"chat_template\.jinja: not UTF-8 text"),
    (TOKENIZER_CONFIG, b"[" * 100_000 + b"]" * 100_000, r"tokenizer_config\.json: invalid JSON "
                                                        r"\(nested too deeply\)"),
]


def _word_folder(folder, files: dict) -> str:
    """A word-level tokenizer.json plus `files` (name -> JSON value, or bytes as they are)."""
    vocab = {"<s>": 0, "</s>": 1, "hi": 2, "<unk>": 3}
    backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    os.makedirs(folder, exist_ok=True)
    backend.save(os.path.join(folder, "tokenizer.json"))
    for name, content in files.items():
        with open(os.path.join(folder, name), "wb") as f:
            f.write(content if isinstance(content, bytes) else json.dumps(content).encode())
    return str(folder)


@pytest.mark.parametrize("name, content, message", SIDE_FILE_CASES,
                         ids=[f"{n}-{str(c)[:30]}" for n, c, _ in SIDE_FILE_CASES])
def test_malformed_side_file_value_is_named(tmp_path, name, content, message):
    folder = _word_folder(tmp_path / "tok", {name: content})
    with pytest.raises(ValueError, match=message) as error:
        Tokenizer.from_hf_folder(folder)
    assert os.path.join(folder, name) in str(error.value)


def test_side_files_in_the_forms_transformers_writes(tmp_path):
    """AddedToken objects, named templates ("default" wins), null values, named
    extra_special_tokens and special_tokens_map.json as a fallback all load."""
    folder = _word_folder(tmp_path / "tok", {
        TOKENIZER_CONFIG: {"bos_token": {"content": "<s>", "__type": "AddedToken"},
                           "unk_token": None, "clean_up_tokenization_spaces": None,
                           "extra_special_tokens": {"image": "<img>"},
                           "chat_template": [{"name": "rag", "template": "R"},
                                             {"name": "default", "template": "D"}]},
        SPECIAL_MAP: {"eos_token": "</s>"}})
    tok = Tokenizer.from_hf_folder(folder)
    assert tok.special_tokens == {"bos_token": "<s>", "eos_token": "</s>"}
    assert tok.additional_special_tokens == ("<img>",) and tok.chat_template == "D"
    assert tok.clean_up_tokenization_spaces is False
    assert tok.encode("hi <img>", add_special_tokens=False) == [2, tok.get_vocab()["<img>"]]


# ----------------------------------------------------------------------------- GGUF metadata
GGUF_TOKENS = ["<s>", "a", "b", "ab", "c"]
GGUF_TOKENIZER_CASES = [  # tokenizer.* metadata over a valid set -> what the error names
    ({"tokenizer.ggml.tokens": None}, r"missing metadata tokenizer\.ggml\.tokens \(the "
                                      r"vocabulary\); allowed: an array of strings"),
    ({"tokenizer.ggml.tokens": [1, 2, 3]}, r"tokenizer\.ggml\.tokens=\[1, 2, 3\]; allowed: an "
                                           r"array of strings"),
    ({"tokenizer.ggml.tokens": "abc"}, r"tokenizer\.ggml\.tokens='abc'; allowed"),
    ({"tokenizer.ggml.merges": ["ab"]}, r"tokenizer\.ggml\.merges\[0\]='ab'; allowed: two "
                                        r"tokens separated by one space"),
    ({"tokenizer.ggml.merges": ["a b", "zz yy"]},
     r"tokenizer\.ggml\.merges\[1\]='zz yy': 'zz' is not in tokenizer\.ggml\.tokens"),
    ({"tokenizer.ggml.merges": ["b c"]}, r"merges\[0\]='b c': 'bc' is not in"),
    ({"tokenizer.ggml.token_type": [3]}, r"tokenizer\.ggml\.token_type=\[3\]; allowed: an array "
                                         r"of 5 integers"),
    ({"tokenizer.ggml.add_bos_token": "false"}, r"tokenizer\.ggml\.add_bos_token='false'; "
                                                r"allowed: true or false"),
    ({"tokenizer.ggml.bos_token_id": "0"}, r"tokenizer\.ggml\.bos_token_id='0'; allowed: a "
                                           r"token id"),
    ({"tokenizer.chat_template": 5}, r"tokenizer\.chat_template=5; allowed: a string"),
]


def _gguf_with_tokenizer(path, **metadata) -> str:
    from jaxgen.models import Llama, LlamaConfig
    from tests.test_loader_checks import SMALL, write_gguf

    model = Llama(LlamaConfig(**SMALL))
    params = model.init_params(jax.random.key(0))
    tokenizer = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": GGUF_TOKENS,
                 "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.token_type": [3, 1, 1, 1, 1],
                 "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.add_bos_token": True}
    return write_gguf(str(path), model, params, metadata={**tokenizer, **metadata})


def test_gguf_tokenizer_metadata_builds_the_tokenizer(tmp_path):
    from jaxgen.models.gguf_tokenizer import load_gguf_tokenizer

    tok = load_gguf_tokenizer(_gguf_with_tokenizer(tmp_path / "t.gguf"))
    assert tok.encode("abc") == [0, 3, 4] and tok.bos_token == "<s>"


@pytest.mark.parametrize("metadata, message", GGUF_TOKENIZER_CASES,
                         ids=[",".join(f"{k}={v}" for k, v in m.items())[:60]
                              for m, _ in GGUF_TOKENIZER_CASES])
def test_malformed_gguf_tokenizer_metadata_is_named(tmp_path, metadata, message):
    from jaxgen.models.gguf_tokenizer import load_gguf_tokenizer

    path = _gguf_with_tokenizer(tmp_path / "t.gguf", **metadata)
    with pytest.raises(ValueError, match=message) as error:
        load_gguf_tokenizer(path)
    assert str(error.value).startswith(f"{path}: ")
