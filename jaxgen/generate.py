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
from jaxgen.beam import beam_search
from jaxgen.chunked import DEFAULT_CHUNK, Assisted, needs_chunked, run_chunked
from jaxgen.decode import decode_loop
from jaxgen.extensions import (NO_EXTENSIONS, Extensions, accepts_hooks, make_extensions,
                               resolve_custom_generate)
from jaxgen.speculative import make_drafter, speculative_loop
from jaxgen.state import DecodeState, init_state

_INT_FIELDS = {"top_k", "min_length", "min_new_tokens"}
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
    sequences_scores float32 [B*R]    beam modes: HF's sequences_scores, else None
    beam_indices    int32 [B*R, N]    beam modes with return_dict_in_generate: HF's beam_indices
                                      (b*num_beams + beam per new token, -1 past the end), else None
    speculative     SpeculativeStats  assisted modes (assistant_model / prompt lookup): acceptance
                                      statistics (jaxgen.speculative.SpeculativeStats), else None

    Beam modes (num_beams > 1) return R = num_return_sequences rows per prompt, batch-major
    (rows b*R .. b*R+R-1 belong to prompt b, best first); `scores` / `logits` then hold the
    K running beams of every step, [B*K, N, V], as HF's do; `state` is None.
    """

    sequences: jax.Array
    lengths: jax.Array
    prompt_lengths: jax.Array
    stop_reason: jax.Array
    token_logprobs: jax.Array
    scores: jax.Array | None = None
    logits: jax.Array | None = None
    state: DecodeState | None = None
    sequences_scores: jax.Array | None = None
    beam_indices: jax.Array | None = None
    speculative: Any = None


def canonical_config(cfg: GenerationConfig) -> GenerationConfig:
    """Dynamic leaves as float32 / int32 arrays, so Python floats and arrays share a compile."""
    def cast(name, value):
        if value is None:
            return None
        return jnp.asarray(value, jnp.int32 if name in _INT_FIELDS else jnp.float32)

    leaves, treedef = jax.tree_util.tree_flatten(cfg)
    names = [n for n in DYNAMIC_FIELDS if getattr(cfg, n) is not None]
    return jax.tree_util.tree_unflatten(treedef, [cast(n, v) for n, v in zip(names, leaves)])


def _output(final: DecodeState, record, stats=None) -> GenerateOutput:
    """The output of the one-token-per-step and assisted loops: final state + step records."""
    return GenerateOutput(sequences=final.tokens, lengths=final.length,
                          prompt_lengths=final.prompt_len, stop_reason=final.stop_reason,
                          token_logprobs=record.token_logprobs, scores=record.scores,
                          logits=record.logits, state=final, speculative=stats)


def _generate_impl(params, state: DecodeState, cfg: GenerationConfig,
                   ext: Extensions = NO_EXTENSIONS, custom=None) -> GenerateOutput:
    _trace_count["generate"] += 1
    if custom is not None:
        return _run_custom_generate(custom, params, state, cfg, ext)
    if cfg.mode in ("beam", "beam_sample"):
        beams = beam_search(params, state, cfg, **({"ext": ext} if ext else {}))
        return GenerateOutput(sequences=beams.sequences, lengths=beams.lengths,
                              prompt_lengths=beams.prompt_lengths, stop_reason=beams.stop_reason,
                              token_logprobs=beams.token_logprobs, scores=beams.scores,
                              logits=beams.logits, sequences_scores=beams.sequences_scores,
                              beam_indices=(beams.beam_indices if cfg.return_dict_in_generate
                                            else None))
    if cfg.mode in ("greedy", "sample"):
        final, record = decode_loop(params, state, cfg, ext)
    else:  # validated away in GenerationConfig; kept for clarity
        raise ValueError(f"unsupported generation mode {cfg.mode!r}")
    return _output(final, record)


_generate_jit = jax.jit(_generate_impl, donate_argnums=(1,), static_argnums=(3, 4))


def _assisted_impl(params, state: DecodeState, cfg: GenerationConfig, draft_params,
                   start_tokens, ext: Extensions, drafter) -> GenerateOutput:
    """The assisted loop (jaxgen.speculative): prompt lookup or an assistant model."""
    _trace_count["generate"] += 1
    final, record, stats = speculative_loop(params, state, cfg, drafter, draft_params,
                                            start_tokens, ext)
    return _output(final, record, stats)


_assisted_jit = jax.jit(_assisted_impl, donate_argnums=(1,), static_argnums=(5, 6))
_assisted_traced_jit = jax.jit(_assisted_impl, static_argnums=(5, 6))
# Beam modes repeat the prompt cache into a new [B*num_beams] cache: no input buffer could be
# aliased to an output, so the state is not donated (and stays usable).
_generate_beam_jit = jax.jit(_generate_impl, static_argnums=(3, 4))


def _run_custom_generate(custom, params, state, cfg, ext: Extensions) -> GenerateOutput:
    """custom_generate(params, state, cfg[, logits_processor=, stopping_criteria=])."""
    kwargs = {}
    if ext:
        kwargs = dict(logits_processor=ext.logits_processor,
                      stopping_criteria=ext.stopping_criteria)
    out = custom(params, state, cfg, **kwargs)
    if isinstance(out, GenerateOutput):
        return out
    if isinstance(out, DecodeState):
        steps = max(out.buffer_len - out.prompt_bucket, 1)
        return GenerateOutput(sequences=out.tokens, lengths=out.length,
                              prompt_lengths=out.prompt_len, stop_reason=out.stop_reason,
                              token_logprobs=jnp.zeros((out.batch, steps), jnp.float32),
                              state=out)
    raise ValueError(f"custom_generate {custom!r} must return a GenerateOutput or a "
                     f"DecodeState, got {type(out).__name__}")


def _check_hooks(state: DecodeState, cfg: GenerationConfig, ext: Extensions, custom) -> None:
    """Errors for hooks that would otherwise be ignored, raised before compiling."""
    if cfg.stop_strings is not None and custom is None:
        tables = state.stop_tables
        if tables is None:
            raise ValueError("`stop_strings` needs a tokenizer: build the state with "
                             "init_state(..., tokenizer=tokenizer) (or pass tokenizer= to "
                             "generate_ids / generate_text)")
        if tuple(tables.strings) != tuple(cfg.stop_strings):
            raise ValueError(f"the state's stop-string tables were built for "
                             f"{list(tables.strings)} but cfg.stop_strings is "
                             f"{list(cfg.stop_strings)}; rebuild the state with init_state")
    if custom is not None and ext and not accepts_hooks(custom):
        raise ValueError("custom_generate does not accept `logits_processor` / "
                         "`stopping_criteria` keyword arguments, so the ones passed would be "
                         "dropped; add them to its signature or do not pass them")
    if cfg.num_beams > 1 and custom is None and (ext or cfg.stop_strings is not None):
        import inspect
        if "ext" not in inspect.signature(beam_search).parameters:
            raise ValueError("custom logits_processor / stopping_criteria and stop_strings are "
                             "not supported with beam search (num_beams > 1) yet")


def _generate_growing(params, state, jit_cfg, ext, custom, assisted: bool, traced: bool,
                      **options):
    """cache_implementation="dynamic": jaxgen.growing on the chunked driver (host loop).

    jit_cfg: the canonical config without max_time; options: streamer / max_time /
    stop_event / timings / chunk_size for the chunked driver.
    """
    if custom is not None or assisted or traced:
        raise ValueError("cache_implementation='dynamic' runs a host-side chunked driver: it "
                         "cannot be combined with custom_generate, assisted decoding or "
                         "jax.vmap / jit around generate; use 'static'")
    from jaxgen.growing import run_growing
    final, record, _ = run_growing(params, state, jit_cfg, ext, **options)
    return _output(final, record)


def _generate_chunked(params, state, cfg, ext, custom, assisted, traced: bool, *,
                      streamer, stop_event, chunk_size, timings):
    """Streaming / max_time / cancellation: the host-side chunked driver (jaxgen.chunked)."""
    what = "streamer / max_time / stop_event"
    if traced:
        raise ValueError(f"{what} need the host between chunks: they cannot run under "
                         f"jax.vmap / jit around generate")
    if custom is not None:
        raise ValueError(f"{what} cannot be combined with custom_generate (it owns the loop)")
    if cfg.num_beams > 1:
        raise ValueError(f"{what} are not supported with beam search (num_beams > 1), as in "
                         f"Hugging Face; use greedy or sampling")
    jit_cfg = canonical_config(cfg.replace(max_time=None))
    options = dict(streamer=streamer, max_time=cfg.max_time, stop_event=stop_event,
                   timings=timings)
    if cfg.cache_implementation == "dynamic":
        return _generate_growing(params, state, jit_cfg, ext, custom, assisted is not None,
                                 traced, chunk_size=chunk_size, **options)
    final, record, stats = run_chunked(
        params, state, jit_cfg, ext, chunk_size=DEFAULT_CHUNK if chunk_size is None else
        chunk_size, assisted=assisted, **options)
    return _output(final, record, stats)


def generate(params, state: DecodeState, cfg: GenerationConfig, *, logits_processor=(),
             stopping_criteria=(), custom_generate=None, assistant_model=None,
             num_assistant_tokens=None, streamer=None, stop_event=None, chunk_size=None,
             timings=None) -> GenerateOutput:
    """Decodes every row of `state` to completion under `cfg`. Consumes `state`.

    logits_processor / stopping_criteria / custom_generate: user hooks, static for the jit
    (see jaxgen.extensions).
    assistant_model: `(model, params)` of a draft model with the target's vocabulary: assisted
    (speculative) decoding, greedy or sampling (jaxgen.speculative). A config with
    `prompt_lookup_num_tokens` runs prompt lookup decoding without one.
    num_assistant_tokens: optional per-row int32 [B] (or one int) starting draft length, e.g.
    a previous output's `speculative.num_assistant_tokens` ("heuristic" schedule); dynamic.
    streamer: a jaxgen.streaming streamer (batch 1) or one per row; with `cfg.max_time` or a
    `stop_event` (threading.Event) it runs the chunked driver (jaxgen.chunked), `chunk_size`
    steps per jit call, with identical tokens. timings: an optional jaxgen.chunked.ChunkTimings
    filled in by the chunked driver (time to first token, chunks).
    """
    if not isinstance(cfg, GenerationConfig):
        raise TypeError(f"cfg must be a jaxgen.GenerationConfig, got {type(cfg).__name__}")
    if not isinstance(state, DecodeState):
        raise TypeError(f"state must be a jaxgen.DecodeState (from jaxgen.init_state), got "
                        f"{type(state).__name__}")
    ext = make_extensions(logits_processor, stopping_criteria)
    custom = resolve_custom_generate(custom_generate)
    _check_hooks(state, cfg, ext, custom)
    drafter, draft_params = make_drafter(cfg, state.model, assistant_model,
                                         num_assistant_tokens)
    if drafter is not None and custom is not None:
        raise ValueError("custom_generate replaces the decoding loop: it cannot be combined "
                         "with assistant_model / prompt_lookup_num_tokens")
    # Under jax.vmap / jit (traced leaves) nothing may be donated: the caller's arrays are
    # shared by every mapped call.
    traced = any(isinstance(leaf, jax.core.Tracer)
                 for leaf in jax.tree_util.tree_leaves((state, cfg)))
    start = None if num_assistant_tokens is None else jnp.asarray(num_assistant_tokens,
                                                                   jnp.int32)
    if needs_chunked(cfg, streamer, stop_event):
        assisted = None
        if drafter is not None:
            assisted = Assisted(drafter=drafter, draft_params=draft_params, start_tokens=start)
        return _generate_chunked(params, state, cfg, ext, custom, assisted, traced,
                                 streamer=streamer, stop_event=stop_event,
                                 chunk_size=chunk_size, timings=timings)
    if cfg.cache_implementation == "dynamic":
        return _generate_growing(params, state, canonical_config(cfg), ext, custom,
                                 drafter is not None, traced)
    if drafter is not None:
        run = _assisted_traced_jit if traced else _assisted_jit
        return run(params, state, canonical_config(cfg), draft_params, start, ext, drafter)
    run = _generate_beam_jit if cfg.num_beams > 1 or traced else _generate_jit
    return run(params, state, canonical_config(cfg), ext, custom)


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
                 tokenizer=None, logits_processor=(), stopping_criteria=(),
                 custom_generate=None, assistant_model=None, streamer=None,
                 stop_event=None, **overrides: Any) -> list[list[int]]:
    """Prompt + generated ids per row, padding removed (HF's output, row by row).

    assistant_model: `(model, params)` of a draft model: assisted decoding (see `generate`).

    tokenizer: needed for stop_strings. logits_processor / stopping_criteria /
    custom_generate: user hooks (jaxgen.extensions).

    Example:
        >>> jaxgen.generate_ids(model, params, [[1, 2, 3], [4, 5]], max_new_tokens=4)
    """
    cfg = default_config(model, cfg, **overrides)
    state = init_state(model, prompts, cfg, key, tokenizer=tokenizer)
    return outputs_to_lists(generate(params, state, cfg, logits_processor=logits_processor,
                                     stopping_criteria=stopping_criteria,
                                     custom_generate=custom_generate,
                                     assistant_model=assistant_model, streamer=streamer,
                                     stop_event=stop_event))


__all__ = ["GenerateOutput", "generate", "generate_ids", "default_config", "trace_count",
           "outputs_to_lists", "canonical_config", "stopping"]
