"""Drafting with the checkpoint's own multi-token-prediction layers (`use_mtp=True`; DeepSeek-V3,
GLM-4.5 and other MTP-trained checkpoints). The target model provides them as `MtpLayers`
(`model.mtp_layers()`, jaxgen.models.mtp): D depths, each one decoder block with its own KV
cache, chained from the target's final-normed hidden states and ending in the shared LM head.

Depth k at position q reads the token t_q and the state that predicted it one step earlier
(the target's hidden state at q - 1 for k = 0, depth k-1's output at q - 1 otherwise), and
predicts t_{q+1}. Its cache is indexed by slot = q - k - 1 (the target position its chain
starts from), so a query sees exactly the keys of chains that start no later than its own.

Per round and row (L = the row's new length; the last forward verified positions
s .. L-2, hidden_start = s, and emitted the tokens t_{s+1} .. t_{L-1}):

    depth k   one forward over positions s+1 .. L-1+k (slots s-k .. L-2): the m = L-1-s
              verified positions, then k positions fed with the drafts d_0 .. d_{k-1};
              chained from [depth k-1's output at slot s-k (kept from the last round),
              depth k-1's outputs of this round] (depth 0: the target's hidden states)
    draft k   the head on depth k's output at position L-1+k  -> d_k       (k < D)
    i >= D    num_assistant_tokens > D: the last depth again, autoregressively (as vLLM
              does), chaining from its own output, one position per draft

Rejected drafts need no rollback: every slot a query can see was rewritten in the same round
(each depth's forward starts right after its last verified slot). The verify forward is the
target's plain one; it hands the drafter its hidden states (reads "hidden_states"). After the
prefill the same code runs over the prompt (s = 0). q_k is the processed distribution d_k was
drawn from (drafting.draft_step), so sampling is lossless. Unscheduled: every round drafts
up to K (K = D unless num_assistant_tokens / max_assistant_tokens say otherwise), with no
confidence threshold, as Hugging Face's MTP drafting.

Example (tests/test_mtp.py):
    >>> import jax, jaxgen
    >>> from jaxgen.models import tiny_llama
    >>> from jaxgen.models.mtp import with_mtp
    >>> model, params = with_mtp(*tiny_llama(num_layers=2), jax.random.key(1), depths=2)
    >>> cfg = jaxgen.GenerationConfig(max_new_tokens=6, use_mtp=True)
    >>> drafter, _ = MtpDrafter.from_request(cfg, model, None)
    >>> drafter.num_tokens, sorted(drafter.reads)
    (2, ['hidden_states', 'params'])
    >>> out = jaxgen.generate(params, jaxgen.init_state(model, [[1, 2, 3]], cfg), cfg)
    >>> plain = jaxgen.generate(params, jaxgen.init_state(model, [[1, 2, 3]], cfg),
    ...                         cfg.replace(use_mtp=False))
    >>> bool((out.sequences == plain.sequences).all())
    True
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxgen.cache.sharding import DATA, cache_shardings, check_mesh
from jaxgen.config.generation import HF_DEFAULTS
from jaxgen.core.contracts import DraftRequest
from jaxgen.speculative.drafting import DraftBuffers, draft_step

__all__ = ["MtpDrafter"]


def _at(array: jax.Array, index: jax.Array) -> jax.Array:
    """array [B, S, ...] at index [B] per row -> [B, ...] (index clipped into [0, S))."""
    index = jnp.clip(index, 0, array.shape[1] - 1)[:, None]  # [B, 1]
    index = index.reshape(index.shape + (1,) * (array.ndim - 2))
    return jnp.take_along_axis(array, index, axis=1)[:, 0]


def mtp_layers_of(target_model):
    """The model's MTP layers (its `mtp_layers()`), or a ValueError saying that use_mtp=True
    needs them."""
    getter = getattr(target_model, "mtp_layers", None)
    layers = getter() if callable(getter) else None
    if layers is None:
        config = getattr(target_model, "config", None)
        raise ValueError(f"use_mtp=True needs a model with MTP layers (config.json's "
                         f"num_mtp_layers / num_nextn_predict_layers and their weights at "
                         f"layer indices num_hidden_layers + k); this "
                         f"{type(target_model).__name__} has none (num_mtp_layers="
                         f"{getattr(config, 'num_mtp_layers', 0)})")
    return layers


@dataclasses.dataclass(frozen=True)
class MtpDrafter:
    """Static description of MTP-layer drafting (hashable; a static jit argument)."""

    layers: Any  # the target's MtpLayers (jaxgen.models.mtp)
    num_tokens: int  # K: static draft width
    mesh: Any = None  # the state's mesh: the depths' caches are placed on it (placed_on)
    scheduled: ClassVar[bool] = False  # always up to K drafts; no confidence threshold
    reads: ClassVar[frozenset] = frozenset({"params", "hidden_states"})

    @classmethod
    def from_request(cls, cfg, target_model, assistant):
        """The drafter for `use_mtp=True`, or None. Checks, before compiling, that nothing
        else drafts and that the model has MTP layers."""
        if not cfg.use_mtp:
            return None
        asked = [("`assistant_model`", assistant is not None),
                 ("`prompt_lookup_num_tokens`", cfg.prompt_lookup_num_tokens is not None),
                 ("`assistant_early_exit`", cfg.assistant_early_exit is not None)]
        others = [name for name, on in asked if on]
        if others:
            raise ValueError(f"use_mtp=True drafts with the checkpoint's MTP layers: it cannot "
                             f"be combined with {', '.join(others)}; pass only one way of "
                             f"drafting")
        if cfg.num_beams > 1:
            raise ValueError(f"use_mtp=True (assisted decoding) does not support beam search "
                             f"(num_beams={cfg.num_beams}); use greedy or sampling (allowed: "
                             f"num_beams=1)")
        layers = mtp_layers_of(target_model)
        default = (cfg.max_assistant_tokens is None and cfg.num_assistant_tokens
                   == HF_DEFAULTS["num_assistant_tokens"])
        width = layers.depths if default else cfg.max_assistant_tokens or cfg.num_assistant_tokens
        return cls(layers=layers, num_tokens=int(width)), None

    def placed_on(self, mesh) -> "MtpDrafter":
        """This drafter for a state sharded over `mesh` ("data", "model"): the depths' KV
        caches are laid out as the target's (rows on "data", KV heads on "model") and the
        kept outputs [D, B, H] by rows, instead of wherever the compiler's propagation puts
        them (it kept the heads whole on every device)."""
        return dataclasses.replace(self, mesh=mesh)

    def _placed(self, cache, last):
        if self.mesh is None:
            return cache, last
        cache = jax.lax.with_sharding_constraint(cache, cache_shardings(cache, self.mesh))
        rows = NamedSharding(check_mesh(self.mesh), PartitionSpec(None, DATA, None))
        return cache, jax.lax.with_sharding_constraint(last, rows)  # [D, B, H]

    def init(self, draft_params, state, target_params=None):
        """(the depths' empty KV caches, each depth's output at its last verified slot
        [D, B, H] (zeros))."""
        if not isinstance(target_params, dict) or "mtp" not in target_params:
            raise ValueError("use_mtp=True: the params have no 'mtp' entry (the MTP layers' "
                             "weights); load the checkpoint with jaxgen.models.load, which "
                             "reads them when config.json has num_mtp_layers")
        shape = jax.eval_shape(self.layers.model.embed, target_params, state.tokens[:, :1])
        batch, width = state.tokens.shape
        cache = self.layers.cache(batch, width, shape.dtype)
        last = jnp.zeros((self.layers.depths, batch, shape.shape[-1]), shape.dtype)  # [D, B, H]
        return self._placed(cache, last)

    def rollback(self, draft_state, length):
        """Nothing to undo: stale slots are rewritten before any query can see them."""
        return draft_state

    def propose(self, draft_params, draft_state, request: DraftRequest):
        """Runs every depth over the newly verified positions (keeping the caches right) and
        drafts up to k_want[b] tokens per row. Returns (Proposal, draft_state, the target's
        cache unchanged)."""
        layers, params, state = self.layers, request.target_params, request.state
        K, D = self.num_tokens, layers.depths
        cache, last = draft_state  # last [D, B, H]
        hidden, start = request.hidden_states, request.hidden_start  # [B, W, H], [B]
        width, buffer = hidden.shape[1], state.tokens.shape[1]
        count = state.length - 1 - start  # [B] verified positions m
        request = dataclasses.replace(request, threshold=None)
        buffers = DraftBuffers.empty(request, K, layers.model.vocab_size)

        previous = layers.normed(params, hidden)  # [B, W, H] depth 0 chains from these
        kept, output = [], None
        for k in range(D):
            span = width + k
            j = jnp.arange(span, dtype=jnp.int32)[None, :]  # [1, span]
            positions = start[:, None] + 1 + j  # [B, span]
            slots = start[:, None] - k + j  # [B, span]
            valid = (j < count[:, None] + k) & (slots >= 0)  # [B, span]
            slots = jnp.where(valid, slots, buffer)  # not written
            tokens = jnp.take_along_axis(buffers.tokens, jnp.minimum(positions, buffer - 1),
                                         axis=1)  # [B, span] verified tokens, then drafts
            if k > 0:
                previous = jnp.concatenate([last[k - 1][:, None], output], axis=1)  # [B, span, H]
            output, cache = layers.depth(params, k, tokens, previous, positions, slots, cache)
            kept.append(jnp.where((count >= 1)[:, None], _at(output, count - 1), last[k]))
            if k < K:  # draft k: depth k at position L-1+k
                logits = layers.logits(params, _at(output, count - 1 + k)[:, None])[:, 0]
                buffers = draft_step(request, buffers, k, logits)  # [B, V] -> d_k
        newest = _at(output, count - 1 + D - 1)  # [B, H] the last depth at position L-2+D

        def cond(carry):
            i, buffers, _, _ = carry
            return (i < K) & jnp.any(buffers.active)

        def body(carry):  # the last depth again, one position per draft
            i, buffers, cache, g = carry
            position = (state.length - 1 + i)[:, None]  # [B, 1]
            token = jnp.take_along_axis(buffers.tokens, jnp.minimum(position, buffer - 1),
                                        axis=1)  # [B, 1] d_{i-1}
            g, cache = layers.depth(params, D - 1, token, g[:, None], position, position - D,
                                    cache)  # [B, 1, H]
            logits = layers.logits(params, g)[:, 0]  # [B, V]
            return i + 1, draft_step(request, buffers, i, logits), cache, g[:, 0]

        if K > D:
            steps, buffers, cache, _ = jax.lax.while_loop(
                cond, body, (jnp.int32(D), buffers, cache, newest))
        else:
            steps = jnp.int32(D)
        draft_state = self._placed(cache, jnp.stack(kept))  # [D, B, H]
        return buffers.proposal(steps), draft_state, state.cache
