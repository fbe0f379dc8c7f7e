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


def save_draft_folder(model, params, tokenizer, folder: str, info: dict,
                      dtype: str = "float16") -> str:
    """The HF folder of a draft model (weights in `dtype`) with its tokenizer and info."""
    save_hf_checkpoint(model, params, folder, dtype=DTYPES[dtype])
    if tokenizer is not None:
        save_tokenizer(tokenizer, folder)
    with open(os.path.join(folder, "training.json"), "w", encoding="utf-8") as f:
        json.dump(info, f, indent=2)
    return folder
