"""jaxgen: functional, JIT-compiled text generation in JAX.

Example (illustration: loads the embedded 135M model):
    >>> import jaxgen
    >>> model, params, tokenizer = jaxgen.models.load("smollm2-135m-instruct")  # doctest: +SKIP
    >>> jaxgen.generate_text(model, params, tokenizer, ["What is the capital of France?"],
    ...                      chat=True, max_new_tokens=20)  # doctest: +SKIP
"""
import importlib

from jaxgen.notices.model_loads import listen_to_model_loads as _listen_to_model_loads  # stdlib

# The public names and the module each comes from. They are imported on first use, so that
# `import jaxgen` (and the `jaxgen` command's start, which installs its signal handlers
# before jax loads) costs nothing.
_PUBLIC = {
    "default_config": "jaxgen.api.generate", "generate": "jaxgen.api.generate",
    "generate_ids": "jaxgen.api.generate", "trace_count": "jaxgen.api.generate",
    "generate_text": "jaxgen.api.text",
    "generate_batch": "jaxgen.serving.offline",
    "prefill_prefix": "jaxgen.api.prefix_prefill",
    "continue_state": "jaxgen.core.continuation", "CachedPrefix": "jaxgen.core.cached_prefix",
    "KVCache": "jaxgen.cache",
    "GenerationConfig": "jaxgen.config.generation",
    "SynthIDTextWatermarkingConfig": "jaxgen.config.watermarking",
    "WatermarkingConfig": "jaxgen.config.watermarking",
    "GenerateOutput": "jaxgen.core.output",
    "compute_transition_scores": "jaxgen.core.transition_scores",
    "DecodeState": "jaxgen.core.state", "init_state": "jaxgen.core.state",
    "WatermarkDetector": "jaxgen.logits.watermark.detect",
    "SynthIDTextDetector": "jaxgen.logits.watermark.synthid_detect",
    "ConfidenceCriteria": "jaxgen.stopping.criteria",
    "EosTokenCriteria": "jaxgen.stopping.criteria",
    "MaxLengthCriteria": "jaxgen.stopping.criteria",
    "MaxTimeCriteria": "jaxgen.stopping.criteria",
    "StoppingCriteriaList": "jaxgen.stopping.criteria",
    "StopStringCriteria": "jaxgen.stopping.criteria",
    "validate_stopping_criteria": "jaxgen.stopping.criteria",
}
_PACKAGES = ("api", "backends", "cache", "cli", "config", "constraints", "core", "drivers",
             "logits", "loops", "models", "notices", "runtime", "serving", "speculative",
             "stopping", "storage", "train")

__all__ = [
    "GenerationConfig", "DecodeState", "GenerateOutput", "KVCache", "init_state", "generate",
    "generate_ids", "generate_text", "generate_batch", "default_config", "trace_count", "models",
    "compute_transition_scores", "continue_state", "prefill_prefix", "CachedPrefix",
    "StoppingCriteriaList", "MaxLengthCriteria", "MaxTimeCriteria", "EosTokenCriteria",
    "StopStringCriteria", "ConfidenceCriteria", "validate_stopping_criteria",
    "WatermarkingConfig", "WatermarkDetector", "SynthIDTextWatermarkingConfig",
    "SynthIDTextDetector",
]
__version__ = "0.1.0"


def _start_kernel_builds(weights: str, file_bytes) -> None:
    """A model is loading (jaxgen.models.load announces it): the backend starts the native
    builds it may need, through the seam (jaxgen.models may not import it)."""
    from jaxgen.runtime import backend

    backend.start_builds_for_load(weights, file_bytes)


_listen_to_model_loads(_start_kernel_builds)


def __getattr__(name):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
    elif name in _PACKAGES:
        value = importlib.import_module(f"jaxgen.{name}")
    else:
        raise AttributeError(f"module 'jaxgen' has no attribute {name!r}")
    globals()[name] = value  # the next access is a plain attribute
    return value


def __dir__():
    return sorted({*globals(), *_PUBLIC, *_PACKAGES})
