"""The watermarking settings `GenerationConfig(watermarking_config=...)` takes: the green-list
watermark's (`WatermarkingConfig`) and SynthID-text's (`SynthIDTextWatermarkingConfig`), with
Hugging Face's field names, checked when built. The processors that apply them live in
`jaxgen.logits.watermark`.

Example:
    >>> parse_watermarking_config({"keys": [654, 400], "ngram_len": 3}).depth
    2
"""
from __future__ import annotations

import dataclasses

import numpy as np

from jaxgen.config.fields import check_bool, check_float, check_int

SEEDING_SCHEMES = ("lefthash", "selfhash")


@dataclasses.dataclass(frozen=True)
class SynthIDTextWatermarkingConfig:
    """SynthID-text settings (Hugging Face's SynthIDTextWatermarkingConfig fields).

    ngram_len             tokens per n-gram (context = ngram_len - 1 tokens), >= 2
    keys                  one int key per tournament layer (depth = len(keys))
    context_history_size  how many past contexts are remembered (repeats are not marked)
    sampling_table_seed   seed of the 0/1 table; sampling_table_size its size (<= 2**24)
    skip_first_ngram_calls  do not mark the first ngram_len - 1 steps
    debug_mode            replace the scores by ones first (HF's test switch)

    >>> SynthIDTextWatermarkingConfig(ngram_len=5, keys=[654, 400, 836]).depth
    3
    """

    ngram_len: int
    keys: tuple
    context_history_size: int = 1024
    sampling_table_seed: int = 0
    sampling_table_size: int = 2**16
    skip_first_ngram_calls: bool = False
    debug_mode: bool = False

    def __post_init__(self):
        name = "watermarking_config"
        check_int(f"{name}.ngram_len", self.ngram_len, low=2)
        keys = self.keys
        keys = keys.tolist() if hasattr(keys, "tolist") else keys
        allowed = "a non-empty list of ints in [0, 2**63)"
        if isinstance(keys, (str, bytes)) or not hasattr(keys, "__iter__") or not list(keys):
            raise ValueError(f"`{name}.keys` must be {allowed}, got {self.keys!r}")
        keys = list(keys)
        for key in keys:
            if (isinstance(key, (bool, np.bool_)) or not isinstance(key, (int, np.integer))
                    or not 0 <= key < 2**63):
                raise ValueError(f"`{name}.keys` must be {allowed}, got {self.keys!r}")
        object.__setattr__(self, "keys", tuple(int(k) for k in keys))
        check_int(f"{name}.context_history_size", self.context_history_size, low=1)
        check_int(f"{name}.sampling_table_seed", self.sampling_table_seed)
        check_int(f"{name}.sampling_table_size", self.sampling_table_size, low=1,
                  allowed="an int in [1, 2**24]")
        if self.sampling_table_size > 2**24:
            raise ValueError(f"`{name}.sampling_table_size` must be an int in [1, 2**24], got "
                             f"{self.sampling_table_size}")
        check_bool(f"{name}.skip_first_ngram_calls", self.skip_first_ngram_calls)
        check_bool(f"{name}.debug_mode", self.debug_mode)

    @property
    def depth(self) -> int:
        return len(self.keys)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["keys"] = list(self.keys)
        return out


@dataclasses.dataclass(frozen=True)
class WatermarkingConfig:
    """The green-list watermark's settings (Hugging Face's WatermarkingConfig fields).

    greenlist_ratio  share of the vocabulary that is green at each step, in (0, 1)
    bias             added to the green tokens' scores (a finite float)
    hashing_key      the secret key, an int in [0, 2**32) (jaxgen computes the lefthash seed
                     in 32-bit arithmetic, exact for keys below 2**32)
    seeding_scheme   "lefthash" (the seed is the newest token) or "selfhash" (each candidate
                     seeds its own list; context_width 1 only)
    context_width    tokens the seed reads; rows shorter than it are not watermarked

    >>> WatermarkingConfig(seeding_scheme="lefthash", greenlist_ratio=0.5).greenlist_ratio
    0.5
    >>> WatermarkingConfig(seeding_scheme="sha256")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: `watermarking_config.seeding_scheme` must be one of ('lefthash', 'selfhash'), ...
    """

    greenlist_ratio: float = 0.25
    bias: float = 2.0
    hashing_key: int = 15485863
    seeding_scheme: str = "lefthash"
    context_width: int = 1

    def __post_init__(self):
        if self.seeding_scheme not in SEEDING_SCHEMES:
            raise ValueError(f"`watermarking_config.seeding_scheme` must be one of "
                             f"{SEEDING_SCHEMES}, got {self.seeding_scheme!r}")
        check_float("watermarking_config.greenlist_ratio", self.greenlist_ratio, low=0.0,
                    high=1.0, low_open=True, high_open=True,
                    allowed="a float in the open interval (0, 1)")
        check_float("watermarking_config.bias", self.bias, allowed="a finite float")
        key = self.hashing_key
        if (isinstance(key, (bool, np.bool_)) or not isinstance(key, (int, np.integer))
                or not 0 <= key < 2**32):
            raise ValueError(f"`watermarking_config.hashing_key` must be an int in [0, 2**32) "
                             f"(jaxgen seeds in 32-bit arithmetic), got {key!r}")
        object.__setattr__(self, "hashing_key", int(key))
        check_int("watermarking_config.context_width", self.context_width, low=1)
        if self.seeding_scheme == "selfhash" and self.context_width != 1:
            raise ValueError(f"`watermarking_config.context_width`={self.context_width} with "
                             f"seeding_scheme='selfhash' is not supported for generation "
                             f"(allowed: context_width=1 with 'selfhash', any width with "
                             f"'lefthash')")
        object.__setattr__(self, "greenlist_ratio", float(self.greenlist_ratio))
        object.__setattr__(self, "bias", float(self.bias))

    def green_size(self, vocab_size: int) -> int:
        """G = int(vocab_size * greenlist_ratio), as HF."""
        return int(vocab_size * self.greenlist_ratio)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def parse_watermarking_config(value):
    """None, a WatermarkingConfig / SynthIDTextWatermarkingConfig, a dict of one's fields or
    Hugging Face's config object (anything with `to_dict()`) -> jaxgen's config object.

    >>> parse_watermarking_config({"bias": 3.0}).bias
    3.0
    """
    if value is None or isinstance(value, (WatermarkingConfig, SynthIDTextWatermarkingConfig)):
        return value
    if not isinstance(value, dict) and callable(getattr(value, "to_dict", None)):
        value = value.to_dict()
    if not isinstance(value, dict):
        raise ValueError(f"`watermarking_config` must be a WatermarkingConfig, a "
                         f"SynthIDTextWatermarkingConfig or a dict of their fields, got "
                         f"{value!r}")
    kind = SynthIDTextWatermarkingConfig if "keys" in value else WatermarkingConfig
    fields = {f.name for f in dataclasses.fields(kind)}
    unknown = sorted(set(value) - fields)
    if unknown:
        raise ValueError(f"`watermarking_config` has unknown key(s) {unknown} for "
                         f"{kind.__name__} (allowed: {sorted(fields)})")
    return kind(**value)


__all__ = ["SEEDING_SCHEMES", "SynthIDTextWatermarkingConfig", "WatermarkingConfig",
           "parse_watermarking_config"]
