"""jaxgen: functional, JIT-compiled text generation in JAX.

Example (illustration: loads the embedded 135M model):
    >>> import jaxgen
    >>> model, params, tokenizer = jaxgen.models.load("smollm2-135m-instruct")  # doctest: +SKIP
    >>> jaxgen.generate_text(model, params, tokenizer, ["What is the capital of France?"],
    ...                      chat=True, max_new_tokens=20)  # doctest: +SKIP
"""
from jaxgen.api.generate import default_config, generate, generate_ids, trace_count
from jaxgen.api.text import generate_text
from jaxgen.cache import KVCache
from jaxgen.config.generation import GenerationConfig
from jaxgen.config.watermarking import SynthIDTextWatermarkingConfig, WatermarkingConfig
from jaxgen.core.output import GenerateOutput
from jaxgen.core.state import DecodeState, init_state
from jaxgen.logits.watermark.detect import WatermarkDetector
from jaxgen.logits.watermark.synthid_detect import SynthIDTextDetector
from jaxgen.stopping.criteria import (
    ConfidenceCriteria,
    EosTokenCriteria,
    MaxLengthCriteria,
    MaxTimeCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
    validate_stopping_criteria,
)

__all__ = [
    "GenerationConfig", "DecodeState", "GenerateOutput", "KVCache", "init_state", "generate",
    "generate_ids", "generate_text", "default_config", "trace_count", "models",
    "StoppingCriteriaList", "MaxLengthCriteria", "MaxTimeCriteria", "EosTokenCriteria",
    "StopStringCriteria", "ConfidenceCriteria", "validate_stopping_criteria",
    "WatermarkingConfig", "WatermarkDetector", "SynthIDTextWatermarkingConfig",
    "SynthIDTextDetector",
]
__version__ = "0.1.0"


def __getattr__(name):
    if name == "models":  # imported lazily: the decoding core never needs a model family
        import importlib
        return importlib.import_module("jaxgen.models")
    raise AttributeError(f"module 'jaxgen' has no attribute {name!r}")
