"""Classifier-free guidance as a loop: the unconditional rows decode inside the same compiled
`while_loop` as the prompts (Hugging Face's UnbatchedClassifierFreeGuidanceLogitsProcessor,
see jaxgen.loops.guidance_inputs for its semantics).

Row b's unconditional sequence is its negative prompt (or its prompt's last token) followed by
the tokens row b generates: it advances in lock step with the row, so its length is
`neg_len + (length - prompt_len)` and the token it is fed is the row's newest token. Nothing
but its cache needs carrying. Two layouts (static, `GuidedLoop.stacked`):

    stacked   one cache of [2B] rows (rows B.. unconditional), concatenated once after the
              two prefills: each step is one model call over [2B, 1], so the weights are
              read once per step for both halves (the default; benchmarks/bench_guidance.py)
    separate  the prompts' cache and a second [B] cache: two model calls per step

During the loop `state.cache` holds the stacked cache (or the pair); `output` puts the
prompts' rows back, so the final state looks like any other. The guided scores replace the
raw logits as the input of the processor chain (HF runs the guidance processor first);
`output_logits` still records the prompts' raw logits.

Example:
    >>> import jax, jaxgen
    >>> from jaxgen.models import tiny_llama
    >>> model, params = tiny_llama()
    >>> cfg = jaxgen.GenerationConfig(max_new_tokens=3, guidance_scale=1.5)
    >>> state = jaxgen.init_state(model, [[1, 2, 3], [4, 5]], cfg)
    >>> out = GuidedLoop().run(params, state, cfg)
    >>> out.lengths.tolist(), out.state.cache.batch
    ([6, 5], 2)
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxgen.config.generation import GenerationConfig
from jaxgen.core.output import GenerateOutput, StepRecord
from jaxgen.core.state import DecodeState
from jaxgen.core.step import forward_last, prefill_tokens
from jaxgen.loops.beam import cache_batch_axes
from jaxgen.loops.decode import DecodeLoop, choose_and_write, prefill_with_record
from jaxgen.loops.guidance_inputs import GuidanceInputs, guided_log_probs


def _map_rows(fn, axes: tuple, *caches):
    """fn(leaves..., axis) over the leaves of caches with a row axis (others from caches[0])."""
    flat = [jax.tree_util.tree_flatten(c) for c in caches]
    treedef = flat[0][1]
    out = [leaves[0] if ax is None else fn(*leaves, ax)
           for *leaves, ax in zip(*[f[0] for f in flat], axes)]
    return jax.tree_util.tree_unflatten(treedef, out)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GuidedCache:
    """`state.cache` while a guided loop runs: the stacked [2B] cache (prompts' rows first),
    or the prompts' [B] cache and the unconditional rows' [B] cache (`uncond`)."""

    cache: Any
    uncond: Any = None
    axes: tuple = dataclasses.field(default=(), metadata=dict(static=True))  # row axis per leaf

    def prompt_rows(self, batch: int):
        """The prompts' [B]-row cache."""
        if self.uncond is not None:
            return self.cache
        return _map_rows(lambda a, ax: jax.lax.slice_in_dim(a, 0, batch, axis=ax), self.axes,
                         self.cache)


def unconditional_prompts(state: DecodeState, inputs: GuidanceInputs | None):
    """(tokens [B, P], length [B]) of the unconditional rows: the negative prompts, or each
    prompt's last token (HF's default, input_ids[:, -1:])."""
    if inputs is not None and inputs.tokens is not None:
        return inputs.tokens, inputs.length
    last = jnp.take_along_axis(state.tokens, (state.prompt_len - 1)[:, None], axis=1)  # [B, 1]
    return last, jnp.ones_like(state.prompt_len)


def unconditional_length(state: DecodeState, neg_len: jax.Array) -> jax.Array:
    """int32 [B]: the unconditional rows advance with the prompts' rows."""
    return neg_len + (state.length - state.prompt_len)


@dataclasses.dataclass(frozen=True)
class GuidedLoop(DecodeLoop):
    """Greedy / sampling with classifier-free guidance (static; chunkable like DecodeLoop).

    inputs: jaxgen.loops.guidance_inputs.GuidanceInputs (None or empty: prompts' last tokens).
    """

    stacked: bool = True
    takes_layer_tuples = False  # its GuidedCache concatenates two caches along the rows

    def decode_rows(self, state: DecodeState, cfg: GenerationConfig) -> int | None:
        """Unknown to the backend: the forwards run the prompts' and the negatives' rows."""
        return None

    # ------------------------------------------------------------------ prefill
    def start(self, params, state: DecodeState, cfg: GenerationConfig, inputs=None):
        model = state.model
        neg_tokens, neg_len = unconditional_prompts(state, inputs)  # [B, Pn], [B]
        chunk = cfg.prefill_chunk_size
        empty = state.cache  # the unconditional rows start from the same empty cache
        state, record, cond = prefill_with_record(params, state, cfg)  # cond [B, V]
        ucache, uncond = prefill_tokens(model, params, neg_tokens, neg_len, empty, chunk)
        if self.stacked:  # one copy of the cache, then one model call per step
            axes = cache_batch_axes(model, cfg, state.buffer_len, state.prompt_bucket)
            stacked = _map_rows(lambda a, b, ax: jnp.concatenate([a, b], axis=ax), axes,
                                state.cache, ucache)  # [2B] rows
            state = state.replace(cache=GuidedCache(stacked, axes=axes))
        else:
            state = state.replace(cache=GuidedCache(state.cache, ucache))
        guided = guided_log_probs(cond, uncond, cfg.guidance_scale)  # [B, V]
        return choose_and_write(cfg, state, cond, record, 0, self.ext, guided=guided)

    # ------------------------------------------------------------------ one step
    def forward(self, params, state: DecodeState, neg_len: jax.Array):
        """(cond logits [B, V], uncond logits [B, V], state with its caches advanced)."""
        model, batch = state.model, state.batch
        ulen = unconditional_length(state, neg_len)  # [B]
        if self.stacked:
            position = jnp.maximum(state.length - 1, 0)  # [B]
            last = jnp.take_along_axis(state.tokens, position[:, None], axis=1)  # [B, 1]
            tokens = jnp.concatenate([last, last])  # [2B, 1]
            positions = jnp.concatenate([position, ulen - 1])[:, None]  # [2B, 1]
            out = model(params, tokens, positions, state.cache.cache)
            logits = out.logits[:, -1].astype(jnp.float32)  # [2B, V]
            cache = out.cache.with_length(jnp.concatenate([state.length, ulen]))
            return (logits[:batch], logits[batch:],
                    state.replace(cache=dataclasses.replace(state.cache, cache=cache)))
        cond_cache, ucache = state.cache.cache, state.cache.uncond
        cond, cond_cache = forward_last(model, params, state.tokens, state.length, cond_cache)
        last = jnp.take_along_axis(state.tokens, jnp.maximum(state.length - 1, 0)[:, None],
                                   axis=1)  # [B, 1]
        out = model(params, last, (ulen - 1)[:, None], ucache)
        uncond = out.logits[:, -1].astype(jnp.float32)  # [B, V]
        return cond, uncond, state.replace(cache=GuidedCache(cond_cache,
                                                              out.cache.with_length(ulen)))

    def advance(self, params, state: DecodeState, record: StepRecord, begin, end,
                cfg: GenerationConfig, inputs=None):
        _, neg_len = unconditional_prompts(state, inputs)

        def cond_fn(carry):
            step, st, _ = carry
            return (step < end) & ~jnp.all(st.done)

        def body(carry):
            step, st, rec = carry
            cond, uncond, st = self.forward(params, st, neg_len)
            guided = guided_log_probs(cond, uncond, cfg.guidance_scale)  # [B, V]
            st, rec = choose_and_write(cfg, st, cond, rec, step, self.ext, guided=guided)
            return step + 1, st, rec

        _, state, record = jax.lax.while_loop(
            cond_fn, body, (jnp.asarray(begin, jnp.int32), state, record))
        return state, record

    # ------------------------------------------------------------------ whole call
    def output(self, state: DecodeState, record: StepRecord) -> GenerateOutput:
        """The output, with the final state's cache holding the prompts' rows only."""
        cache = state.cache.prompt_rows(state.batch)
        return GenerateOutput.from_state(state.replace(cache=cache), record)


__all__ = ["GuidedCache", "GuidedLoop", "unconditional_length", "unconditional_prompts"]
