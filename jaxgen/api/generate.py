"""The entry points: `generate(params, state, cfg)` and `generate_ids(model, params, prompts)`.

`generate` reads as validate -> plan -> run: the inputs are checked on the host (config,
state, params, hooks), `jaxgen.api.plan.make_plan` chooses the loop, the driver and what is
donated, and `jaxgen.api.plan.execute` runs it. One `jax.jit` per call; the state (and its
cache) is donated, so a state is consumed by the call that decodes it (except for beam
search). New prompts of the same bucket, new sampling values and new keys reuse the
compiled program.

Example:
    >>> import jax, jaxgen
    >>> from jaxgen.models import tiny_llama
    >>> model, params = tiny_llama()
    >>> rows = jaxgen.generate_ids(model, params, [[1, 2, 3], [4, 5]], max_new_tokens=4)
    >>> [len(row) for row in rows]
    [7, 6]
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxgen.api.plan import canonical_config, execute, make_plan
from jaxgen.config.generation import (
    GenerationConfig,
    is_transformers_config,
    transformers_fields,
)
from jaxgen.constraints.compile import resolve_constraint
from jaxgen.core.budgets import check_same_budget
from jaxgen.core.output import GenerateOutput, outputs_to_lists
from jaxgen.core.context import check_context, model_positions
from jaxgen.core.state import DecodeState, check_state_shapes, init_state
from jaxgen.drivers.chunked import end_streamers
from jaxgen.drivers.host_arguments import check_host_arguments
from jaxgen.loops.decode import DecodeLoop
from jaxgen.loops.guidance_inputs import guidance_buffer_len
from jaxgen.runtime.compiled import trace_count

CONSUMED = ("this state was consumed by an earlier generate call (its buffers were donated); "
            "build a new one with init_state")


def check_inputs(params, state: DecodeState, cfg: GenerationConfig) -> None:
    """Host-side checks of generate's arguments, before anything compiles."""
    if not isinstance(cfg, GenerationConfig):
        raise TypeError(f"cfg must be a jaxgen.GenerationConfig, got {type(cfg).__name__}")
    if not isinstance(state, DecodeState):
        raise TypeError(f"state must be a jaxgen.DecodeState (from jaxgen.init_state), got "
                        f"{type(state).__name__}")
    for leaf in jax.tree_util.tree_leaves(state):
        if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer) \
                and leaf.is_deleted():
            raise ValueError(CONSUMED)
    check_state_shapes(state)
    check_state_context(state)
    check_same_budget(state, cfg)
    cfg.validate_for_model(state.model.vocab_size)
    copies = cfg.sample_copies
    if state.batch % copies:
        raise ValueError(f"the state has {state.batch} rows but num_return_sequences="
                         f"{copies} with sampling needs a multiple: build the state with "
                         f"init_state and this config")
    cfg.validate_for_batch(state.batch // copies)
    check_params = getattr(state.model, "check_params", None)
    if callable(check_params):
        check_params(params)


def check_state_context(state: DecodeState) -> None:
    """ContextTooLong when a row's prompt plus its budget passes the model's positions (a
    state built by hand; init_state checks its own). Traced states are not read."""
    positions = model_positions(state.model)
    if positions is None or any(
            isinstance(leaf, jax.core.Tracer)
            or not getattr(leaf, "is_fully_addressable", True)  # another process holds rows
            for leaf in (state.prompt_len, state.max_new)):
        return
    check_context(positions, np.asarray(state.prompt_len), np.asarray(state.max_new))


def config_argument(cfg, generation_config):
    """`cfg` or its keyword alias `generation_config=` (HF's name), not both; a
    transformers.GenerationConfig stays as it is (see `resolve_config`)."""
    if cfg is not None and generation_config is not None:
        raise ValueError("pass the config once: `cfg` and `generation_config=` were both given")
    return cfg if generation_config is None else generation_config


def resolve_config(model, cfg, generation_config=None, **overrides: Any) -> GenerationConfig:
    """The call's config, as HF resolves it: a jaxgen GenerationConfig (or None) through
    `default_config`; a transformers.GenerationConfig's set fields on top of the model's
    generation_config.json (HF fills a passed config's unset fields from it), converted
    through `GenerationConfig.from_transformers` (what jaxgen does not implement is refused,
    naming the field); `overrides` last."""
    cfg = config_argument(cfg, generation_config)
    if is_transformers_config(cfg):
        GenerationConfig.from_transformers(cfg)  # names a refused field as the user's config's
        return default_config(model, None, **{**transformers_fields(cfg), **overrides})
    if cfg is not None and not isinstance(cfg, GenerationConfig):
        raise TypeError(f"`generation_config` must be a jaxgen.GenerationConfig or a "
                        f"transformers.GenerationConfig, got {type(cfg).__name__}")
    return default_config(model, cfg, **overrides)


def generate(params, state: DecodeState, cfg: GenerationConfig | None = None, *,
             logits_processor=(),
             stopping_criteria=(), custom_generate=None, assistant_model=None,
             num_assistant_tokens=None, streamer=None, stop_event=None, chunk_size=None,
             timings=None, tokenizer=None, assistant_tokenizer=None,
             negative_prompt_ids=None, negative_prompt_attention_mask=None,
             prefix_allowed_tokens_fn=None, layout="auto",
             generation_config=None) -> GenerateOutput:
    """Decodes every row of `state` to completion under `cfg`. Consumes `state`.

    cfg / generation_config: the config (`generation_config=` is HF's keyword for it; give
    one): a jaxgen.GenerationConfig or a transformers.GenerationConfig (converted by
    `GenerationConfig.from_transformers`).

    logits_processor / stopping_criteria / custom_generate: user hooks, static for the jit
    (see jaxgen.core.extensions); transformers' LogitsProcessor / StoppingCriteria objects
    run on the host once per step (greedy / sampling, jaxgen.drivers.host_hooks).
    assistant_model: `(model, params)` of a draft model with the target's vocabulary: assisted
    (speculative) decoding, greedy or sampling (jaxgen.speculative). A config with
    `prompt_lookup_num_tokens` runs prompt lookup decoding without one.
    num_assistant_tokens: optional per-row int32 [B] (or one int) starting draft length, e.g.
    a previous output's `speculative.num_assistant_tokens` ("heuristic" schedule); dynamic.
    tokenizer / assistant_tokenizer: the target's and the assistant's tokenizers (jaxgen.models'
    Tokenizer or a raw tokenizers.Tokenizer) for an assistant with another vocabulary:
    universal assisted decoding (jaxgen.drivers.uad), greedy as Hugging Face aligns it, or
    lossless sampling across vocabularies.
    streamer: a jaxgen.drivers.streamers streamer (batch 1) or one per row; with `cfg.max_time` or a
    `stop_event` (threading.Event) it runs the chunked driver (jaxgen.drivers.chunked), `chunk_size`
    steps per jit call, with identical tokens. Streamers are ended on every exit path (an
    error reaches an iterator streamer's consumer). timings: an optional
    jaxgen.drivers.chunked.ChunkTimings filled in by the chunked driver.
    negative_prompt_ids / negative_prompt_attention_mask: classifier-free guidance's
    unconditional prompts (cfg.guidance_scale != 1; HF's generate arguments): id lists, or a
    left-padded [B, S] array with its mask; one, or one per prompt (jaxgen.loops.guidance_inputs).
    prefix_allowed_tokens_fn: HF's `fn(batch_id, input_ids) -> allowed ids`, called on the
    host for every row before every token (greedy / sampling; the chunked driver one step per
    call, jaxgen.drivers.prefix_hook). The compiled form is a token automaton in the state
    (init_state(constraint=...), jaxgen.constraints.automaton), which every mode applies.
    layout: "auto" (the default: the backend of this process lays the weights out, e.g. per
    layer with native kernels on XLA:CPU), "portable" (no backend preparation: the program a
    GPU or TPU runs) or "split" (the CPU layouts whatever the model's size); static, part of
    the compiled program's key (jaxgen.runtime.backend). Tokens are the same in every layout.
    """
    try:
        cfg = config_argument(cfg, generation_config)
        if is_transformers_config(cfg):
            cfg = GenerationConfig.from_transformers(cfg)
        if cfg is None:
            raise TypeError("generate needs a config: pass cfg (or generation_config=), the "
                            "one the state was built with")
        check_inputs(params, state, cfg)
        plan = make_plan(state, cfg, logits_processor=logits_processor,
                         stopping_criteria=stopping_criteria, custom_generate=custom_generate,
                         assistant_model=assistant_model,
                         num_assistant_tokens=num_assistant_tokens, streamer=streamer,
                         stop_event=stop_event, chunk_size=chunk_size, timings=timings,
                         tokenizer=tokenizer, assistant_tokenizer=assistant_tokenizer,
                         negative_prompt_ids=negative_prompt_ids,
                         negative_prompt_attention_mask=negative_prompt_attention_mask,
                         prefix_allowed_tokens_fn=prefix_allowed_tokens_fn, layout=layout)
        check_continued(state, plan)
    except BaseException as error:
        end_streamers(streamer, error)
        raise
    return execute(plan, params, state, cfg)  # a streamer implies the chunked driver, which
    #                                           ends its streamers on every path


def check_continued(state: DecodeState, plan) -> None:
    """A continued state (init_state(prefix=), jaxgen.continue_state) runs the plain loop
    (greedy / sampling; single, chunked or growing driver) only: ValueError otherwise."""
    if state.cached is not None and type(plan.loop) is not DecodeLoop:
        raise ValueError(f"a continued state (init_state(prefix=...), jaxgen.continue_state) "
                         f"runs greedy or sampling decoding only, not "
                         f"{type(plan.loop).__name__} (beam search, assisted decoding, "
                         f"guidance and custom_generate prefill the whole prompt): build the "
                         f"state with init_state from the full token lists instead")


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
    return GenerationConfig.from_defaults(
        base, "the model's generation_config.json (its generation defaults; pass the field "
        "to override it)", **overrides)


def generate_ids(model, params, prompts, cfg: GenerationConfig | None = None, *, key=None,
                 tokenizer=None, logits_processor=(), stopping_criteria=(),
                 custom_generate=None, assistant_model=None, assistant_tokenizer=None,
                 streamer=None, stop_event=None, mesh=None, negative_prompt_ids=None,
                 negative_prompt_attention_mask=None, regex=None, json_schema=None,
                 choices=None, constraint=None, prefix_allowed_tokens_fn=None,
                 layout="auto", truncation: str | None = None, generation_config=None,
                 **overrides: Any) -> list[list[int]]:
    """Prompt + generated ids per row, padding removed (HF's output, row by row).

    cfg / generation_config: the config (one of them): a jaxgen.GenerationConfig or a
    transformers.GenerationConfig (see `resolve_config`); `overrides` apply on top, as in HF.

    assistant_model: `(model, params)` of a draft model: assisted decoding (see `generate`).
    tokenizer: needed for stop_strings, and with `assistant_tokenizer` (the assistant's) for
    an assistant with another tokenizer (universal assisted decoding).
    logits_processor / stopping_criteria / custom_generate: user hooks (jaxgen.core.extensions).
    mesh: a ("data", "model") jax.sharding.Mesh: rows and KV cache sharded over it
    (init_state(..., mesh=)); pass params placed by jaxgen.models.shard.
    negative_prompt_ids / negative_prompt_attention_mask: classifier-free guidance's
    unconditional prompts (see `generate`); the buffer is sized to hold them.
    regex / json_schema / choices: constrained generation (one of them; needs tokenizer=):
    compiled to a token automaton for the tokenizer (jaxgen.constraints.compile, cached) that
    every mode applies; constraint: a prebuilt jaxgen.constraints.automaton.TokenAutomaton.
    prefix_allowed_tokens_fn: HF's host function instead (see `generate`).
    layout: the programs' weight layout (see `generate`).
    truncation: None (a prompt that does not fit the model's max_position_embeddings with
    max_new_tokens raises jaxgen.core.context.ContextTooLong, naming it) or "left" (it keeps
    its last tokens, as transformers' pipelines truncate); see init_state.
    """
    try:
        check_host_arguments(streamer, stop_event)
        cfg = resolve_config(model, cfg, generation_config, **overrides)
        constraint = resolve_constraint(model, tokenizer, regex=regex, json_schema=json_schema,
                                        choices=choices, constraint=constraint,
                                        prefix_allowed_tokens_fn=prefix_allowed_tokens_fn)
        state = init_state(model, prompts, cfg, key, tokenizer=tokenizer, mesh=mesh,
                           constraint=constraint, truncation=truncation)
        wider = guidance_buffer_len(state, cfg, negative_prompt_ids,
                                    negative_prompt_attention_mask)
        if wider is not None:  # the negative prompts need a longer buffer than the prompts
            state = init_state(model, prompts, cfg, key, tokenizer=tokenizer, mesh=mesh,
                               buffer_len=wider, constraint=constraint, truncation=truncation)
    except BaseException as error:
        end_streamers(streamer, error)
        raise
    return outputs_to_lists(generate(params, state, cfg, logits_processor=logits_processor,
                                     stopping_criteria=stopping_criteria,
                                     custom_generate=custom_generate,
                                     assistant_model=assistant_model, streamer=streamer,
                                     stop_event=stop_event, tokenizer=tokenizer,
                                     assistant_tokenizer=assistant_tokenizer,
                                     negative_prompt_ids=negative_prompt_ids,
                                     negative_prompt_attention_mask=(
                                         negative_prompt_attention_mask),
                                     prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
                                     layout=layout))


__all__ = ["GenerateOutput", "generate", "generate_ids", "default_config", "resolve_config",
           "config_argument", "trace_count",
           "outputs_to_lists", "canonical_config", "check_inputs"]
