"""Classifier-free guidance's inputs and arithmetic: the unconditional prompts, checked on the
host before anything compiles, and the guided scores.

Hugging Face (transformers 5.x) puts `UnbatchedClassifierFreeGuidanceLogitsProcessor` first in
the processor chain when `guidance_scale` is set and != 1. Its unconditional sequence is
`negative_prompt_ids` (with `negative_prompt_attention_mask`), else each prompt's last token;
every step it runs the model on that sequence plus the tokens generated so far (with its own
cache) and replaces the raw logits by

    g * (log_softmax(cond) - log_softmax(uncond)) + log_softmax(uncond)        g = guidance_scale

which every later processor (penalties, warpers, ...) then sees. jaxgen decodes the
unconditional rows inside the same compiled loop (jaxgen.loops.guidance.GuidedLoop).

Example:
    >>> import jax.numpy as jnp
    >>> cond = jnp.log(jnp.array([[0.5, 0.25, 0.25]]))
    >>> uncond = jnp.log(jnp.array([[0.25, 0.25, 0.5]]))
    >>> jnp.exp(guided_log_probs(cond, uncond, 1.0)).round(3).tolist()  # g = 1: the prompt alone
    [[0.5, 0.25, 0.25]]
    >>> guided_log_probs(cond, uncond, 2.0).argmax(-1).tolist()
    [0]
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.config.generation import GenerationConfig
from jaxgen.core.state import prompt_bucket
from jaxgen.logits.warpers import per_row

NEGATIVE_ARGS = "negative_prompt_ids / negative_prompt_attention_mask"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GuidanceInputs:
    """The unconditional prompts, a loop input (dynamic: new prompts of one bucket never
    recompile). Both None: each row's unconditional prompt is its prompt's last token.

    tokens  int32 [B, P]  right-padded with the pad id, P = prompt_bucket(longest)
    length  int32 [B]     tokens per row (>= 1)
    """

    tokens: jax.Array | None = None
    length: jax.Array | None = None


def guidance_on(cfg: GenerationConfig) -> bool:
    """Whether `cfg` asks for classifier-free guidance (guidance_scale set and not all 1)."""
    return "guidance_scale" in cfg.active_dynamic()


def guided_log_probs(cond: jax.Array, uncond: jax.Array, scale) -> jax.Array:
    """HF's guided scores from raw logits cond / uncond [B, V] and a scale (one or [B]):
    scale * (log_softmax(cond) - log_softmax(uncond)) + log_softmax(uncond), float32 [B, V]."""
    cond = jax.nn.log_softmax(cond.astype(jnp.float32), axis=-1)  # [B, V]
    uncond = jax.nn.log_softmax(uncond.astype(jnp.float32), axis=-1)  # [B, V]
    return per_row(scale, cond.shape[0]) * (cond - uncond) + uncond  # [B, V]


# ------------------------------------------------------------------------- host checks
def check_guidance_mode(cfg: GenerationConfig, *, assisted: bool, custom: bool) -> None:
    """ValueError naming the combination when guidance cannot run with the chosen mode."""
    what = f"guidance_scale={cfg.guidance_scale!r} (classifier-free guidance)"
    if assisted:
        raise ValueError(f"{what} is not supported with assisted decoding (assistant_model / "
                         f"prompt_lookup_num_tokens / assistant_early_exit): the "
                         f"unconditional rows would need drafts and verification of their "
                         f"own; use greedy or sampling without an assistant")
    if custom:
        raise ValueError(f"{what} cannot be combined with custom_generate (it owns the loop, "
                         f"which would drop the unconditional rows)")
    if cfg.num_beams > 1:
        raise ValueError(f"{what} is not supported with beam search (num_beams="
                         f"{cfg.num_beams}); use greedy or sampling (allowed: num_beams=1)")
    if cfg.cache_implementation == "dynamic":
        raise ValueError(f"{what} is not supported with cache_implementation='dynamic' (the "
                         f"growing cache sizes itself for the conditional rows only); use "
                         f"'static'")


def negative_rows(negative_prompt_ids, negative_prompt_attention_mask=None) -> list[list[int]]:
    """The unconditional prompts as token-id lists: a list of id lists (ragged), one id
    list, or a [B, S] array (numpy, jax, torch) with an optional 0/1 attention mask of the
    same shape, padded on the left as Hugging Face reads it (each row's last column is a
    token: HF takes the unconditional logits there).

    >>> negative_rows([[5, 6], [7]])
    [[5, 6], [7]]
    >>> negative_rows(np.array([[0, 5, 6], [7, 8, 9]]), np.array([[0, 1, 1], [1, 1, 1]]))
    [[5, 6], [7, 8, 9]]
    """
    ids, mask = negative_prompt_ids, negative_prompt_attention_mask
    if mask is not None and ids is None:
        raise ValueError("negative_prompt_attention_mask needs negative_prompt_ids")
    if isinstance(ids, (list, tuple)) and ids and all(_is_int(t) for t in ids):
        ids = [list(ids)]
    if isinstance(ids, (list, tuple)) and ids and all(isinstance(r, (list, tuple)) for r in ids):
        if mask is not None:
            raise ValueError("negative_prompt_attention_mask goes with a padded [B, S] array of "
                             "negative_prompt_ids; for ragged lists of ids leave it out")
        rows = [list(r) for r in ids]
    else:
        array = _as_array(ids, "negative_prompt_ids")
        if array.ndim == 1:
            array = array[None]
        if array.ndim != 2 or array.shape[1] == 0:
            raise ValueError(f"negative_prompt_ids must be a [B, S] array of token ids (or a "
                             f"list of id lists), got shape {array.shape}")
        if array.dtype.kind not in "iu":
            raise ValueError(f"negative_prompt_ids must hold int token ids, got {array.dtype}")
        if mask is None:
            rows = array.tolist()
        else:
            rows = _masked_rows(array, _as_array(mask, "negative_prompt_attention_mask"))
    for b, row in enumerate(rows):
        if not row:
            raise ValueError(f"negative prompt {b} is empty: every negative prompt needs at "
                             f"least one token")
        if not all(_is_int(t) for t in row):
            raise ValueError(f"negative prompt {b} holds {row!r}; token ids must be ints")
    return [[int(t) for t in row] for row in rows]


def guidance_request(state, cfg: GenerationConfig, negative_prompt_ids=None,
                     negative_prompt_attention_mask=None, *, assisted: bool = False,
                     custom: bool = False) -> GuidanceInputs | None:
    """The guided loop's inputs for one call (None when guidance is off), after every check:
    the mode, the negative prompts' shape, batch, ids and fit in the state's buffer."""
    given = negative_prompt_ids is not None or negative_prompt_attention_mask is not None
    if not guidance_on(cfg):
        if given:
            raise ValueError(f"{NEGATIVE_ARGS} only apply with classifier-free guidance: set "
                             f"guidance_scale to a value other than 1 (got "
                             f"{cfg.guidance_scale!r})")
        return None
    check_guidance_mode(cfg, assisted=assisted, custom=custom)
    if not given:
        return GuidanceInputs()
    rows = negative_rows(negative_prompt_ids, negative_prompt_attention_mask)
    rows = _rows_per_state_row(rows, state.batch, cfg.sample_copies)
    vocab = state.model.vocab_size
    for b, row in enumerate(rows):
        bad = [t for t in row if t < 0 or t >= vocab]
        if bad:
            raise ValueError(f"negative prompt {b} holds token id {bad[0]}, outside the "
                             f"vocabulary (allowed: 0..{vocab - 1})")
    lengths = np.array([len(r) for r in rows], np.int32)  # [B]
    width = prompt_bucket(int(lengths.max()))
    _check_fits(state, cfg, lengths, width)
    tokens = np.full((len(rows), width), state.pad_token_id, np.int32)  # [B, P]
    for b, row in enumerate(rows):
        tokens[b, :len(row)] = row
    return GuidanceInputs(tokens=jnp.asarray(tokens), length=jnp.asarray(lengths))


def guidance_buffer_len(state, cfg: GenerationConfig, negative_prompt_ids,
                        negative_prompt_attention_mask=None) -> int | None:
    """A buffer length that holds the negative prompts and the budget when `state`'s does
    not (generate_ids then rebuilds the state with it), else None."""
    if not guidance_on(cfg) or negative_prompt_ids is None or cfg.max_cache_len is not None:
        return None
    rows = negative_rows(negative_prompt_ids, negative_prompt_attention_mask)
    longest = max(len(r) for r in rows)
    visible = state.visible_len or state.buffer_len  # the budget asked for, not its bucket
    budget = visible - state.prompt_bucket
    needed = max(prompt_bucket(longest), longest + budget, state.prompt_bucket + budget)
    return needed if needed > visible else None


# ------------------------------------------------------------------------- helpers
def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _as_array(value: Any, name: str) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor
        value = value.detach().cpu().numpy()
    try:
        return np.asarray(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a [B, S] array of ints (or a list of id lists), got "
                         f"{type(value).__name__}") from None


def _masked_rows(array: np.ndarray, mask: np.ndarray) -> list[list[int]]:
    if mask.shape != array.shape:
        raise ValueError(f"negative_prompt_attention_mask has shape {mask.shape} but "
                         f"negative_prompt_ids has {array.shape}: they must match")
    if mask.dtype.kind not in "biu" or not np.isin(mask, (0, 1)).all():
        raise ValueError("negative_prompt_attention_mask must hold only 0 (padding) and 1 "
                         "(token)")
    mask = mask.astype(bool)
    for b in range(mask.shape[0]):
        if not mask[b, -1]:
            raise ValueError(f"negative_prompt_attention_mask row {b} ends in padding: pad "
                             f"negative prompts on the left (Hugging Face reads the "
                             f"unconditional logits at the last column)")
    return [array[b][mask[b]].tolist() for b in range(array.shape[0])]


def _rows_per_state_row(rows: list[list[int]], batch: int, copies: int) -> list[list[int]]:
    """One negative prompt per state row: one for every row, one per prompt (repeated to its
    num_return_sequences copies), or one per row."""
    prompts = batch // copies
    if len(rows) == 1:
        return rows * batch
    if len(rows) == prompts:
        return [row for row in rows for _ in range(copies)]
    if len(rows) == batch:
        return rows
    allowed = f"1 or {prompts}" + (f" or {batch}" if batch != prompts else "")
    raise ValueError(f"negative_prompt_ids has {len(rows)} rows but the batch has {prompts} "
                     f"prompt(s) (allowed: {allowed} rows)")


def _check_fits(state, cfg: GenerationConfig, lengths: np.ndarray, width: int) -> None:
    """The unconditional rows decode in a cache as long as the state's buffer."""
    buffer_len = state.buffer_len
    kind = cfg.cache_implementation or "static"
    limit = buffer_len if kind in ("static", "offloaded") else state.prompt_bucket
    if width > limit:
        raise ValueError(f"the negative prompts (longest {int(lengths.max())} tokens, bucket "
                         f"{width}) do not fit: at most {limit} with this state and cache "
                         f"'{kind}'; build the state with a larger buffer_len (init_state(..., "
                         f"buffer_len=)), or use generate_ids / generate_text, which size it")
    max_new = state.max_new
    if isinstance(max_new, jax.core.Tracer):
        return
    need = lengths + np.asarray(max_new)  # [B]
    if (need > buffer_len).any():
        b = int(np.argmax(need))
        raise ValueError(f"negative prompt {b} ({int(lengths[b])} tokens) plus its "
                         f"{int(np.asarray(max_new)[b])} new tokens needs {int(need[b])} "
                         f"positions, more than the state's buffer of {buffer_len}; build "
                         f"the state with init_state(..., buffer_len={int(need.max())}) (or "
                         f"use generate_ids / generate_text, which size it)")


__all__ = ["GuidanceInputs", "check_guidance_mode", "guidance_buffer_len", "guidance_on",
           "guidance_request", "guided_log_probs", "negative_rows"]
