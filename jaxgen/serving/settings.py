"""What the engine's config may hold, and what one request may set for its own row.

The engine runs one program for every slot, so what is static in a config (do_sample, the
EOS ids' table, the processors in the chain) is the engine's, program-wide. Per request:

    max_new_tokens        the row's budget (DecodeState.max_new)
    key                   its PRNG key (jax.random.key(seed)); the slot's row key is the one a
                          solo generate call with this key gives its single row
                          (fold_in(key, 0)), so sampled tokens equal the solo call's; a
                          [1] array of keys is that row key itself (generate's per-row keys)
    temperature, top_k, top_p   per-row dynamic values (sampling engines only: with
                          do_sample=True these processors are always in the program)

Anything else a request asks for is refused, naming the engine's config as the place for it.

Example:
    >>> from jaxgen.config.generation import GenerationConfig
    >>> cfg = GenerationConfig(do_sample=True, temperature=0.7, max_new_tokens=5)
    >>> request_values(cfg, dict(temperature=0.5))
    {'temperature': 0.5, 'top_k': 50, 'top_p': 1.0}
"""
from __future__ import annotations

import numpy as np

from jaxgen.config.generation import GenerationConfig

SAMPLING_FIELDS = ("temperature", "top_k", "top_p")
REQUEST_FIELDS = ("max_new_tokens", "key") + SAMPLING_FIELDS


def check_engine_config(cfg: GenerationConfig) -> None:
    """ValueError for a config the engine does not run (one plain decode loop over every
    slot, a dense static cache, no per-step outputs)."""
    if not isinstance(cfg, GenerationConfig):
        raise TypeError(f"cfg must be a jaxgen.GenerationConfig, got {type(cfg).__name__}")
    refused = {
        "num_beams": (cfg.num_beams != 1, "beam search needs its beams together"),
        "num_return_sequences": (cfg.num_return_sequences not in (None, 1),
                                 "submit the prompt once per sequence"),
        "stop_strings": (cfg.stop_strings is not None, "stop strings are not scheduled"),
        "guidance_scale": (cfg.guidance_scale not in (None, 1, 1.0),
                           "classifier-free guidance is not scheduled"),
        "cache_implementation": (cfg.cache_implementation not in (None, "static")
                                 or bool(cfg.cache_config),
                                 "the slots share one dense static cache"),
        "output_scores": (bool(cfg.output_scores), "the engine returns ids only"),
        "output_logits": (bool(cfg.output_logits), "the engine returns ids only"),
        "max_time": (cfg.max_time is not None, "cancel a request instead"),
        "prompt_logprobs": (bool(cfg.prompt_logprobs),
                            "prompts are prefilled in chunks; new tokens' log-probs are given"),
    }
    for name, (bad, why) in refused.items():
        if bad:
            raise ValueError(f"jaxgen.serving.Engine: `{name}`={getattr(cfg, name)!r} is not "
                             f"supported by continuous batching ({why}); use jaxgen.generate")
    for name in SAMPLING_FIELDS:
        if np.ndim(getattr(cfg, name)) != 0:
            raise ValueError(f"jaxgen.serving.Engine: the config's `{name}` must be one value "
                             f"(per-row values are given per request: submit(..., {name}=))")


def request_values(cfg: GenerationConfig, settings: dict) -> dict:
    """The request's per-row sampling values (temperature, top_k, top_p), the engine's
    config filling what it does not set. ValueError for a setting the engine keeps
    program-wide (naming the ones a request may set)."""
    unknown = sorted(set(settings) - set(REQUEST_FIELDS))
    if unknown:
        raise ValueError(f"submit: {unknown} cannot be set per request (allowed: "
                         f"{list(REQUEST_FIELDS)}); every other setting is program-wide: "
                         f"build an Engine with it in its GenerationConfig (e.g. "
                         f"eos_token_id, do_sample, repetition_penalty)")
    given = {k: v for k, v in settings.items() if k in SAMPLING_FIELDS and v is not None}
    if given and not cfg.do_sample:
        raise ValueError(f"submit: {sorted(given)} need a sampling engine (its config with "
                         f"do_sample=True); this engine decodes greedily")
    if given:  # the config's own checks (ranges, types)
        cfg.replace(**given)
    return {name: given.get(name, getattr(cfg, name)) for name in SAMPLING_FIELDS}


__all__ = ["REQUEST_FIELDS", "SAMPLING_FIELDS", "check_engine_config", "request_values"]
