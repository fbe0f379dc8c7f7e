"""Model families and checkpoint loaders, imported as `jaxgen.models`.

Example (illustration: loading the embedded SmolLM2-135M takes several seconds):
    >>> from jaxgen.models import load, DEFAULT_MODEL
    >>> model, params, tokenizer = load(DEFAULT_MODEL)   # doctest: +SKIP
    >>> model.check_params(params)                       # doctest: +SKIP
"""
from jaxgen.models.llama import Llama, LlamaConfig, ModelOutput, unstack_layers
from jaxgen.models.registry import DEFAULT_MODEL, KNOWN_MODELS, load
from jaxgen.models.tiny import TINY_VOCAB, tiny_llama, tiny_tokenizer
from jaxgen.models.tokenizer import Tokenizer

from jaxgen.models.param_sharding import param_shardings, shard  # tensor parallelism on a mesh

__all__ = ["DEFAULT_MODEL", "KNOWN_MODELS", "Llama", "LlamaConfig", "ModelOutput", "Tokenizer",
           "TINY_VOCAB", "load", "param_shardings", "shard", "tiny_llama", "tiny_tokenizer",
           "unstack_layers"]
