"""jaxgen: functional, JIT-compiled text generation in JAX.

    >>> import jaxgen
    >>> model, params, tokenizer = jaxgen.models.load("smollm2-135m-instruct")
    >>> jaxgen.generate_text(model, params, tokenizer, ["What is the capital of France?"],
    ...                      chat=True, max_new_tokens=20)
"""
from jaxgen.cache import KVCache
from jaxgen.config import GenerationConfig
from jaxgen.generate import GenerateOutput, default_config, generate, generate_ids, trace_count
from jaxgen.state import DecodeState, init_state
from jaxgen.text import generate_text

__all__ = [
    "GenerationConfig", "DecodeState", "GenerateOutput", "KVCache", "init_state", "generate",
    "generate_ids", "generate_text", "default_config", "trace_count", "models",
]
__version__ = "0.1.0"


def __getattr__(name):
    if name == "models":  # imported lazily: the decoding core never needs a model family
        import importlib
        return importlib.import_module("jaxgen.models")
    raise AttributeError(f"module 'jaxgen' has no attribute {name!r}")
