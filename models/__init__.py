"""Model families and checkpoint loaders, imported as `jaxgen.models`.

    >>> from jaxgen.models import load, DEFAULT_MODEL
    >>> model, params, tokenizer = load(DEFAULT_MODEL)   # doctest: +SKIP
"""
from .llama import Llama, LlamaConfig, ModelOutput, unstack_layers
from .registry import DEFAULT_MODEL, KNOWN_MODELS, load
from .tokenizer import Tokenizer

__all__ = ["DEFAULT_MODEL", "KNOWN_MODELS", "Llama", "LlamaConfig", "ModelOutput", "Tokenizer",
           "load", "unstack_layers"]
