"""The token-tree loop: prefill, then one `lax.while_loop` of tree draft -> tree verify ->
accept-path rounds (`assistant_tree_nodes=N` with a drafter that grows trees).

Per round, for every row b with length L (tokens[b, :L] verified; the target cache holds
positions < L - 1):

    tree      drafter.propose_tree(...): tokens / parent / depth [B, N] (jaxgen.speculative.tree)
    valid     depth <= min(budget left - 1, D), the slot inside the cache, the row live
    verify    target([t_{L-1}, nodes] at slots L-1 .. L-1+N, tree_mask = ancestors, RoPE by
              depth)                                                      one forward
    scores    the processors at every slot, with the row's tokens followed by the slot's
              own path (its prefix), so the scores are exactly plain decoding's
    accept    greedy: the longest path whose every node is the target's argmax at its
              parent, then the target's argmax at its end; sampling: the walk that tests
              each slot's children as point masses against the remaining target mass, then
              a draw from what is left (lossless): out [B, D+1] as a chain
              (jaxgen.speculative.tree)
    K/V       the path's slots moved to L .. L+n (cache.move_slots); the rest rolled back by
              length, as for a chain
    emit      as the chain loop does (jaxgen.speculative.loop.emit_accepted): stops, records

Greedy tokens are plain greedy's; sampled tokens follow the target's distribution exactly,
each row drawing from its own key folded with its length (tags 1: the nodes' acceptance
uniforms, 2: the fix draw, as the chain loop does), so a row's tokens never depend on the
batch. Every round verifies the whole tree (no width buckets, no plain-step fallback, no
draft-length schedule). `SpeculativeStats` counts valid nodes as drafted, the path as
accepted, N + 1 verified positions per round.

Example (tests/test_token_tree.py runs it end to end):
    >>> from jaxgen.speculative.drafters.mtp_tree import MtpTreeDrafter
    >>> loop = TreeLoop(MtpTreeDrafter(model=None, target=None, num_tokens=4, nodes=8, width=2))
    >>> loop.chunkable, loop.drafter.nodes
    (True, 8)
"""
from __future__ import annotations

import dataclasses
import inspect

import jax
import jax.numpy as jnp

from jaxgen.config.generation import GenerationConfig
from jaxgen.core.contracts import DraftRequest
from jaxgen.core.extensions import NO_EXTENSIONS, Extensions
from jaxgen.core.output import StepRecord
from jaxgen.core.speculative_stats import SpeculativeStats
from jaxgen.core.state import DecodeState
from jaxgen.core.step import processor_context
from jaxgen.logits.chain import process_logits
from jaxgen.loops.decode import choose_and_write, prefill_with_record
from jaxgen.speculative import verify
from jaxgen.speculative.loop import (
    AssistInputs,
    SpecCarry,
    SpeculativeLoop,
    _round_keys,
    emit_accepted,
)
from jaxgen.speculative.tree import (
    TokenTree,
    accept_greedy_path,
    accept_sampled_path,
    along_path,
    ancestor_mask,
    path_tokens,
    slot_depths,
)


def _accepts_tree_mask(method) -> bool:
    """Whether a callable takes a `tree_mask` keyword."""
    try:
        return "tree_mask" in inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False


def tree_loop_for(drafter, ext: Extensions, state: DecodeState, cfg: GenerationConfig
                  ) -> "TreeLoop":
    """The loop for `assistant_tree_nodes`, or a ValueError naming what cannot run a tree
    (the drafter, the model, the cache kind, a constraint), before anything compiles."""
    nodes = cfg.assistant_tree_nodes
    make = getattr(drafter, "tree_drafter", None)
    if make is None:
        raise ValueError(f"`assistant_tree_nodes`={nodes} needs an MTP drafter assistant "
                         f"(assistant_model=(MtpDrafterModel, params)) or prompt lookup "
                         f"(prompt_lookup_num_tokens); {type(drafter).__name__} drafts "
                         f"chains only (allowed: assistant_tree_nodes=None)")
    model = state.model
    if not _accepts_tree_mask(model.__call__):
        raise ValueError(f"`assistant_tree_nodes`={nodes}: the model ({type(model).__name__}) "
                         f"does not take a tree_mask in its forward; token trees run on the "
                         f"Llama family (allowed: assistant_tree_nodes=None)")
    if getattr(getattr(model, "config", None), "sliding_window", None) is not None:
        raise ValueError(f"`assistant_tree_nodes`={nodes} does not support sliding-window "
                         f"attention (the model's sliding_window="
                         f"{model.config.sliding_window}); allowed: assistant_tree_nodes=None")
    cache = state.cache
    if not (_accepts_tree_mask(cache.update_attend) and callable(getattr(cache, "move_slots",
                                                                          None))):
        raise ValueError(f"`assistant_tree_nodes`={nodes} needs a dense KV cache "
                         f"(cache_implementation='static'); the {cache.kind!r} cache cannot "
                         f"attend with a tree mask")
    if state.constraint is not None:
        raise ValueError(f"`assistant_tree_nodes`={nodes} cannot be combined with a "
                         f"constraint (regex= / json_schema= / choices= / constraint=); "
                         f"allowed: assistant_tree_nodes=None")
    return TreeLoop(make(nodes, cfg.assistant_tree_width), ext)


def _tree_scores(cfg, raw: jax.Array, state: DecodeState, tree: TokenTree, depth: int,
                 extra=()) -> jax.Array:
    """The processors at every slot s (raw [B, N+1, V]) with the row's tokens followed by
    the slot's path below the root: processed scores [B, N+1, V]."""
    paths = path_tokens(tree, depth)  # [B, N+1, D]
    depths = slot_depths(tree)  # [B, N+1]
    batch, buffer = state.tokens.shape
    rows = jnp.arange(batch)[:, None]
    levels = jnp.arange(depth, dtype=jnp.int32)[None, :]  # [1, D]

    def one(logits, path, deep):  # [B, V], [B, D], [B]
        index = state.length[:, None] + levels  # [B, D]
        tokens = state.tokens.at[rows, jnp.where(levels < deep[:, None], index, buffer)].set(
            path, mode="drop")  # [B, T]
        ctx = processor_context(tokens, state.length + deep, state.prompt_len, state.max_new)
        return process_logits(cfg, logits, ctx, extra=extra)

    return jax.vmap(one, in_axes=(1, 1, 1), out_axes=1)(raw.astype(jnp.float32), paths, depths)


def propose_tree(params, inputs: AssistInputs, state: DecodeState, carry: SpecCarry,
                 cfg: GenerationConfig, drafter, ext: Extensions = NO_EXTENSIONS
                 ) -> SpecCarry:
    """The tree the next round verifies (`carry.pending`), its nodes marked valid only inside
    each live row's budget and the cache."""
    D = drafter.num_tokens
    live = ~state.done  # [B]
    limit = jnp.minimum(state.prompt_len + state.max_new, state.tokens.shape[1])  # [B]
    k_cap = jnp.where(live, jnp.clip(limit - state.length - 1, 0, D), 0)  # [B]
    request = DraftRequest(
        state=state, k_want=k_cap, keys=None, cfg=cfg, ext=ext, do_sample=False,
        keep_q=False, threshold=None, target_params=params, hidden=carry.hidden)
    tree = drafter.propose_tree(inputs.draft_params, request)
    slot = state.length[:, None] + jnp.arange(tree.num_nodes)[None, :]  # [B, N] L-1 + i + 1
    valid = tree.valid & (tree.depth <= k_cap[:, None]) & (slot < state.cache.max_len)
    return dataclasses.replace(carry, pending=dataclasses.replace(tree, valid=valid))


def tree_round(params, inputs: AssistInputs, state: DecodeState, carry: SpecCarry,
               record: StepRecord, cfg: GenerationConfig, drafter,
               ext: Extensions = NO_EXTENSIONS):
    """Verifies `carry.pending` (a TokenTree), emits its accepted path, moves the path's K/V
    into place, rolls back, then grows the next tree. Returns (state, carry, record)."""
    D = drafter.num_tokens
    tree = carry.pending
    live = ~state.done  # [B]
    length = state.length  # [B]
    last = length - 1  # [B]
    root = jnp.take_along_axis(state.tokens, last[:, None], axis=1)  # [B, 1]
    tokens = jnp.concatenate([root, tree.tokens], axis=1)  # [B, N+1]
    slots = last[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]  # [B, N+1]
    forward = state.model(params, tokens, slots, state.cache,
                          tree_mask=ancestor_mask(tree.parent))
    raw = forward.logits.astype(jnp.float32)  # [B, N+1, V]
    scores = _tree_scores(cfg, raw, state, tree, D, ext.logits_processor)  # [B, N+1, V]
    if cfg.do_sample:  # per-row draws: fold_in(row key, L), tags 1 (uniforms) and 2 (fix)
        tag = _round_keys(state)
        uniforms = jax.vmap(lambda key: jax.random.uniform(key, (tree.num_nodes,)))(
            tag(1))  # [B, N]
        n, path, fix = accept_sampled_path(tree, scores, uniforms, tag(2), D)
    else:
        target = jnp.argmax(scores, axis=-1).astype(jnp.int32)  # [B, N+1]
        n, path, fix = accept_greedy_path(tree, target, D)  # [B], [B, D+1], [B]
    drafts = along_path(tokens, path)[:, 1:]  # [B, D] the path's tokens (past n: unused)
    out = verify.assemble(drafts, n, fix, state.pad)  # [B, D+1]
    emitted = emit_accepted(state, record, cfg, ext, out, n, along_path(scores, path),
                            along_path(raw, path))
    new_length = emitted.length  # [B]

    # The path's K/V to slots L-1 .. L-1+D (its root is in place), then roll back by length.
    cache = forward.cache.move_slots(last[:, None] + path,
                                     last[:, None] + jnp.arange(D + 1)[None, :])
    cache = cache.rollback(jnp.where(live, cache.length - (new_length - 1), 0))
    hidden = along_path(forward.hidden, path)  # [B, D+1, Dh]
    picked = jnp.take_along_axis(hidden, emitted.newest[:, :, None], axis=1)[:, 0]  # [B, Dh]
    new_hidden = jnp.where(live[:, None], picked.astype(carry.hidden.dtype), carry.hidden)

    valid = tree.valid & live[:, None]  # [B, N]
    levels = jnp.arange(1, D + 1, dtype=jnp.int32)  # [D]
    tried = jnp.any(valid[:, :, None] & (tree.depth[:, :, None] == levels), axis=1)  # [B, D]
    accepted = jnp.where(live, n, 0)  # [B]
    stats = carry.stats
    stats = dataclasses.replace(
        stats, rounds=stats.rounds + live.astype(jnp.int32),
        drafted=stats.drafted + jnp.sum(valid, axis=1, dtype=jnp.int32),
        accepted=stats.accepted + accepted,
        position_tried=stats.position_tried + tried.astype(jnp.int32),
        position_accepted=stats.position_accepted + (levels[None, :] <= accepted[:, None]
                                                     ).astype(jnp.int32),
        target_forwards=stats.target_forwards + 1,
        verified_positions=stats.verified_positions + tokens.shape[1],
        draft_forwards=stats.draft_forwards + tree.forwards)
    state = state.replace(tokens=emitted.tokens, length=new_length, done=emitted.done,
                          stop_reason=emitted.reason, cache=cache)
    carry = dataclasses.replace(carry, stats=stats, hidden=new_hidden)
    carry = propose_tree(params, inputs, state, carry, cfg, drafter, ext)
    return state, carry, emitted.record


def tree_start(params, state: DecodeState, cfg: GenerationConfig, drafter,
               inputs: AssistInputs, ext: Extensions = NO_EXTENSIONS):
    """Prefill, the first token and the first tree. Returns (state, SpecCarry, StepRecord)."""
    batch, D = state.batch, drafter.num_tokens
    state, record, logits, hidden = prefill_with_record(params, state, cfg, True)  # [B, D]
    state, record = choose_and_write(cfg, state, logits, record, 0, ext)
    start = jnp.full((batch,), D, jnp.int32)
    carry = SpecCarry(draft_state=None, k_sched=start,
                      stats=SpeculativeStats.zeros(batch, D, start), pending=None,
                      hidden=hidden)
    return state, propose_tree(params, inputs, state, carry, cfg, drafter, ext), record


def tree_rounds(params, inputs: AssistInputs, state: DecodeState, carry: SpecCarry,
                record: StepRecord, cfg: GenerationConfig, drafter,
                ext: Extensions = NO_EXTENSIONS, *, start=1, stop=None):
    """Rounds start..stop-1 (fewer once every row is done) in one `lax.while_loop`. Returns
    (next round index, state, SpecCarry, StepRecord)."""
    steps = state.buffer_len - state.prompt_bucket
    stop = steps if stop is None else jnp.minimum(stop, steps)

    def running(loop):
        i, st, _, _ = loop
        return (i < stop) & ~jnp.all(st.done)

    def body(loop):
        i, st, sc, rec = loop
        st, sc, rec = tree_round(params, inputs, st, sc, rec, cfg, drafter, ext)
        return i + 1, st, sc, rec

    return jax.lax.while_loop(running, body, (jnp.asarray(start, jnp.int32), state, carry,
                                              record))


@dataclasses.dataclass(frozen=True)
class TreeLoop(SpeculativeLoop):
    """Token-tree assisted decoding as a loop the plan runs in one call or in chunks (static);
    the carry and output are the speculative loop's."""

    def start(self, params, state: DecodeState, cfg: GenerationConfig, inputs: AssistInputs):
        state, carry, record = tree_start(params, state, cfg, self.drafter, inputs, self.ext)
        return state, (carry, record)

    def advance(self, params, state: DecodeState, extra, begin, end, cfg: GenerationConfig,
                inputs: AssistInputs):
        carry, record = extra
        _, state, carry, record = tree_rounds(params, inputs, state, carry, record, cfg,
                                              self.drafter, self.ext, start=begin, stop=end)
        return state, (carry, record)
