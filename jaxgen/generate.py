"""Dispatch: `generate(params, state, cfg)` picks the loop for the config's mode.

One `jax.jit` per call; the state (and its cache) is donated, so a state is consumed by
the call that decodes it. New prompts of the same bucket, new sampling values and new
keys reuse the compiled program: the config's dynamic fields are canonicalised to fixed
dtypes before they reach the jit.

Example:
    >>> model, params, tok = jaxgen.models.load("smollm2-135m-instruct")
    >>> ids = jaxgen.generate_ids(model, params, [tok.encode("Hello")], max_new_tokens=8)
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen import stopping
from jaxgen.config import DYNAMIC_FIELDS, GenerationConfig
from jaxgen.decode import decode_loop
from jaxgen.state import DecodeState, init_state

_INT_FIELDS = {"top_k"}
_trace_count = {"generate": 0}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GenerateOutput:
    """What `generate` returns (all arrays; row b's text is sequences[b, :lengths[b]]).

    sequences       int32 [B, T]      prompt + generated, right-padded with pad_token_id
    lengths         int32 [B]         valid tokens per row
    prompt_lengths  int32 [B]
    stop_reason     int32 [B]         jaxgen.stopping.STOP_REASONS
    token_logprobs  float32 [B, N]    log-prob of the i-th new token under the processed scores
    scores          float32 [B, N, V] processed scores per step (cfg.output_scores) or None
    logits          float32 [B, N, V] raw logits per step (cfg.output_logits) or None
    state           DecodeState       the final state (its buffers alias the donated input)
    """

    sequences: jax.Array
    lengths: jax.Array
    prompt_lengths: jax.Array
    stop_reason: jax.Array
    token_logprobs: jax.Array
    scores: jax.Array | None = None
    logits: jax.Array | None = None
    state: DecodeState | None = None


def canonical_config(cfg: GenerationConfig) -> GenerationConfig:
    """Dynamic leaves as float32 / int32 arrays, so Python floats and arrays share a compile."""
    def cast(name, value):
        if value is None:
            return None
        return jnp.asarray(value, jnp.int32 if name in _INT_FIELDS else jnp.float32)

    leaves, treedef = jax.tree_util.tree_flatten(cfg)
    names = [n for n in DYNAMIC_FIELDS if getattr(cfg, n) is not None]
    return jax.tree_util.tree_unflatten(treedef, [cast(n, v) for n, v in zip(names, leaves)])


def _generate_impl(params, state: DecodeState, cfg: GenerationConfig) -> GenerateOutput:
    _trace_count["generate"] += 1
    if cfg.mode in ("greedy", "sample"):
        final, record = decode_loop(params, state, cfg)
    else:  # validated away in GenerationConfig; kept for clarity
        raise ValueError(f"unsupported generation mode {cfg.mode!r}")
    return GenerateOutput(sequences=final.tokens, lengths=final.length,
                          prompt_lengths=final.prompt_len, stop_reason=final.stop_reason,
                          token_logprobs=record.token_logprobs, scores=record.scores,
                          logits=record.logits, state=final)


_generate_jit = jax.jit(_generate_impl, donate_argnums=(1,))


def generate(params, state: DecodeState, cfg: GenerationConfig) -> GenerateOutput:
    """Decodes every row of `state` to completion under `cfg`. Consumes `state`."""
    if not isinstance(cfg, GenerationConfig):
        raise TypeError(f"cfg must be a jaxgen.GenerationConfig, got {type(cfg).__name__}")
    if not isinstance(state, DecodeState):
        raise TypeError(f"state must be a jaxgen.DecodeState (from jaxgen.init_state), got "
                        f"{type(state).__name__}")
    return _generate_jit(params, state, canonical_config(cfg))


def trace_count() -> int:
    """How many times the generate program has been traced (compiled) in this process."""
    return _trace_count["generate"]


def default_config(model, cfg: GenerationConfig | None = None, **overrides: Any) -> GenerationConfig:
    """HF's resolution: the model's generation_config.json, its special ids, then overrides."""
    model_cfg = getattr(model, "config", None)
    if cfg is not None:
        cfg = cfg.replace(**overrides) if overrides else cfg
        missing = {name: getattr(model_cfg, name, None)
                   for name in ("eos_token_id", "pad_token_id", "bos_token_id")
                   if getattr(cfg, name) is None and getattr(model_cfg, name, None) is not None}
        return cfg.replace(**missing) if missing else cfg
    base = dict(getattr(model_cfg, "generation_defaults", ()) or ())
    for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
        if base.get(name) is None and getattr(model_cfg, name, None) is not None:
            base[name] = getattr(model_cfg, name)
    base.update(overrides)
    return GenerationConfig.from_dict(base)


def outputs_to_lists(out: GenerateOutput) -> list[list[int]]:
    """Row-wise prompt + generated ids with the padding removed."""
    sequences = np.asarray(out.sequences)
    lengths = np.asarray(out.lengths)
    return [sequences[b, :lengths[b]].tolist() for b in range(sequences.shape[0])]


def generate_ids(model, params, prompts, cfg: GenerationConfig | None = None, *, key=None,
                 **overrides: Any) -> list[list[int]]:
    """Prompt + generated ids per row, padding removed (HF's output, row by row).

    Example:
        >>> jaxgen.generate_ids(model, params, [[1, 2, 3], [4, 5]], max_new_tokens=4)
    """
    cfg = default_config(model, cfg, **overrides)
    state = init_state(model, prompts, cfg, key)
    return outputs_to_lists(generate(params, state, cfg))


__all__ = ["GenerateOutput", "generate", "generate_ids", "default_config", "trace_count",
           "outputs_to_lists", "canonical_config", "stopping"]
