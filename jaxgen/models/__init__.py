"""Model families and checkpoint loaders, imported as `jaxgen.models`.

Example (illustration: loading the embedded SmolLM2-135M takes several seconds):
    >>> from jaxgen.models import load, DEFAULT_MODEL
    >>> model, params, tokenizer = load(DEFAULT_MODEL)   # doctest: +SKIP
    >>> model.check_params(params)                       # doctest: +SKIP
"""
from jaxgen.models.deepseek_v3 import DeepseekV3, DeepseekV3Config
from jaxgen.models.flax_adapter import FlaxModel, cached_attention, from_flax
from jaxgen.models.gemma import Gemma, GemmaConfig
from jaxgen.models.gemma4 import Gemma4, Gemma4Config
from jaxgen.models.gemma4_assistant import Gemma4Assistant, Gemma4AssistantConfig
from jaxgen.models.glm4_moe import Glm4Moe, Glm4MoeConfig
from jaxgen.models.llama import Llama, LlamaConfig, ModelOutput, unstack_layers
from jaxgen.models.registry import DEFAULT_MODEL, KNOWN_MODELS, load
from jaxgen.models.tiny import TINY_VOCAB, tiny_llama, tiny_tokenizer
from jaxgen.models.tokenizer import Tokenizer

from jaxgen.models.param_sharding import param_shardings, shard  # tensor parallelism on a mesh

__all__ = ["DEFAULT_MODEL", "DeepseekV3", "DeepseekV3Config", "FlaxModel", "Glm4Moe", "Glm4MoeConfig", "Gemma", "GemmaConfig", "Gemma4", "Gemma4Assistant", "Gemma4AssistantConfig", "Gemma4Config", "KNOWN_MODELS", "Llama", "LlamaConfig", "ModelOutput", "Tokenizer",
           "TINY_VOCAB", "cached_attention", "from_flax", "load", "param_shardings", "shard", "tiny_llama", "tiny_tokenizer",
           "unstack_layers"]
