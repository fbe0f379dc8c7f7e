"""Acceptance statistics of one assisted call (`GenerateOutput.speculative`).

Example:
    >>> import jax.numpy as jnp
    >>> stats = SpeculativeStats.zeros(2, 4, jnp.array([4, 4]))
    >>> stats.tokens_per_round.tolist()      # no rounds yet
    [0.0, 0.0]
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpeculativeStats:
    """Acceptance statistics of one speculative call (`GenerateOutput.speculative`).

    rounds             int32 [B]     verify rounds the row took part in while live
    drafted            int32 [B]     drafts proposed to the row (sum of k_row)
    accepted           int32 [B]     drafts accepted (sum of n)
    position_tried     int32 [B, K]  rounds in which draft position i was proposed
    position_accepted  int32 [B, K]  rounds in which draft position i was accepted
    target_forwards    int32 []      target forwards: prefill + verify rounds
    verified_positions int32 []      positions the verify forwards computed per row (each round
                                     k + 1 for its width bucket k): the compute spent
    draft_forwards     int32 []      draft-model forwards (prefill included; 0 for prompt lookup)
    num_assistant_tokens int32 [B]   the draft length the next call should start from
                                     (changed only by the "heuristic" schedule, as in HF)
    plain_steps        int32 [B]     rounds in which the row could have drafted but took a
                                     plain one-token step: its drafts did not pay
                                     (`assistant_fallback`, jaxgen.speculative.fallback)
    """

    rounds: jax.Array
    drafted: jax.Array
    accepted: jax.Array
    position_tried: jax.Array
    position_accepted: jax.Array
    target_forwards: jax.Array
    verified_positions: jax.Array
    draft_forwards: jax.Array
    num_assistant_tokens: jax.Array
    plain_steps: jax.Array = None

    @classmethod
    def zeros(cls, batch: int, K: int, start: jax.Array) -> "SpeculativeStats":
        z = jnp.zeros((batch,), jnp.int32)
        return cls(rounds=z, drafted=z, accepted=z,
                   position_tried=jnp.zeros((batch, K), jnp.int32),
                   position_accepted=jnp.zeros((batch, K), jnp.int32),
                   target_forwards=jnp.int32(1), verified_positions=jnp.int32(0),
                   draft_forwards=jnp.int32(0),
                   num_assistant_tokens=start, plain_steps=z)

    @property
    def mean_accepted(self) -> jax.Array:
        """float32 [B]: accepted drafts per verify round."""
        return self.accepted / jnp.maximum(self.rounds, 1)

    @property
    def tokens_per_round(self) -> jax.Array:
        """float32 [B]: tokens emitted per verify round (accepted + the fix / bonus token)."""
        return (self.accepted + self.rounds) / jnp.maximum(self.rounds, 1)

    @property
    def acceptance_rate(self) -> jax.Array:
        """float32 [B]: accepted / drafted."""
        return self.accepted / jnp.maximum(self.drafted, 1)

    @property
    def position_acceptance(self) -> jax.Array:
        """float32 [K]: over all rows, P(draft i accepted | draft i proposed)."""
        return (jnp.sum(self.position_accepted, 0)
                / jnp.maximum(jnp.sum(self.position_tried, 0), 1))
