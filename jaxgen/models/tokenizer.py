"""`Tokenizer`: a thin wrapper over `tokenizers.Tokenizer` that behaves like transformers'
`PreTrainedTokenizerFast` for encode / decode / chat templates.

HF behaviours reproduced:
- named special tokens (bos/eos/unk/pad/...) missing from the vocabulary are added as
  special tokens;
- tokenizer.json's post-processor decides which special tokens `encode` adds. Like
  transformers>=5, `from_hf_folder` ignores `add_bos_token`/`add_eos_token` in
  tokenizer_config.json when a tokenizer.json exists; if tokenizer.json has no post-processor,
  none is added. Passing `add_bos_token`/`add_eos_token` to the constructor explicitly (the
  GGUF path does) rebuilds the post-processor as a TemplateProcessing adding exactly those;
- chat templates render in a sandboxed jinja2 environment with trim_blocks/lstrip_blocks,
  the loopcontrols extension, `raise_exception`, `strftime_now`, a non-escaping `tojson`, and
  the special tokens (`bos_token`, `eos_token`, ...) as variables; tokenizing the rendered
  chat does not add special tokens again. The render is bounded in size and time
  (jaxgen/models/chat_template.py: ChatTemplateError).

Example (a word-level vocabulary written to a temporary folder):
    >>> import json, tempfile
    >>> folder = tempfile.mkdtemp()
    >>> vocab = {"<s>": 0, "</s>": 1, "hi": 2, "there": 3, "<unk>": 4}
    >>> backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    >>> backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    >>> backend.add_special_tokens(["<s>", "</s>"])    # already in vocab: marked special
    2
    >>> backend.save(os.path.join(folder, "tokenizer.json"))
    >>> template = "{% for m in messages %}{{ bos_token }}{{ m['content'] }}{% endfor %}"
    >>> with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
    ...     json.dump({"bos_token": "<s>", "eos_token": "</s>", "chat_template": template}, f)
    >>> tok = Tokenizer.from_hf_folder(folder)
    >>> tok.apply_chat_template([{"role": "user", "content": "hi there"}])
    [0, 2, 3]
    >>> tok.decode([0, 2, 3], skip_special_tokens=True), tok.eos_token_id
    ('hi there', 1)
"""
from __future__ import annotations

import os
from typing import Iterable

import tokenizers
from tokenizers import AddedToken, processors

from jaxgen.models.chat_template import render
from jaxgen.models.tokenizer_files import read_tokenizer_files


class Tokenizer:
    """Encode/decode/chat-template over a `tokenizers.Tokenizer` (attribute `backend`)."""

    def __init__(self, backend: tokenizers.Tokenizer, *, special_tokens: dict | None = None,
                 additional_special_tokens: Iterable[str] = (), chat_template: str | None = None,
                 add_bos_token: bool | None = None, add_eos_token: bool | None = None,
                 clean_up_tokenization_spaces: bool = False):
        self.backend = backend
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self.additional_special_tokens = tuple(additional_special_tokens)
        self.chat_template = chat_template
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces
        vocab = backend.get_vocab(with_added_tokens=True)
        to_add = [t for t in (*self.special_tokens.values(), *self.additional_special_tokens)
                  if t not in vocab]
        if to_add:
            backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                        for t in dict.fromkeys(to_add)])
        self.add_bos_token = bool(add_bos_token)
        self.add_eos_token = bool(add_eos_token)
        explicit = add_bos_token is not None or add_eos_token is not None
        if explicit or backend.post_processor is None:
            self._set_post_processor()

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_hf_folder(cls, folder: str) -> "Tokenizer":
        """From `tokenizer.json` + `tokenizer_config.json` (+ `chat_template.jinja`,
        `special_tokens_map.json` when present). A malformed side-file value is a ValueError
        naming the file and the field (jaxgen/models/tokenizer_files.py)."""
        path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"missing file: {path}")
        options = read_tokenizer_files(folder)  # every value checked (tokenizer_files.py)
        try:
            backend = tokenizers.Tokenizer.from_file(path)
        except Exception as err:
            raise ValueError(f"{path}: cannot parse tokenizer ({err})") from None
        return cls(backend, **options)

    @classmethod
    def of_folder(cls, folder: str) -> "Tokenizer | None":
        """The folder's tokenizer (`from_hf_folder`), None without tokenizer.json. The loaders
        call it before they read a weight, so a malformed tokenizer file fails fast."""
        has_tokenizer = os.path.isfile(os.path.join(folder, "tokenizer.json"))
        return cls.from_hf_folder(folder) if has_tokenizer else None

    def _set_post_processor(self) -> None:
        bos, eos = self.special_tokens.get("bos_token"), self.special_tokens.get("eos_token")
        add_bos = self.add_bos_token and bos is not None
        add_eos = self.add_eos_token and eos is not None
        single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
        pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
        specials = ([(bos, self.backend.token_to_id(bos))] if add_bos else []) + \
                   ([(eos, self.backend.token_to_id(eos))] if add_eos else [])
        self.backend.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=specials)

    # ----------------------------------------------------------------- ids and tokens
    def _id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._id("pad_token")

    @property
    def unk_token_id(self) -> int | None:
        return self._id("unk_token")

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def pad_token(self) -> str | None:
        return self.special_tokens.get("pad_token")

    @property
    def all_special_tokens(self) -> list[str]:
        return list(dict.fromkeys([*self.special_tokens.values(), *self.additional_special_tokens]))

    @property
    def all_special_ids(self) -> list[int]:
        ids = (self.backend.token_to_id(t) for t in self.all_special_tokens)
        return [i for i in ids if i is not None]

    @property
    def vocab_size(self) -> int:
        """Base vocabulary size without added tokens (HF's `vocab_size`); len() includes them."""
        return self.backend.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def convert_ids_to_tokens(self, ids):
        if isinstance(ids, int):
            return self.backend.id_to_token(ids)
        return [self.backend.id_to_token(int(i)) for i in ids]

    def convert_tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            return self.backend.token_to_id(tokens)
        return [self.backend.token_to_id(t) for t in tokens]

    # ----------------------------------------------------------------- encode / decode
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = [int(ids)] if isinstance(ids, int) else [int(i) for i in ids]
        text = self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        if self.clean_up_tokenization_spaces and type(self.backend.model).__name__ != "BPE":
            for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","),
                                  (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"),
                                  (" 've", "'ve"), (" 're", "'re")):
                text = text.replace(before, after)
        return text

    def batch_decode(self, sequences, skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(s, skip_special_tokens) for s in sequences]

    # ----------------------------------------------------------------- chat
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tokenize: bool = True, chat_template: str | None = None, *,
                            max_rendered_chars: int | None = None,
                            render_seconds: float | None = None,
                            **kwargs) -> list[int] | str:
        """Renders `messages` like HF; returns ids (tokenize=True, no extra specials) or text.

        The render is bounded (jaxgen/models/chat_template.py): at most `max_rendered_chars`
        characters (None: 1,000,000 + 16 per character of the input) and `render_seconds`
        (None: 10 s); a template that passes either raises ChatTemplateError (a ValueError).
        """
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError("this tokenizer has no chat_template; pass chat_template=...")
        variables = {**self.special_tokens, **kwargs}
        if self.additional_special_tokens:
            variables.setdefault("additional_special_tokens", list(self.additional_special_tokens))
        rendered = render(template, messages, max_chars=max_rendered_chars,
                          seconds=render_seconds, tools=None, documents=None,
                          add_generation_prompt=add_generation_prompt, **variables)
        if not tokenize:
            return rendered
        return self.encode(rendered, add_special_tokens=False)
