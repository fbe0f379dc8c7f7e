"""Range checks on a model config's numbers, run before a loader allocates anything.

Every number of a `LlamaConfig` is checked here: its type (an int is an int, not a bool, a
float or a string; a float is finite), its range (`INT_LIMITS`, `FLOAT_LIMITS`: generous
bounds no released model comes near, so that a typo such as num_hidden_layers=10**9 is an
error rather than a loader that runs until memory runs out) and how the numbers fit each
other (num_kv_heads divides num_heads, head_dim is even for RoPE, token ids lie inside the
vocabulary). Loaders check the numbers under the names their file uses (config.json's
`num_hidden_layers`, a GGUF's `llama.block_count`: `names=`), then the config against the
checkpoint's tensors - the layer count (`check_layer_count`) and every tensor's shape
(`check_tensor_shapes`) read from the file's header - before a weight is read.

Example:
    >>> check_int("num_hidden_layers", 10**9, *INT_LIMITS["num_layers"], where="config.json")
    Traceback (most recent call last):
    ...
    ValueError: config.json: num_hidden_layers=1000000000 is out of range; allowed: an int in [1, 1024]
    >>> check_float("rope_theta", 0.0, *FLOAT_LIMITS["rope_theta"])
    Traceback (most recent call last):
    ...
    ValueError: rope_theta=0.0 is out of range; allowed: a finite float in (0, 3.40282e+38]
    >>> check_layer_count({0, 1}, "num_hidden_layers", 3, "model.layers.{i}.", "ckpt")
    Traceback (most recent call last):
    ...
    ValueError: ckpt: num_hidden_layers=3 needs layers 0..2, but the checkpoint holds 2 layer(s) (model.layers.{i}. for i in 0..1)
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

FLOAT32_MAX = float(np.finfo(np.float32).max)
INT32_MAX = 2**31 - 1

INT_LIMITS = {  # LlamaConfig field -> (lowest, highest) allowed, both included
    "vocab_size": (1, 2**24),
    "hidden_size": (1, 2**16),
    "intermediate_size": (1, 2**18),
    "num_layers": (1, 1024),
    "num_heads": (1, 1024),
    "num_kv_heads": (1, 1024),
    "head_dim": (2, 4096),
    "max_position_embeddings": (1, INT32_MAX),  # positions are int32
    "sliding_window": (1, INT32_MAX),
    "num_mtp_layers": (0, 64),
}
FLOAT_LIMITS = {  # field -> (exclusive lowest, included highest)
    "rms_norm_eps": (0.0, 1.0),
    "rope_theta": (0.0, FLOAT32_MAX),  # RoPE computes theta ** x in float32
}
TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _where(where: str) -> str:
    return f"{where}: " if where else ""


def is_int(value) -> bool:
    """An int (Python or numpy), not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_int(name: str, value, low: int, high: int, where: str = "") -> int:
    """`value` as an int when it is one in [low, high]; ValueError naming `name` otherwise."""
    if not is_int(value) or not low <= int(value) <= high:
        kind = "" if is_int(value) else f" ({type(value).__name__}, not an int)"
        raise ValueError(f"{_where(where)}{name}={value!r}{kind} is out of range; allowed: an "
                         f"int in [{low}, {high}]")
    return int(value)


def check_float(name: str, value, low: float, high: float, where: str = "", *,
                low_included: bool = False) -> float:
    """`value` as a float when it is a finite number in (low, high] ([low, high] with
    low_included); ValueError naming `name` otherwise."""
    number = float(value) if is_int(value) or isinstance(value, (float, np.floating)) else None
    above = number is not None and (number >= low if low_included else number > low)
    if number is None or not math.isfinite(number) or not above or number > high:
        raise ValueError(f"{_where(where)}{name}={value!r} is out of range; allowed: a finite "
                         f"float in {'[' if low_included else '('}{low:g}, {high:g}]")
    return number


def check_llama_numbers(values: Mapping, names: Mapping[str, str] | None = None,
                        where: str = "") -> None:
    """Checks the numbers of a LlamaConfig's fields (`values`: field -> value; absent fields
    are skipped). names: field -> the name the error shows (the source file's key).

    Example:
        >>> check_llama_numbers({"num_heads": 4, "num_kv_heads": 3},
        ...                     {"num_kv_heads": "num_key_value_heads"})
        Traceback (most recent call last):
        ...
        ValueError: num_key_value_heads=3 must divide num_heads=4; allowed: a divisor of num_heads
    """
    names = names or {}
    shown = lambda field: names.get(field, field)  # noqa: E731
    for field, (low, high) in INT_LIMITS.items():
        optional = field == "sliding_window"  # None: full attention
        if field in values and not (optional and values[field] is None):
            check_int(shown(field), values[field], low, high, where)
    for field, (low, high) in FLOAT_LIMITS.items():
        if field in values:
            check_float(shown(field), values[field], low, high, where)
    heads, kv_heads = values.get("num_heads"), values.get("num_kv_heads")
    if heads is not None and kv_heads is not None and heads % kv_heads:
        raise ValueError(f"{_where(where)}{shown('num_kv_heads')}={kv_heads} must divide "
                         f"{shown('num_heads')}={heads}; allowed: a divisor of "
                         f"{shown('num_heads')}")
    head_dim = values.get("head_dim")
    if head_dim is not None and head_dim % 2:
        raise ValueError(f"{_where(where)}{shown('head_dim')}={head_dim} is odd; allowed: an "
                         f"even int (RoPE rotates pairs of dimensions)")
    vocab = values.get("vocab_size")
    for field in TOKEN_ID_FIELDS:
        value = values.get(field)
        ids = value if isinstance(value, (tuple, list)) else () if value is None else (value,)
        for token in ids:
            if not is_int(token) or vocab is not None and not 0 <= int(token) < vocab:
                raise ValueError(f"{_where(where)}{shown(field)}={value!r} is outside the "
                                 f"vocabulary; allowed: token ids in [0, "
                                 f"{shown('vocab_size')}={vocab})")


def generation_fields(generation_config: Mapping | None) -> dict:
    """generation_config.json's fields without transformers' bookkeeping keys (the model's
    generation defaults)."""
    fields = dict(generation_config or {})
    for key in ("transformers_version", "_from_model_config"):
        fields.pop(key, None)
    return fields


def special_token_ids(config: Mapping, generation: Mapping,
                      defaults: Mapping | None = None) -> tuple[dict, dict]:
    """(ids, names): the bos / eos / pad token ids (eos as a tuple), each generation_config.json's
    where it sets one (as HF resolves them), else config.json's, else `defaults`'; names: the
    names `check_llama_numbers` shows for the ids generation_config.json set.

    Example:
        >>> ids, names = special_token_ids({"bos_token_id": 1, "eos_token_id": 2},
        ...                                {"eos_token_id": [2, 7]})
        >>> ids
        {'bos_token_id': 1, 'eos_token_id': (2, 7), 'pad_token_id': None}
        >>> names
        {'eos_token_id': "generation_config.json's eos_token_id"}
    """
    defaults = defaults or {}
    ids = {field: generation[field] if field in generation
           else config.get(field, defaults.get(field)) for field in TOKEN_ID_FIELDS}
    eos = ids["eos_token_id"]
    ids["eos_token_id"] = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) \
        else (eos,)
    names = {field: f"generation_config.json's {field}" for field in TOKEN_ID_FIELDS
             if field in generation}
    return ids, names


def check_activation(config: Mapping, allowed: tuple[str, ...] = ("silu",),
                     where: str = "", key: str = "hidden_act") -> None:
    """ValueError naming config.json's `key` unless it is absent or one of `allowed` (the
    MLP activations the family implements).

    Example:
        >>> check_activation({"hidden_act": "gelu"}, where="config.json")
        Traceback (most recent call last):
        ...
        ValueError: config.json: hidden_act='gelu'; allowed: 'silu'
    """
    value = config.get(key, allowed[0])
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{_where(where)}{key}={value!r}; allowed: "
                         f"{', '.join(map(repr, allowed))}")


def refuse_quantization(config: Mapping, where: str = "") -> None:
    """ValueError when config.json carries a `quantization_config` (FP8 blocks, GPTQ, AWQ,
    bitsandbytes ...): the loaders read float weights only."""
    if config.get("quantization_config"):
        raise ValueError(f"{_where(where)}quantization_config={config['quantization_config']!r}"
                         f": quantized checkpoints (e.g. FP8 blocks, GPTQ, AWQ) are not "
                         f"supported; allowed: none (dequantize the weights first)")


def check_layer_count(indices: set[int], name: str, needed: int, pattern: str,
                      where: str = "") -> None:
    """ValueError when the config needs more layers (`needed`, under the config key `name`)
    than the checkpoint's tensor names hold (`indices`: the layer indices found under
    `pattern`). Run before any per-layer loop: a loop over a bogus count never ends."""
    if needed <= len(indices) and all(i in indices for i in range(needed)):
        return
    held = f"{min(indices)}..{max(indices)}" if indices else "none"
    raise ValueError(f"{_where(where)}{name}={needed} needs layers 0..{needed - 1}, but the "
                     f"checkpoint holds {len(indices)} layer(s) ({pattern} for i in {held})")


# params key -> the LlamaConfig fields its shape is made of (for check_tensor_shapes' message)
SHAPE_FIELDS = {
    "embed": ("vocab_size", "hidden_size"), "lm_head": ("vocab_size", "hidden_size"),
    "final_norm": ("hidden_size",), "attn_norm": ("hidden_size",), "mlp_norm": ("hidden_size",),
    "wq": ("hidden_size", "num_heads", "head_dim"), "wo": ("hidden_size", "num_heads", "head_dim"),
    "wk": ("hidden_size", "num_kv_heads", "head_dim"),
    "wv": ("hidden_size", "num_kv_heads", "head_dim"),
    "bq": ("num_heads", "head_dim"), "bk": ("num_kv_heads", "head_dim"),
    "bv": ("num_kv_heads", "head_dim"), "bo": ("hidden_size",),
    "q_norm": ("head_dim",), "k_norm": ("head_dim",),
    "w_gate": ("hidden_size", "intermediate_size"), "w_up": ("hidden_size", "intermediate_size"),
    "w_down": ("hidden_size", "intermediate_size"),
}


def shape_origin(key: str, config, names: Mapping[str, str] | None = None) -> str:
    """'vocab_size=40, hidden_size=16': the config numbers params[key]'s shape comes from,
    under the source's names."""
    names = names or {}
    return ", ".join(f"{names.get(f, f)}={getattr(config, f)}" for f in SHAPE_FIELDS.get(key, ()))


def expected_tensor_shapes(config, shapes: Mapping, names: Mapping[str, str] | None,
                           top: Mapping[str, str], layers: Mapping[str, tuple[str, bool]],
                           prefix: str) -> tuple[dict, dict]:
    """(tensor name -> the shape the config implies, tensor name -> the config numbers it
    comes from) for a checkpoint's naming: `shapes` is llama.param_shapes(config), `top` maps
    "embed" / "final_norm" / "lm_head" to tensor names, `layers` maps a layer key to (its
    suffix, stored transposed), `prefix` is the layer prefix with "{i}" ("blk.{i}.").

    Example:
        >>> from types import SimpleNamespace
        >>> cfg = SimpleNamespace(num_layers=1, vocab_size=4, hidden_size=2)
        >>> expected_tensor_shapes(cfg, {"embed": (4, 2), "final_norm": (2,), "layers": {}},
        ...                        None, {"embed": "e", "final_norm": "n", "lm_head": "h"},
        ...                        {}, "l.{i}.")[0]
        {'e': (4, 2), 'n': (2,), 'h': (4, 2)}
    """
    expected, origin = {}, {}

    def expect(tensor: str, key: str, shape: tuple, transposed: bool) -> None:
        expected[tensor] = tuple(reversed(shape)) if transposed else tuple(shape)
        origin[tensor] = shape_origin(key, config, names)

    expect(top["embed"], "embed", shapes["embed"], False)
    expect(top["final_norm"], "final_norm", shapes["final_norm"], False)
    expect(top["lm_head"], "lm_head", shapes["embed"], False)  # [V, D] as stored
    for key, shape in shapes["layers"].items():
        suffix, transposed = layers[key]
        for i in range(config.num_layers):
            expect(prefix.format(i=i) + suffix, key, shape[1:], transposed)
    return expected, origin


def check_tensor_shapes(expected: Mapping[str, tuple], actual: Mapping[str, tuple],
                        fields: Mapping[str, str], where: str = "") -> None:
    """ValueError naming the first tensor whose stored shape (`actual`, from the file's
    header) is not the one the config implies (`expected`); `fields`: tensor name -> the
    config numbers its shape comes from (shown in the message). Names missing from `actual`
    are left to the loader's missing-tensor error."""
    for name, shape in expected.items():
        got = actual.get(name)
        if got is not None and tuple(got) != tuple(shape):
            raise ValueError(f"{_where(where)}tensor {name!r} has shape {tuple(got)}, but the "
                             f"config implies {tuple(shape)} ({fields.get(name, 'the config')});"
                             f" does the config match the weights?")


__all__ = ["FLOAT_LIMITS", "INT_LIMITS", "check_activation", "check_float", "check_int",
           "check_layer_count", "check_llama_numbers", "check_tensor_shapes",
           "generation_fields", "is_int", "refuse_quantization", "shape_origin",
           "special_token_ids"]
