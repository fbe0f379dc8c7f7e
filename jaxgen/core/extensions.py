"""User extension points: logits processors, stopping criteria and `custom_generate`.

All three are keyword arguments of `jaxgen.generate`, `jaxgen.generate_ids` and
`jaxgen.generate_text`, and are *static* for the jit (part of the compiled program, hashed
by identity: pass the same function objects to reuse a compile; a fresh lambda per call
recompiles).

    logits_processor   sequence of traceable callables `(scores [B, V], ctx) -> scores`.
                       They run where Hugging Face merges a custom `logits_processor` list:
                       after the built-in processors, before the sampling warpers
                       (temperature, top-k, ...) and before `renormalize_logits`.
                       `ctx` is a `jaxgen.logits.chain.ProcessorContext`.
    stopping_criteria  sequence of traceable callables `(ctx, scores) -> bool [B]`, True =
                       stop the row; evaluated after each write (ctx includes the new token).
                       Rows they stop get stop reason `custom`. The criteria objects of
                       `jaxgen.stopping.criteria` fit this contract; a StoppingCriteriaList
                       is taken apart into its entries; MaxTimeCriteria is refused (it reads
                       the host clock: use GenerationConfig(max_time=...)).
    custom_generate    replaces the whole decoding loop: a callable `(params, state, cfg) ->
                       GenerateOutput | DecodeState`, traced inside the same jit; or a string
                       "pkg.module:function" / "pkg.module" (which must expose `generate`),
                       the offline equivalent of HF's hub repository name (a Hub name,
                       "org/repo", is refused: jaxgen never downloads or runs remote
                       code). It receives the
                       logits_processor / stopping_criteria given alongside as keyword
                       arguments when its signature accepts them; otherwise passing them
                       together is an error (never silently dropped).

Hugging Face's own `LogitsProcessor` / `StoppingCriteria` objects (and their lists) are
accepted too: `jaxgen.api.plan` wraps them (jaxgen.drivers.host_hooks) to run on the host once
per step, with greedy and sampling; under jax.jit / vmap they are refused.

Example:
    >>> import jax, jax.numpy as jnp, jaxgen
    >>> from jaxgen.models import tiny_llama
    >>> model, params = tiny_llama()
    >>> ban_7 = lambda scores, ctx: scores.at[:, 7].set(-jnp.inf)
    >>> long_enough = lambda ctx, scores: ctx.length - ctx.prompt_len >= 3
    >>> cfg = jaxgen.GenerationConfig(max_new_tokens=10)
    >>> out = jaxgen.generate(params, jaxgen.init_state(model, [[1, 2]], cfg), cfg,
    ...                       logits_processor=[ban_7], stopping_criteria=[long_enough])
    >>> int(out.lengths[0] - out.prompt_lengths[0]), 7 in out.sequences[0].tolist()
    (3, False)
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Any, Callable

from jaxgen.stopping.criteria import (
    MaxTimeCriteria,
    StoppingCriteriaList,
    flatten_criteria,
)


@dataclasses.dataclass(frozen=True)
class Extensions:
    """The static user hooks of one generate call (hashable; functions by identity)."""

    logits_processor: tuple = ()
    stopping_criteria: tuple = ()

    def __bool__(self) -> bool:
        return bool(self.logits_processor or self.stopping_criteria)


NO_EXTENSIONS = Extensions()

# What an error about an untraceable hook points to.
TRACEABLE_HOOKS = ("a logits processor `(scores [B, V], ctx) -> scores` or a stopping "
                   "criterion `(ctx, scores) -> bool [B]` written with jax.numpy, see "
                   "jaxgen.core.extensions")


def _transformers_object(item) -> bool:
    return any((cls.__module__ or "").startswith("transformers") for cls in type(item).__mro__)


def _as_tuple(name: str, value) -> tuple:
    if value is None:
        return ()
    if callable(value) and not isinstance(value, StoppingCriteriaList):
        value = (value,)
    try:
        items = tuple(value)
    except TypeError:
        raise ValueError(f"`{name}` must be a callable or a sequence of callables, got "
                         f"{value!r}") from None
    items = tuple(c for item in items for c in flatten_criteria(item))
    for item in items:
        if _transformers_object(item):
            raise ValueError(f"`{name}`: {item!r} is a transformers object; generate runs it "
                             f"on the host (jaxgen.drivers.host_hooks), a loop built by hand "
                             f"needs {TRACEABLE_HOOKS}")
        if isinstance(item, MaxTimeCriteria):
            raise ValueError(f"`{name}`: MaxTimeCriteria reads the host clock and cannot run "
                             f"inside the compiled loop; pass GenerationConfig(max_time="
                             f"{item.max_time}) instead (the chunked driver enforces it)")
        if not callable(item):
            raise ValueError(f"`{name}` must hold callables, got {item!r}")
        try:
            hash(item)
        except TypeError:
            raise ValueError(f"`{name}` entries must be hashable (they are static for the "
                             f"jit), got {item!r}") from None
    return items


def make_extensions(logits_processor=(), stopping_criteria=()) -> Extensions:
    """Validates and freezes the user hooks."""
    return Extensions(logits_processor=_as_tuple("logits_processor", logits_processor),
                      stopping_criteria=_as_tuple("stopping_criteria", stopping_criteria))


def resolve_custom_generate(custom_generate) -> Callable[..., Any] | None:
    """A callable, or "pkg.module:function" / "pkg.module" (exposing `generate`)."""
    if custom_generate is None or callable(custom_generate):
        return custom_generate
    if not isinstance(custom_generate, str) or not custom_generate:
        raise ValueError(f"`custom_generate` must be a callable or a 'pkg.module[:function]' "
                         f"string, got {custom_generate!r}")
    if "/" in custom_generate and ":" not in custom_generate:
        raise ValueError(f"`custom_generate`={custom_generate!r} looks like a Hugging Face Hub "
                         f"repository: jaxgen never downloads or runs remote code, so Hub "
                         f"repositories are not fetched. Pass a local module as "
                         f"'pkg.module:function' (or 'pkg.module' exposing `generate`), or the "
                         f"callable itself")
    module_name, _, attr = custom_generate.partition(":")
    attr = attr or "generate"
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"`custom_generate`={custom_generate!r}: cannot import "
                         f"{module_name!r} ({error})") from None
    function = getattr(module, attr, None)
    if not callable(function):
        raise ValueError(f"`custom_generate`={custom_generate!r}: module {module_name!r} has no "
                         f"callable {attr!r}")
    return function


def accepts_hooks(function) -> bool:
    """Whether a custom_generate takes logits_processor= / stopping_criteria= keywords."""
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return True
    return "logits_processor" in parameters and "stopping_criteria" in parameters
