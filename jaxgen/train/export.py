"""Writing a trained drafter next to its tokenizer: a Hugging Face folder (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json) that jaxgen's loader and
transformers' from_pretrained both read, plus training.json (how it was made)."""
from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np

from jaxgen.models.hf_export import save_hf_checkpoint

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}


def save_tokenizer(tokenizer, folder: str) -> None:
    """tokenizer.json (the backend) and tokenizer_config.json (special tokens, template)."""
    os.makedirs(folder, exist_ok=True)
    tokenizer.backend.save(os.path.join(folder, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast",
              **tokenizer.special_tokens,
              "additional_special_tokens": list(tokenizer.additional_special_tokens),
              "chat_template": tokenizer.chat_template,
              "clean_up_tokenization_spaces": tokenizer.clean_up_tokenization_spaces}
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)


def portable_paths(value):
    """A training record with every absolute path made relative to the working folder (a
    shipped record names no folder of the machine it was trained on).

    Example:
        >>> import os
        >>> portable_paths({"data": os.path.join(os.getcwd(), "d"), "steps": 3, "x": ["a"]})
        {'data': 'd', 'steps': 3, 'x': ['a']}
    """
    if isinstance(value, dict):
        return {key: portable_paths(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [portable_paths(item) for item in value]
    if isinstance(value, str):
        return " ".join(os.path.relpath(word) if os.path.isabs(word) else word
                        for word in value.split(" "))
    return value


def write_training_record(folder: str, info: dict) -> None:
    """training.json in `folder`: how the weights were made, with portable paths."""
    with open(os.path.join(folder, "training.json"), "w", encoding="utf-8") as f:
        json.dump(portable_paths(info), f, indent=2)


def save_draft_folder(model, params, tokenizer, folder: str, info: dict,
                      dtype: str = "float16") -> str:
    """The HF folder of a draft model (weights in `dtype`) with its tokenizer and info."""
    save_hf_checkpoint(model, params, folder, dtype=DTYPES[dtype])
    if tokenizer is not None:
        save_tokenizer(tokenizer, folder)
    write_training_record(folder, info)
    return folder
