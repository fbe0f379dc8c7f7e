"""Hugging Face's `LogitsProcessor` / `StoppingCriteria` objects (and their lists), run on
the host once per step.

A transformers processor is torch code: it cannot be traced into the compiled loop. It runs
where Hugging Face runs it instead, as a host call from inside the compiled step
(`jax.experimental.io_callback`): after jaxgen's built-in processors, before the sampling
warpers (HF's merge point for a custom `logits_processor` list), on the scores of *this* step.
Those scores exist only after the step's forward, inside the program, so a hook between
compiled calls could not see them without a second program per step; the callback keeps one
program for every step (no recompilation) and costs one host round trip per step.

What a processor receives, each step (torch tensors, on the CPU):
    input_ids  LongTensor [B, L]: the rows as Hugging Face holds them: each row's prompt
               padded on the *left* with pad_token_id to the longest prompt, then the
               generated tokens; a finished row continues with pad_token_id (HF writes pad
               there), so L = longest prompt + steps so far. No attention mask is passed
               (HF's processors do not take one).
    scores     FloatTensor [B, V]: the scores after jaxgen's built-in processors.
It returns the new scores [B, V], which replace the step's scores. A stopping criterion is
called after the token is written, with the same `input_ids` (the new token included) and the
processed scores, and gets `scores` only when its `__call__` accepts it; a True row stops with
stop reason `custom`.

Supported with greedy and sampling (jaxgen.loops.decode), in any driver (streamers included);
refused, with the alternative named, under `jax.jit` / `jax.vmap` around generate, with beam
search, assisted decoding and custom_generate. The traceable contract (jaxgen.core.extensions:
`(scores, ctx) -> scores`, `(ctx, scores) -> bool [B]`) runs everywhere on the device.

Example (the layout processors see; tokens after `length` are ignored):
    >>> import numpy as np
    >>> hf_input_ids(np.array([[5, 6, 9, 0], [7, 8, 1, 2]]), np.array([3, 4]),
    ...              np.array([2, 1]), pad=0).tolist()
    [[5, 6, 9, 0, 0], [0, 7, 8, 1, 2]]
"""
from __future__ import annotations

import importlib.util
import inspect
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from jaxgen.core.extensions import TRACEABLE_HOOKS
from jaxgen.loops.decode import DecodeLoop
from jaxgen.stopping.criteria import call_criterion

PROCESSOR_CLASSES = ("LogitsProcessor", "LogitsProcessorList")
CRITERIA_CLASSES = ("StoppingCriteria", "StoppingCriteriaList")
ROUND_TRIP_NOTE = ("jaxgen: transformers LogitsProcessor / StoppingCriteria objects run on the "
                   "host: one host round trip per generated token (a traceable (scores, ctx) "
                   "-> scores callable stays on the device)")


def transformers_kind(obj) -> str | None:
    """The transformers base class `obj` is an instance of (e.g. "LogitsProcessor", also for a
    user's subclass), or None for anything that is not a transformers hook. Duck-typed: no
    transformers import."""
    for cls in type(obj).__mro__:
        if (cls.__module__ or "").startswith("transformers") and \
                cls.__name__ in PROCESSOR_CLASSES + CRITERIA_CLASSES:
            return cls.__name__
    return None


def torch_available() -> bool:
    return importlib.util.find_spec("torch") is not None


def hf_input_ids(tokens: np.ndarray, length: np.ndarray, prompt_len: np.ndarray,
                 pad: int) -> np.ndarray:
    """int64 [B, L]: the rows in Hugging Face's layout (see the module docs). tokens [B, T]
    right-padded per row; length / prompt_len [B]."""
    length, prompt_len = np.asarray(length), np.asarray(prompt_len)
    longest = int(prompt_len.max())
    width = longest + int((length - prompt_len).max())
    ids = np.full((tokens.shape[0], width), pad, np.int64)  # [B, L]
    for b in range(tokens.shape[0]):
        start = longest - int(prompt_len[b])
        ids[b, start:start + int(length[b])] = tokens[b, :int(length[b])]
    return ids


class _HostHook:
    """Shared by the two wrappers: hashable by the identity of the wrapped objects (they stay
    referenced by any compiled program keyed on the wrapper) and the pad id."""

    def __init__(self, items: tuple, pad_token_id: int):
        self.items = tuple(items)
        self.pad_token_id = int(pad_token_id)

    def _key(self):
        return tuple(map(id, self.items)), self.pad_token_id

    def __hash__(self):
        return hash(self._key())

    def __eq__(self, other):
        return type(other) is type(self) and all(
            a is b for a, b in zip(self.items, other.items)) and self._key() == other._key()

    def __repr__(self):
        return f"{type(self).__name__}({list(self.items)!r})"

    def _ids(self, tokens, length, prompt_len):
        import torch
        return torch.from_numpy(hf_input_ids(np.asarray(tokens), length, prompt_len,
                                             self.pad_token_id))


class HostLogitsProcessor(_HostHook):
    """transformers logits processors as a jaxgen processor `(scores, ctx) -> scores`: one
    host call per step applies them in order."""

    def __call__(self, scores: jax.Array, ctx) -> jax.Array:
        shape = jax.ShapeDtypeStruct(scores.shape, jnp.float32)  # [B, V]
        return io_callback(self._host, shape, scores.astype(jnp.float32), ctx.tokens,
                           ctx.length, ctx.prompt_len)

    def _host(self, scores, tokens, length, prompt_len) -> np.ndarray:
        import torch
        input_ids = self._ids(tokens, length, prompt_len)  # [B, L]
        out = torch.from_numpy(np.array(scores, np.float32))  # [B, V]
        for processor in self.items:
            out = processor(input_ids, out)
            if not hasattr(out, "shape") or tuple(out.shape) != tuple(scores.shape):
                raise ValueError(f"logits processor {processor!r} must return scores of shape "
                                 f"{tuple(scores.shape)}, got {getattr(out, 'shape', out)!r}")
        return np.asarray(out.detach().to("cpu", torch.float32).numpy(), np.float32)


class HostStoppingCriteria(_HostHook):
    """transformers stopping criteria as a jaxgen criterion `(ctx, scores) -> bool [B]`
    (any of them True stops the row)."""

    def __call__(self, ctx, scores=None) -> jax.Array:
        batch = ctx.length.shape[0]
        if scores is None:
            scores = jnp.zeros((batch, 1), jnp.float32)
        shape = jax.ShapeDtypeStruct((batch,), jnp.bool_)  # [B]
        return io_callback(self._host, shape, ctx.tokens, ctx.length, ctx.prompt_len,
                           scores.astype(jnp.float32))

    def _host(self, tokens, length, prompt_len, scores) -> np.ndarray:
        import torch
        input_ids = self._ids(tokens, length, prompt_len)  # [B, L]
        scores = torch.from_numpy(np.array(scores, np.float32))  # [B, V]
        done = np.zeros(len(length), bool)  # [B]
        for criterion in self.items:
            hit = call_criterion(criterion, input_ids, scores)
            hit = hit.detach().cpu().numpy() if hasattr(hit, "detach") else np.asarray(hit)
            done |= np.broadcast_to(np.asarray(hit, bool), done.shape)
        return done


def _split(name: str, value, kinds: tuple) -> tuple[list, bool]:
    """The hooks of `value` with transformers objects of `kinds` gathered into host wrappers
    (a run of adjacent ones into one); (list of items or wrapper markers, any found)."""
    if value is None:
        return [], False
    kind = transformers_kind(value)
    items = [value] if (kind is not None or callable(value) and not isinstance(
        value, (list, tuple))) else None
    if items is None:
        try:
            items = list(value)
        except TypeError:
            return [value], False
    out, found = [], False
    for item in items:
        kind = transformers_kind(item)
        if kind is None:
            out.append(item)
            continue
        if kind not in kinds:
            raise ValueError(f"`{name}` got a transformers {kind} ({item!r}); pass it as "
                             f"`{'stopping_criteria' if kind in CRITERIA_CLASSES else 'logits_processor'}`")
        entries = list(item) if kind.endswith("List") else [item]
        if not entries:  # an empty list: nothing to run
            continue
        found = True
        for entry in entries:
            if transformers_kind(entry) not in kinds:
                raise ValueError(f"`{name}`: {item!r} holds {entry!r}, which is not a "
                                 f"transformers {kinds[0]}")
        if out and isinstance(out[-1], list):
            out[-1].extend(entries)
        else:
            out.append(entries)
    return out, found


def adopt_transformers_hooks(logits_processor, stopping_criteria, *, pad_token_id: int,
                             traced: bool):
    """(logits_processor, stopping_criteria) with transformers objects wrapped as host hooks;
    everything else passes through unchanged. Raises before anything compiles when they
    cannot run (under a trace, or without torch); warns once per call of their cost."""
    processors, found_p = _split("logits_processor", logits_processor, PROCESSOR_CLASSES)
    criteria, found_c = _split("stopping_criteria", stopping_criteria, CRITERIA_CLASSES)
    if not (found_p or found_c):
        return logits_processor, stopping_criteria
    first = next(group[0] for group in processors + criteria if isinstance(group, list))
    if traced:
        raise ValueError(f"{first!r} is a transformers {transformers_kind(first)}: it runs on "
                         f"the host (torch), once per step, and cannot run under jax.jit / "
                         f"jax.vmap around generate; pass a traceable callable instead "
                         f"({TRACEABLE_HOOKS})")
    if not torch_available():
        raise ValueError(f"{first!r} is a transformers {transformers_kind(first)}, which runs "
                         f"on torch tensors, but torch is not installed: install torch, or pass "
                         f"a traceable callable instead ({TRACEABLE_HOOKS})")
    warnings.warn(ROUND_TRIP_NOTE, UserWarning, stacklevel=3)
    wrap = lambda groups, cls: tuple(  # noqa: E731
        cls(g, pad_token_id) if isinstance(g, list) else g for g in groups)
    return wrap(processors, HostLogitsProcessor), wrap(criteria, HostStoppingCriteria)


def check_host_loop(ext, loop) -> None:
    """Host hooks run with greedy / sampling only (the loop HF's processors were written for:
    one row per sequence, one token a step)."""
    hooks = [h for h in (*ext.logits_processor, *ext.stopping_criteria)
             if isinstance(h, _HostHook)]
    if hooks and type(loop) is not DecodeLoop:
        raise ValueError(f"transformers LogitsProcessor / StoppingCriteria objects ("
                         f"{hooks[0]!r}) run with greedy decoding and sampling only, not with "
                         f"{type(loop).__name__}; pass a traceable callable instead "
                         f"({TRACEABLE_HOOKS})")


__all__ = ["HostLogitsProcessor", "HostStoppingCriteria", "adopt_transformers_hooks",
           "check_host_loop", "hf_input_ids", "transformers_kind"]
