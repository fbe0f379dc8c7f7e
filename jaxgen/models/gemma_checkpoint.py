"""Loads a Hugging Face Gemma 2 / Gemma 3 checkpoint folder into (Gemma, params).

config.json's model_type picks the config: "gemma2" (Gemma2ForCausalLM), "gemma3_text"
(Gemma3ForCausalLM), or "gemma3" (Gemma3ForConditionalGeneration): for that multimodal
folder the text model is loaded from `text_config` and its language-model weights
(transformers 5's `model.language_model.*`, or the older `language_model.model.*`); the
vision tower and the projector are skipped, so the model decodes text prompts only (image
inputs are not supported). Strict as jaxgen/models/hf_checkpoint.py is: every other tensor
must be used, every weight finite, shapes checked against the config before a weight is read,
a stored `lm_head.weight` must equal the embeddings (the head is tied).

Example:
    >>> import tempfile, torch, transformers
    >>> cfg = transformers.Gemma2Config(vocab_size=32, hidden_size=16, intermediate_size=32,
    ...     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
    ...     sliding_window=4, query_pre_attn_scalar=8)
    >>> folder = tempfile.mkdtemp()
    >>> transformers.Gemma2ForCausalLM(cfg).save_pretrained(folder)
    >>> model, params, tokenizer = load_gemma(folder)
    >>> model.config.layer_types, params["layers"]["post_mlp_norm"].shape, tokenizer
    (('sliding_attention', 'full_attention'), (2, 16), None)
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.models.checkpoint_checks import (
    check_load_dtype,
    names_list,
    reject_unexpected,
    require_finite,
)
from jaxgen.models.checkpoint_files import read_json_object
from jaxgen.models.config_checks import check_layer_count, refuse_quantization
from jaxgen.models.gemma import Gemma, GemmaConfig, gemma_param_shapes
from jaxgen.models.hf_checkpoint import IGNORED_HF_TENSORS, read_hf_tensors
from jaxgen.models.tokenizer import Tokenizer

GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text", "gemma3")

_LAYER_NAMES = {  # params name -> (HF suffix under <prefix>layers.{i}., transpose)
    "attn_norm": ("input_layernorm.weight", False),
    "post_attn_norm": ("post_attention_layernorm.weight", False),
    "mlp_norm": ("pre_feedforward_layernorm.weight", False),
    "post_mlp_norm": ("post_feedforward_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True),
    "wo": ("self_attn.o_proj.weight", True),
    "q_norm": ("self_attn.q_norm.weight", False),
    "k_norm": ("self_attn.k_norm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True),
    "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
}
# multimodal folders: the language model's prefixes (transformers 5, then older), and the
# tensors of the parts jaxgen does not run
_TEXT_PREFIXES = ("model.language_model.", "language_model.model.")
_VISION_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.",
                    "multi_modal_projector.")


def load_gemma_config(folder: str) -> tuple[GemmaConfig, bool]:
    """(GemmaConfig, multimodal) from config.json (+ generation_config.json)."""
    path = os.path.join(folder, "config.json")
    config = read_json_object(path)
    generation = read_json_object(os.path.join(folder, "generation_config.json"), required=False)
    refuse_quantization(config, path)  # the top level's, for gemma3 (text_config's below)
    multimodal = config.get("model_type") == "gemma3"
    if multimodal:
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise ValueError(f"{path}: model_type 'gemma3' without a text_config object")
        text = {"model_type": "gemma3_text", **text}
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if text.get(key) is None and config.get(key) is not None:
                text[key] = config[key]
        config = text
    return GemmaConfig.from_hf_dict(config, generation, where=path), multimodal


def _text_prefix(tensors: Mapping) -> str:
    """The language model's tensor prefix in a multimodal checkpoint."""
    for prefix in _TEXT_PREFIXES:
        if f"{prefix}embed_tokens.weight" in tensors:
            return prefix
    return _TEXT_PREFIXES[0]


def gemma_params(config: GemmaConfig, tensors: Mapping[str, np.ndarray], dtype=jnp.float32,
                 *, prefix: str = "model.", skipped: tuple[str, ...] = (),
                 where: str = "") -> dict:
    """HF tensors -> Gemma params (layers stacked, matrices [in, out]), every shape and
    every weight checked, every tensor used (except IGNORED_HF_TENSORS and `skipped`
    prefixes)."""
    pattern = re.compile(re.escape(prefix) + r"layers\.(\d+)\.")
    indices = {int(m.group(1)) for m in map(pattern.match, tensors) if m}
    check_layer_count(indices, "num_hidden_layers", config.num_layers, f"{prefix}layers.{{i}}.",
                      where)
    expected = gemma_param_shapes(config)
    missing, used = [], set()

    def fetch(name: str, shape: tuple, transpose: bool = False) -> np.ndarray | None:
        if name not in tensors:
            missing.append(name)
            return None
        used.add(name)
        array = tensors[name]
        stored = tuple(shape[::-1]) if transpose else tuple(shape)
        if tuple(np.shape(array)) != stored:
            raise ValueError(f"{where}: tensor {name!r} has shape {tuple(np.shape(array))}, "
                             f"expected {stored} from config.json")
        require_finite(name, array, where)
        return np.asarray(array, np.float32).T if transpose else np.asarray(array, np.float32)

    layers = {}
    for key, shape in expected["layers"].items():
        suffix, transpose = _LAYER_NAMES[key]
        arrays = [fetch(f"{prefix}layers.{i}.{suffix}", shape[1:], transpose)
                  for i in range(config.num_layers)]
        if all(a is not None for a in arrays):
            layers[key] = np.stack(arrays)
    embed = fetch(f"{prefix}embed_tokens.weight", expected["embed"])
    final_norm = fetch(f"{prefix}norm.weight", expected["final_norm"])
    if missing:
        raise ValueError(f"{where}: checkpoint is missing {len(missing)} tensor(s): "
                         f"{names_list(missing)}")
    if "lm_head.weight" in tensors:
        if not np.array_equal(np.asarray(tensors["lm_head.weight"], np.float32), embed):
            raise ValueError(f"{where}: lm_head.weight differs from the embeddings; Gemma ties "
                             f"its head (tie_word_embeddings must be true)")
        used.add("lm_head.weight")
    unused = (n for n in tensors if n not in used and not IGNORED_HF_TENSORS.search(n))
    reject_unexpected(unused, skipped, where,
                      f" (the config has {config.num_layers} layer(s); does it match?)")
    params = {"embed": embed, "layers": layers, "final_norm": final_norm}
    return jax.tree_util.tree_map(lambda a: jnp.asarray(a, dtype), params)


def load_gemma_checkpoint(folder: str, dtype=jnp.float32) -> tuple[Gemma, dict]:
    """(Gemma, params) from a HF folder of model_type gemma2 / gemma3_text / gemma3."""
    dtype = check_load_dtype(dtype)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"checkpoint folder not found: {folder}")
    config, multimodal = load_gemma_config(folder)
    skipped = _VISION_PREFIXES if multimodal else ()
    tensors = read_hf_tensors(folder, skipped=skipped)
    prefix = _text_prefix(tensors) if multimodal else "model."
    return Gemma(config), gemma_params(config, tensors, dtype, prefix=prefix, skipped=skipped,
                                       where=folder)


def load_gemma(folder: str, dtype=jnp.float32) -> tuple[Gemma, dict, Tokenizer | None]:
    """(model, params, tokenizer or None): the loader HF_FAMILY_LOADERS runs for Gemma."""
    tokenizer = Tokenizer.of_folder(folder)  # before any weight is read
    model, params = load_gemma_checkpoint(folder, dtype)
    return model, params, tokenizer
