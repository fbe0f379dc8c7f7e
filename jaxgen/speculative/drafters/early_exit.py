"""Self-speculative early exit (`assistant_early_exit=E`) with a shared cache and shared
compute, LayerSkip-style.

The draft is the target's own first E layers, exited through layer E's exit adapter (when the
params carry one, jaxgen.models' `exit_adapters`) and the shared final norm + LM head. Unlike
Hugging Face (which keeps a separate cache for the draft), nothing is duplicated:

  * shared cache: drafting writes layers [0, E) of the target's own cache at the draft
    positions; once verified, the accepted positions' early-layer entries are already there;
  * shared compute: drafting keeps layer E's hidden state of every position it fed, and the
    verify forward runs only layers [E, L) on them.

Per round and row (L = the row's length; tokens[L-1] is not in the cache yet):

    step i = 0 .. k      feed t_i (t_0 = tokens[L-1], t_i = d_{i-1}) at position L-1+i through
                         layers [0, E) -> h_i (kept);  i < k: d_i from exit_head(h_i)
    verify               layers [E, L) on h_0 .. h_k at positions L-1 .. L-1+k -> logits

so a round of k drafts costs (k+1) E + (k+1)(L-E) = (k+1) L layer-positions plus k exit heads:
exactly one plain verify forward, the drafting included. With a separate draft cache (HF) the
same round costs k E for drafting plus (k+1) L for verification.

Every draft of E = num_layers is the target's own greedy token: all are accepted.

Example:
    >>> import jaxgen
    >>> from jaxgen.models import tiny_llama
    >>> model, params = tiny_llama(num_layers=2)
    >>> cfg = jaxgen.GenerationConfig(max_new_tokens=8, assistant_early_exit=2)
    >>> out = jaxgen.generate(params, jaxgen.init_state(model, [[1, 2, 3]], cfg), cfg)
    >>> int(out.speculative.accepted[0]) == int(out.speculative.drafted[0]) > 0
    True
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp

from jaxgen.core.contracts import DraftRequest
from jaxgen.speculative.drafting import DraftBuffers, draft_step

LAYERED = ("embed", "run_layers", "exit_head", "head")


class EarlyExitOutput(NamedTuple):
    """(logits, hidden, cache) of the shared-compute verify forward."""

    logits: jax.Array
    hidden: jax.Array
    cache: Any


@dataclasses.dataclass(frozen=True)
class EarlyExitDrafter:
    """Static description of the early-exit drafter (hashable; a static jit argument)."""

    model: Any  # the target (jaxgen.core.contracts.LayeredModel)
    exit_layer: int  # E
    num_tokens: int  # K: static draft width
    scheduled: ClassVar[bool] = True  # as a draft model: the schedule and threshold apply
    reads: ClassVar[frozenset] = frozenset({"params", "cache"})

    @classmethod
    def from_request(cls, cfg, target_model, assistant):
        """The drafter for `cfg.assistant_early_exit`, or None when it is unset."""
        exit_layer = cfg.assistant_early_exit
        if exit_layer is None:
            return None
        missing = [name for name in LAYERED if not callable(getattr(target_model, name, None))]
        if missing:
            raise ValueError(f"assistant_early_exit needs a model that runs its layers in "
                             f"ranges (jaxgen.core.contracts.LayeredModel); "
                             f"{type(target_model).__name__} has no {', '.join(missing)}")
        layers = int(target_model.config.num_layers)
        if not 1 <= int(exit_layer) <= layers:
            raise ValueError(f"assistant_early_exit={exit_layer} must be in [1, "
                             f"num_hidden_layers={layers}]")
        width = cfg.max_assistant_tokens or cfg.num_assistant_tokens
        return cls(model=target_model, exit_layer=int(exit_layer), num_tokens=int(width)), None

    def init(self, draft_params, state, target_params=None):
        """Layer E's hidden state of the positions a round feeds: [B, K+1, D] (empty)."""
        shape = jax.eval_shape(self.model.embed, target_params, state.tokens[:, :1])
        return jnp.zeros((state.batch, self.num_tokens + 1, shape.shape[-1]), shape.dtype)

    def rollback(self, hidden, length):
        return hidden

    def propose(self, draft_params, hidden, request: DraftRequest):
        """Drafts through layers [0, E) in the target's cache; keeps layer E's states."""
        model, params, state = self.model, request.target_params, request.state
        K, E = self.num_tokens, self.exit_layer
        tokens, length = state.tokens, state.length  # [B, T], [B]
        last = jnp.take_along_axis(tokens, (length - 1)[:, None], axis=1)[:, 0]  # [B]
        buffers = DraftBuffers.empty(request, K, model.vocab_size)
        vocab = model.vocab_size

        def cond(carry):
            i, buffers, _, _ = carry
            fed_all = i > jnp.max(buffers.k_row)  # every drafted token went through [0, E)
            return (i <= K) & (jnp.any(buffers.active) | ~fed_all)

        def body(carry):
            i, buffers, cache, hidden = carry
            previous = buffers.drafts[:, jnp.maximum(i - 1, 0)]  # [B]
            token = jnp.where(i == 0, last, previous)[:, None]  # [B, 1]
            position = (length - 1 + i)[:, None]  # [B, 1]
            h, cache = model.run_layers(params, model.embed(params, token), position, cache,
                                        0, E)  # [B, 1, D]
            hidden = hidden.at[:, i].set(h[:, 0].astype(hidden.dtype))
            logits = jax.lax.cond(i < K, lambda: model.exit_head(params, h, E)[:, 0],
                                  lambda: jnp.zeros((h.shape[0], vocab), jnp.float32))
            return i + 1, draft_step(request, buffers, i, logits), cache, hidden

        carry = (jnp.int32(0), buffers, state.cache, hidden)
        steps, buffers, cache, hidden = jax.lax.while_loop(cond, body, carry)
        # the target's cache: layers [0, E) written at the fed positions, length unchanged
        return buffers.proposal(steps), hidden, cache.with_length(state.cache.length)

    def verify(self, params, hidden, state, tokens, positions):
        """The verify forward over [tokens[L-1], drafts] (tokens [B, k+1]) reusing layer E's
        states: layers [E, L) only. Returns (logits [B, k+1, V], hidden, cache)."""
        model = self.model
        h = hidden[:, :tokens.shape[1]]  # [B, k+1, D]
        h, cache = model.run_layers(params, h, positions, state.cache, self.exit_layer,
                                    int(model.config.num_layers))
        logits = model.head(params, h)  # [B, k+1, V]
        return EarlyExitOutput(logits, h, cache.with_length(positions[:, -1] + 1))

