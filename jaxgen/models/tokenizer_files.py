"""Reads a HF tokenizer folder's side files into `Tokenizer` options, checking every value.

The files: tokenizer_config.json, special_tokens_map.json (both optional JSON objects) and
chat_template.jinja (optional; it replaces tokenizer_config.json's chat_template). The forms
accepted are transformers' own:
- a named special token (bos_token, eos_token, ...): a string, an AddedToken-style object
  with a string "content", or null;
- additional_special_tokens: a list of those (null: none); extra_special_tokens: the same, or
  an object whose values are those;
- chat_template: a string, a list of {"name": str, "template": str} (the one named "default",
  else the first), or null;
- clean_up_tokenization_spaces: true, false or null.
Anything else, a file that is not UTF-8 JSON, or a top level that is not an object, is a
ValueError naming the file, the field and the allowed form, raised before any tokenization.

Example:
    >>> import json, tempfile
    >>> folder = tempfile.mkdtemp()
    >>> with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
    ...     json.dump({"bos_token": {"content": "<s>"}, "chat_template": "{{ bos_token }}"}, f)
    >>> options = read_tokenizer_files(folder)
    >>> options["special_tokens"]["bos_token"], options["chat_template"]
    ('<s>', '{{ bos_token }}')
    >>> with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
    ...     json.dump({"additional_special_tokens": "<extra>"}, f)
    >>> read_tokenizer_files(folder)
    Traceback (most recent call last):
    ...
    ValueError: .../tokenizer_config.json: additional_special_tokens='<extra>'; allowed: a list...
"""
from __future__ import annotations

import os
from typing import Any

from jaxgen.models.checkpoint_files import read_json_file, read_text

NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                        "cls_token", "mask_token")
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_MAP_FILE = "special_tokens_map.json"
TEMPLATE_FILE = "chat_template.jinja"
_TOKEN_FORM = 'a string or an AddedToken object {"content": str, ...}'
_TOKEN_LIST_FORM = f"a list whose items are each {_TOKEN_FORM}"
_TEMPLATE_FORM = 'a string, or a list of {"name": str, "template": str}'


def read_tokenizer_files(folder: str) -> dict:
    """`Tokenizer` keyword options (special_tokens, additional_special_tokens, chat_template,
    clean_up_tokenization_spaces) from `folder`'s side files; every file is optional."""
    config_path = os.path.join(folder, CONFIG_FILE)
    map_path = os.path.join(folder, SPECIAL_MAP_FILE)
    config = read_json_object(config_path)
    special_map = read_json_object(map_path)
    special = {}
    for name in NAMED_SPECIAL_TOKENS:
        from_map = token_content(special_map.get(name), map_path, name)
        special[name] = (token_content(config[name], config_path, name) if name in config
                         else from_map)
    extra_lists = (  # all checked; the first non-empty one counts
        token_list(config.get("additional_special_tokens"), config_path,
                   "additional_special_tokens"),
        token_list(special_map.get("additional_special_tokens"), map_path,
                   "additional_special_tokens"),
        token_list(config.get("extra_special_tokens"), config_path, "extra_special_tokens",
                   named_allowed=True))
    extra = next((tokens for tokens in extra_lists if tokens), [])
    template = chat_template(config.get("chat_template"), config_path)
    template_path = os.path.join(folder, TEMPLATE_FILE)
    if os.path.isfile(template_path):
        template = read_text(template_path)
    clean_up = config.get("clean_up_tokenization_spaces")
    if clean_up is not None and not isinstance(clean_up, bool):
        raise ValueError(f"{config_path}: clean_up_tokenization_spaces={clean_up!r}; "
                         f"allowed: true, false or null")
    return dict(special_tokens=special, additional_special_tokens=extra,
                chat_template=template, clean_up_tokenization_spaces=bool(clean_up))


def read_json_object(path: str) -> dict:
    """The JSON object in `path` ({} when there is no such file); ValueError naming the file
    for bytes that are not UTF-8, text that is not JSON, or a value that is not an object
    (`checkpoint_files.read_json_file`)."""
    value = read_json_file(path, required=False)
    if value is None and not os.path.exists(path):
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{path}: the top level is {_kind(value)}; allowed: a JSON object")
    return value


def token_content(value: Any, path: str, name: str, nullable: bool = True) -> str | None:
    """A special token's text: `value` is a string, {"content": str, ...} or (`nullable`)
    None."""
    if isinstance(value, str) or (value is None and nullable):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    null = ", or null" if nullable else ""
    raise ValueError(f"{path}: {name}={short_repr(value)}; allowed: {_TOKEN_FORM}{null}")


def token_list(value: Any, path: str, name: str, named_allowed: bool = False) -> list[str]:
    """The token texts of a list field (None: []); with `named_allowed`, an object's values
    (transformers' named extra_special_tokens) count as the list."""
    if value is None:
        return []
    if named_allowed and isinstance(value, dict):
        return [token_content(item, path, f"{name}[{key!r}]", nullable=False)
                for key, item in value.items()]
    if not isinstance(value, list):
        also = ", or an object whose values are each one" if named_allowed else ""
        raise ValueError(f"{path}: {name}={short_repr(value)}; allowed: {_TOKEN_LIST_FORM}{also}")
    return [token_content(item, path, f"{name}[{i}]", nullable=False)
            for i, item in enumerate(value)]


def chat_template(value: Any, path: str) -> str | None:
    """The template text: a string, a list of named templates ("default", else the first),
    or None."""
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError(f"{path}: chat_template={short_repr(value)}; allowed: {_TEMPLATE_FORM}")
    named = {}
    for i, entry in enumerate(value):
        if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                and isinstance(entry.get("template"), str)):
            raise ValueError(f"{path}: chat_template[{i}]={short_repr(entry)}; allowed: "
                             f'{{"name": str, "template": str}}')
        named[entry["name"]] = entry["template"]
    return named.get("default", next(iter(named.values()), None))


def _kind(value: Any) -> str:
    return "null" if value is None else f"a {type(value).__name__}"


def short_repr(value: Any, limit: int = 80) -> str:
    """repr(value), cut to `limit` characters (for error messages: a template, a list or a
    vocabulary can be long)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
