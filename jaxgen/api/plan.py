"""The plan: which loop, which driver and what is donated, for one `generate` call.

`make_plan` is the only place where a path through `generate` is chosen. It reads the
config, the hooks, the assistant and the host-side options, applies every cross-field rule
(raising a ValueError that names the fields before anything compiles) and returns a `Plan`:

    loop     a static, hashable loop description (one compiled program per distinct loop):
               DecodeLoop        greedy / sampling                      (jaxgen.loops.decode)
               BeamLoop          beam search / beam sampling            (jaxgen.loops.beam)
               SpeculativeLoop   assisted decoding with one drafter     (jaxgen.speculative)
               GuidedLoop        classifier-free guidance (guidance_scale) (jaxgen.loops.guidance)
               CustomLoop        custom_generate owns the loop
    driver   "single"   one jit call runs the whole loop
             "chunked"  the host drives the loop `chunk_size` steps per call (streamers,
                        max_time, stop_event)                           (jaxgen.drivers.chunked)
             "growing"  chunked, re-allocating the cache between chunks
                        (cache_implementation="dynamic")                (jaxgen.drivers.growing)
    donate   whether the state's buffers are donated to the call
    inputs   the loop's dynamic inputs (an assistant's params, start draft lengths) or None

`execute(plan, params, state, cfg)` runs it. Adding a drafter kind means writing its module
(a class honouring jaxgen.core.contracts.Drafter with a `from_request` classmethod) and adding
it to `DRAFTERS`.

Example:
    >>> import jax
    >>> from jaxgen.config.generation import GenerationConfig
    >>> from jaxgen.models import tiny_llama
    >>> from jaxgen.core.state import init_state
    >>> model, _ = tiny_llama()
    >>> cfg = GenerationConfig(max_new_tokens=4, prompt_lookup_num_tokens=3)
    >>> plan = make_plan(init_state(model, [[1, 2, 1]], cfg), cfg)
    >>> type(plan.loop).__name__, type(plan.loop.drafter).__name__, plan.driver, plan.donate
    ('SpeculativeLoop', 'PromptLookupDrafter', 'single', True)
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxgen.config.fields import check_int
from jaxgen.config.generation import (
    DYNAMIC_FIELDS,
    DYNAMIC_INT_FIELDS,
    GenerationConfig,
)
from jaxgen.core.extensions import (
    Extensions,
    accepts_hooks,
    make_extensions,
    resolve_custom_generate,
)
from jaxgen.config.program import program_config
from jaxgen.core.output import GenerateOutput, trim_output
from jaxgen.core.state import DecodeState, caller_state, program_state
from jaxgen.drivers.chunked import DEFAULT_CHUNK, ChunkTimings, run_chunked
from jaxgen.drivers.growing import grow_before_chunks, growing_chunk_size
from jaxgen.drivers.host_arguments import check_host_arguments
from jaxgen.drivers.host_hooks import adopt_transformers_hooks, check_host_loop
from jaxgen.drivers.prefix_hook import prefix_fn_hook
from jaxgen.stopping.strings import program_tables
from jaxgen.drivers.uad import run_uad
from jaxgen.loops.beam import BeamLoop
from jaxgen.loops.decode import DecodeLoop
from jaxgen.loops.guidance import GuidedLoop
from jaxgen.loops.guidance_inputs import guidance_request
from jaxgen.runtime import compiled
from jaxgen.runtime.backend import check_layout
from jaxgen.speculative.drafters.draft_model import DraftModelDrafter
from jaxgen.speculative.drafters.early_exit import EarlyExitDrafter
from jaxgen.speculative.drafters.mtp_assistant import MtpAssistantDrafter
from jaxgen.speculative.drafters.mtp_layers import MtpDrafter
from jaxgen.speculative.drafters.prompt_lookup import PromptLookupDrafter
from jaxgen.speculative.loop import AssistInputs, SpeculativeLoop
from jaxgen.speculative.tree_loop import tree_loop_for
from jaxgen.speculative.uad.bridge import universal_assistant
from jaxgen.speculative.uad.drafter import UadDrafter

# The drafter kinds, in the order their requests are checked. One line per kind.
DRAFTERS = (
    PromptLookupDrafter,  # cfg.prompt_lookup_num_tokens
    UadDrafter,  # assistant_model + tokenizer + assistant_tokenizer: another vocabulary
    EarlyExitDrafter,  # cfg.assistant_early_exit
    MtpDrafter,  # cfg.use_mtp
    DraftModelDrafter,  # assistant_model=(model, params)
    MtpAssistantDrafter,  # assistant_model=(MTP drafter, params): reads the target
)


@dataclasses.dataclass(frozen=True)
class CustomLoop:
    """custom_generate(params, state, cfg[, logits_processor=, stopping_criteria=]) as the
    loop: it runs inside the same jit and returns a GenerateOutput or a DecodeState."""

    custom: Any
    ext: Extensions = Extensions()
    chunkable = False

    def run(self, params, state: DecodeState, cfg: GenerationConfig, inputs=None):
        kwargs = {}
        if self.ext:
            kwargs = dict(logits_processor=self.ext.logits_processor,
                          stopping_criteria=self.ext.stopping_criteria)
        out = self.custom(params, state, cfg, **kwargs)
        if isinstance(out, GenerateOutput):
            return out
        if isinstance(out, DecodeState):
            steps = max(out.buffer_len - out.prompt_bucket, 1)
            return GenerateOutput(sequences=out.tokens, lengths=out.length,
                                  prompt_lengths=out.prompt_len, stop_reason=out.stop_reason,
                                  token_logprobs=jnp.zeros((out.batch, steps), jnp.float32),
                                  state=out)
        raise ValueError(f"custom_generate {self.custom!r} must return a GenerateOutput or a "
                         f"DecodeState, got {type(out).__name__}")


@dataclasses.dataclass(frozen=True)
class Plan:
    """One call's path (see the module docs). Host-side options ride along for the driver."""

    loop: Any
    driver: str  # "single" | "chunked" | "growing"
    donate: bool
    inputs: Any = None
    chunk_size: int | None = None
    streamer: Any = None
    max_time: float | None = None
    stop_event: Any = None
    timings: ChunkTimings | None = None
    bridge: Any = None  # "uad": the two tokenizers (jaxgen.speculative.uad.bridge.TokenBridge)
    prefix_fn: Any = None  # prefix_allowed_tokens_fn: the chunked driver, one step a chunk
    layout: str = "auto"  # the programs' layout (jaxgen.runtime.backend.LAYOUTS)


def is_traced(*trees) -> bool:
    """Whether any leaf is a tracer (generate called under jax.vmap / jit)."""
    return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(trees))


def choose_drafter(cfg: GenerationConfig, target_model, assistant_model,
                   num_assistant_tokens):
    """(drafter, AssistInputs) for an assisted call, or (None, None)."""
    chosen = []
    for kind in DRAFTERS:
        built = kind.from_request(cfg, target_model, assistant_model)
        if built is not None:
            chosen.append(built)
    if not chosen:
        if num_assistant_tokens is not None:
            raise ValueError("`num_assistant_tokens=` only applies to assisted decoding "
                             "(pass assistant_model=(model, params) or set "
                             "prompt_lookup_num_tokens)")
        return None, None
    if len(chosen) > 1:
        raise ValueError("pass only one way of drafting: `assistant_model`, "
                         "`prompt_lookup_num_tokens`, `assistant_early_exit` or `use_mtp`, "
                         "not several")
    if cfg.num_beams > 1:
        raise ValueError(f"assisted decoding (assistant_model / prompt lookup / use_mtp) does not "
                         f"support beam search (num_beams={cfg.num_beams}); use greedy or "
                         f"sampling (allowed: num_beams=1)")
    start = None
    if num_assistant_tokens is not None:
        check_int("num_assistant_tokens", num_assistant_tokens, low=1, per_row=True,
                  allowed="ints >= 1 (one, or one per row)")
        start = jnp.asarray(num_assistant_tokens, jnp.int32)
    drafter, draft_params = chosen[0]
    return drafter, AssistInputs(draft_params=draft_params, start_tokens=start)


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


def _check_constraint(state: DecodeState, cfg: GenerationConfig, loop, prefix_fn,
                      drafter) -> None:
    """Errors for a constraint (state.constraint or prefix_allowed_tokens_fn) that a path
    cannot honour, before anything compiles."""
    if prefix_fn is not None and not callable(prefix_fn):
        raise ValueError(f"`prefix_allowed_tokens_fn` must be a callable (batch_id, input_ids) "
                         f"-> allowed token ids, got {prefix_fn!r}")
    constrained = state.constraint is not None or prefix_fn is not None
    if not constrained:
        return
    if state.constraint is not None and prefix_fn is not None:
        raise ValueError("pass one constraint: `prefix_allowed_tokens_fn` together with a "
                         "compiled constraint (regex= / json_schema= / choices= / "
                         "constraint=) is ambiguous")
    what = ("`prefix_allowed_tokens_fn`" if prefix_fn is not None else
            "a constraint (regex= / json_schema= / choices= / constraint=)")
    if isinstance(loop, CustomLoop):
        raise ValueError(f"{what} cannot be combined with custom_generate (it owns the loop)")
    if getattr(drafter, "host_rounds", False):
        raise ValueError(f"{what} is not supported with universal assisted decoding (an "
                         f"assistant with another tokenizer); use an assistant with the "
                         f"target's vocabulary or prompt lookup")
    if prefix_fn is not None and type(loop) is not DecodeLoop:
        raise ValueError("`prefix_allowed_tokens_fn` runs on the host between one-token steps: "
                         "it supports greedy and sampling only; for beam search or assisted "
                         "decoding compile the constraint (regex= / json_schema= / choices=, "
                         "or a jaxgen.constraints.automaton.TokenAutomaton as constraint=)")
    if state.constraint is not None and state.constraint.automaton.eos_at_final \
            and not cfg.eos_ids:
        raise ValueError("a constraint needs an EOS token to end on (eos_token_id is unset): "
                         "set eos_token_id in the config")


def _choose_driver(cfg: GenerationConfig, loop, traced: bool, streamer, stop_event,
                   prefix_fn=None) -> str:
    """"single", "chunked" or "growing", with the rules that forbid a combination."""
    host = (streamer is not None or cfg.max_time is not None or stop_event is not None
            or prefix_fn is not None)
    growing = cfg.cache_implementation == "dynamic"
    if not host and not growing:
        return "single"
    what = ("streamer / max_time / stop_event / prefix_allowed_tokens_fn" if host else
            "cache_implementation='dynamic' (it grows the cache between chunks)")
    if traced:
        raise ValueError(f"{what} need the host between chunks: they cannot run under "
                         f"jax.vmap / jit around generate"
                         + ("" if host else "; use cache_implementation='static'"))
    if isinstance(loop, CustomLoop):
        raise ValueError(f"{what} cannot be combined with custom_generate (it owns the loop)")
    if isinstance(loop, BeamLoop):
        raise ValueError(f"{what} are not supported with beam search (num_beams > 1), as in "
                         f"Hugging Face; use greedy or sampling")
    if not getattr(loop, "chunkable", False):
        raise ValueError(f"{what} need a loop that runs in chunks; {type(loop).__name__} "
                         f"does not")
    if growing and isinstance(loop, SpeculativeLoop):
        raise ValueError("cache_implementation='dynamic' cannot be combined with assisted "
                         "decoding (assistant_model / prompt lookup); use 'static'")
    return "growing" if growing else "chunked"


def _placed_on_state_mesh(drafter, state: DecodeState):
    """A drafter that keeps caches of its own (`placed_on(mesh)`), told the mesh the state is
    sharded over (init_state(mesh=)); any other drafter, or a state on one device, as it is."""
    place = getattr(drafter, "placed_on", None)
    if place is None or isinstance(state.tokens, jax.core.Tracer):
        return drafter
    sharding = getattr(state.tokens, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if not isinstance(mesh, jax.sharding.Mesh) or set(mesh.axis_names) != {"data", "model"}:
        return drafter
    return place(mesh)


def make_plan(state: DecodeState, cfg: GenerationConfig, *, logits_processor=(),
              stopping_criteria=(), custom_generate=None, assistant_model=None,
              num_assistant_tokens=None, streamer=None, stop_event=None, chunk_size=None,
              timings=None, tokenizer=None, assistant_tokenizer=None,
              negative_prompt_ids=None, negative_prompt_attention_mask=None,
              prefix_allowed_tokens_fn=None, layout="auto") -> Plan:
    """The plan for one call (see the module docs). Raises ValueError for any combination
    that cannot run, before anything compiles."""
    check_host_arguments(streamer, stop_event)
    layout = check_layout(layout)
    logits_processor, stopping_criteria = adopt_transformers_hooks(  # HF's objects: host calls
        logits_processor, stopping_criteria, pad_token_id=state.pad_token_id,
        traced=is_traced(state, cfg))
    ext = make_extensions(logits_processor, stopping_criteria)
    custom = resolve_custom_generate(custom_generate)
    _check_hooks(state, cfg, ext, custom)
    assistant_model = universal_assistant(assistant_model, tokenizer, assistant_tokenizer,
                                          state.model)
    drafter, inputs = choose_drafter(cfg, state.model, assistant_model, num_assistant_tokens)
    drafter = _placed_on_state_mesh(drafter, state)
    if cfg.assistant_tree_nodes is not None and drafter is None:
        raise ValueError(f"`assistant_tree_nodes`={cfg.assistant_tree_nodes} applies to "
                         f"assisted decoding with an MTP drafter (pass assistant_model="
                         f"(MtpDrafterModel, params)) or prompt lookup (set "
                         f"prompt_lookup_num_tokens); allowed without one: "
                         f"assistant_tree_nodes=None")
    if drafter is not None and custom is not None:
        raise ValueError("custom_generate replaces the decoding loop: it cannot be combined "
                         "with assistant_model / prompt_lookup_num_tokens")
    guidance = guidance_request(state, cfg, negative_prompt_ids, negative_prompt_attention_mask,
                                assisted=drafter is not None, custom=custom is not None)
    if custom is not None:
        loop = CustomLoop(custom, ext)
    elif drafter is not None and cfg.assistant_tree_nodes is not None:  # token trees
        loop = tree_loop_for(drafter, ext, state, cfg)
    elif drafter is not None:
        loop = SpeculativeLoop(drafter, ext)
    elif cfg.num_beams > 1:
        loop = BeamLoop(ext, return_beam_indices=bool(cfg.return_dict_in_generate))
    elif guidance is not None:  # classifier-free guidance: the unconditional rows ride along
        loop, inputs = GuidedLoop(ext), guidance
    else:
        loop = DecodeLoop(ext)
    _check_constraint(state, cfg, loop, prefix_allowed_tokens_fn, drafter)
    check_host_loop(ext, loop)
    traced = is_traced(state, cfg, inputs)
    driver = _choose_driver(cfg, loop, traced, streamer, stop_event, prefix_allowed_tokens_fn)
    if getattr(drafter, "host_rounds", False):  # UAD: tokenizer work between rounds
        if traced:
            raise ValueError("universal assisted decoding (an assistant with another "
                             "tokenizer) needs the host between rounds: it cannot run under "
                             "jax.vmap / jit around generate")
        driver = "uad"
    check_int("chunk_size", chunk_size, low=1, allow_none=True)
    # Beam search repeats the prompt cache into a new [B*num_beams] cache: no input buffer
    # could be aliased to an output, so the state is not donated (and stays usable); the
    # same for a custom_generate with num_beams > 1. Under jax.vmap / jit nothing may be
    # donated: the caller's arrays are shared.
    donate = not traced and cfg.num_beams == 1
    return Plan(loop=loop, driver=driver, donate=donate, inputs=inputs, chunk_size=chunk_size,
                streamer=streamer, max_time=cfg.max_time, stop_event=stop_event,
                timings=timings, bridge=getattr(assistant_model, "bridge", None),
                prefix_fn=prefix_allowed_tokens_fn, layout=layout)


def canonical_config(cfg: GenerationConfig) -> GenerationConfig:
    """Dynamic leaves as float32 / int32 arrays, so Python floats and arrays share a compile."""
    def cast(name, value):
        if value is None:
            return None
        return jnp.asarray(value, jnp.int32 if name in DYNAMIC_INT_FIELDS else jnp.float32)

    leaves, treedef = jax.tree_util.tree_flatten(cfg)
    names = [n for n in DYNAMIC_FIELDS if getattr(cfg, n) is not None]
    return jax.tree_util.tree_unflatten(treedef, [cast(n, v) for n, v in zip(names, leaves)])


def program_inputs(plan: Plan, state: DecodeState, cfg: GenerationConfig
                   ) -> tuple[DecodeState, GenerationConfig]:
    """(state, config) as the compiled programs take them: the config's dynamic leaves as
    float32 / int32 arrays repeated to the state's rows, in program form
    (jaxgen.config.program: budgets, stop strings and max_time out of the key, EOS ids a
    dynamic table), the stop-string tables without their strings, and no visible_len or
    budget_source (jaxgen.core.budgets: checked by generate, not a program's key). A
    custom_generate loop gets the config as the caller wrote it (its code may read any
    field)."""
    jit_cfg = canonical_config(cfg.replace(max_time=None) if cfg.max_time is not None else cfg)
    copies = cfg.sample_copies  # per-prompt values -> the init_state's expanded rows
    jit_cfg = jit_cfg.repeat_rows(state.batch // copies, copies)
    if isinstance(plan.loop, CustomLoop):
        return state.replace(visible_len=None, budget_source=None), jit_cfg
    return (program_state(state, program_tables(state.stop_tables)), program_config(jit_cfg))


def execute(plan: Plan, params, state: DecodeState, cfg: GenerationConfig) -> GenerateOutput:
    """Runs a plan. Consumes `state` when plan.donate. The outputs are trimmed to the
    state's visible_len (the buffer may be padded to a bucket of new tokens)."""
    given = state
    state, jit_cfg = program_inputs(plan, state, cfg)
    out = _run_plan(plan, params, state, cfg, jit_cfg)
    if out.state is not None:
        out = dataclasses.replace(out, state=caller_state(out.state, given))
    return trim_output(out, given.visible_len, given.prompt_bucket)


def _run_plan(plan: Plan, params, state: DecodeState, cfg: GenerationConfig,
              jit_cfg: GenerationConfig) -> GenerateOutput:
    if plan.driver == "single":
        run = compiled.run_donated if plan.donate else compiled.run_kept
        return run(params, state, jit_cfg, plan.inputs, loop=plan.loop, layout=plan.layout)
    options = dict(streamer=plan.streamer, max_time=plan.max_time, stop_event=plan.stop_event,
                   timings=plan.timings, layout=plan.layout)
    if plan.driver == "uad":
        return run_uad(plan.loop, params, state, jit_cfg, plan.inputs, plan.bridge, **options)
    if plan.prefix_fn is not None:  # HF's per-row, per-step host function: one-step chunks
        grow = grow_before_chunks([]) if plan.driver == "growing" else None
        return run_chunked(plan.loop, params, state, jit_cfg, plan.inputs, chunk_size=1,
                           prepare_chunk=prefix_fn_hook(plan.prefix_fn, grow), **options)
    if plan.driver == "growing":
        return run_chunked(plan.loop, params, state, jit_cfg, plan.inputs,
                           chunk_size=growing_chunk_size(cfg, plan.chunk_size),
                           prepare_chunk=grow_before_chunks([]), **options)
    return run_chunked(plan.loop, params, state, jit_cfg, plan.inputs,
                       chunk_size=plan.chunk_size or DEFAULT_CHUNK, **options)


__all__ = ["DRAFTERS", "CustomLoop", "Plan", "canonical_config", "choose_drafter", "execute",
           "is_traced", "make_plan", "program_inputs"]
