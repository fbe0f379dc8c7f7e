"""The plain-step fallback of assisted decoding: draft only where a measured cost model says it
pays, else take a plain one-token target step (`assistant_fallback`, on by default).

Per row b the loop keeps a running estimate of its per-draft acceptance (dynamic state in the
loop carry, updated after every round in which the row verified drafts):

    hits_b   <- DECAY * hits_b   + n_b                  (accepted drafts)
    trials_b <- DECAY * trials_b + n_b + [n_b < k_b]    (accepted drafts + the rejection)
    alpha_b  = hits_b / trials_b ;  E[accepted | k drafts] = G(alpha, k) = sum_{j=1..k} alpha^j

A round whose verify forward is k + 1 positions wide (k drafts) costs, in one-token target
steps (`assistant_verify_cost` = (fixed, per_draft)),

    c(0) = 1 (a plain step),    c(k) = 1 + fixed + per_draft * k  for k >= 1

(0.5, 0.12) fits SmolLM2-135M on two CPU cores at batch 1 and 8 alike: an 11-wide batch-1
round costs about 2.8 one-token steps and a 5-wide batch-8 round about 2 (a one-position
forward is a matrix-vector product; two positions already pay for a matrix product). A GPU,
where wide forwards are nearly free, wants much smaller numbers.

Each round, before drafting (so a failing draft model stops paying for its forwards):

    worth_b  = max over draft buckets k <= k_want_b of (1 + G(alpha_b, k)) / c(k) > 1
    probe_b  = not worth_b and the row's probe countdown ran out: it drafts PROBE_DRAFTS
               tokens anyway, so a row whose context turned repetitive (prompt lookup) can
               come back. A probe's outcome replaces the row's history (it is folded into
               PRIOR, not into the old estimate); each probe doubles the row's wait (up to
               MAX_BACKOFF x `assistant_probe_interval` rounds) until the row drafts again
    k_want_b = 0 unless worth_b or probe_b

After drafting (greedy only), the batch picks the verify width: the bucket k (0 = a plain
one-token step) that minimises the projected time to finish the batch,

    T(k) = c(k) * max over live rows of remaining_b / (1 + G(alpha_b, min(k_row_b, k)))

(a batch finishes with its slowest row; a probing row counts with the optimistic PRIOR), and
every row's drafts are cut to k. Cutting drafts never changes greedy tokens (verification
emits the target's argmax at every position) and the plain step emits exactly the token
plain greedy would. Under sampling the width choice is skipped, so a row's draws never
depend on the other rows (the rejection sampler stays exact either way: a row without drafts
samples its token from the processed target distribution).

Example:
    >>> import jax.numpy as jnp
    >>> expected_accepted(jnp.array([0.5, 0.0]), jnp.array([2, 3])).tolist()
    [0.75, 0.0]
    >>> [round(float(verify_cost((0.5, 0.12), jnp.int32(k))), 2) for k in (0, 1, 4)]
    [1.0, 1.62, 1.98]
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

DECAY = 0.7  # weight of the past in the acceptance estimate (about three rounds' memory)
PRIOR = (0.8, 1.0)  # (hits, trials) a row starts from: optimistic, so every row drafts first
MAX_BACKOFF = 8  # a row that keeps failing probes waits at most this many probe intervals
PROBE_DRAFTS = 1  # drafts a probing row proposes (a probe costs one narrow round)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FallbackState:
    """Per-row state of the fallback (part of the assisted loop's carry)."""

    hits: jax.Array  # float32 [B] decayed count of accepted drafts
    trials: jax.Array  # float32 [B] decayed count of accepted drafts + rejections
    wait: jax.Array  # int32 [B] rounds left before a row that stopped drafting probes again
    interval: jax.Array  # int32 [B] the row's current probe interval (doubles per failed probe)
    probing: jax.Array  # bool [B] the row probes in the pending round

    @classmethod
    def start(cls, batch: int, interval: int) -> "FallbackState":
        """Every row starts at PRIOR, drafting.

        >>> [round(float(a), 2) for a in FallbackState.start(2, 8).acceptance]
        [0.8, 0.8]
        """
        return cls(hits=jnp.full((batch,), PRIOR[0], jnp.float32),
                   trials=jnp.full((batch,), PRIOR[1], jnp.float32),
                   wait=jnp.full((batch,), interval, jnp.int32),
                   interval=jnp.full((batch,), interval, jnp.int32),
                   probing=jnp.zeros((batch,), bool))

    @property
    def acceptance(self) -> jax.Array:
        """float32 [B]: the estimated probability that a draft is accepted."""
        return self.hits / jnp.maximum(self.trials, 1e-6)

    def observe(self, drafted: jax.Array, accepted: jax.Array) -> "FallbackState":
        """After a round: rows with drafted [B] > 0 fold in their accepted [B] drafts (a
        probing row into PRIOR)."""
        seen = drafted > 0  # [B]
        rejected = (accepted < drafted).astype(jnp.float32)  # [B]
        past_hits = jnp.where(self.probing, PRIOR[0], self.hits)  # [B]
        past_trials = jnp.where(self.probing, PRIOR[1], self.trials)  # [B]
        hits = DECAY * past_hits + accepted.astype(jnp.float32)  # [B]
        trials = DECAY * past_trials + accepted.astype(jnp.float32) + rejected  # [B]
        return dataclasses.replace(self, hits=jnp.where(seen, hits, self.hits),
                                   trials=jnp.where(seen, trials, self.trials))


def expected_accepted(alpha: jax.Array, k: jax.Array) -> jax.Array:
    """float32: sum_{j=1..k} alpha^j, the expected accepted drafts out of k when each draft
    passes with probability alpha given the ones before it passed (alpha, k broadcast)."""
    a = jnp.clip(alpha, 0.0, 0.999)
    return a * (1.0 - a ** k.astype(jnp.float32)) / (1.0 - a)


def verify_cost(verify_cost_fields, width) -> jax.Array:
    """float32: the cost of a round verifying `width` drafts per row (width + 1 positions), in
    one-token target steps (module docs)."""
    fixed, per_draft = (float(v) for v in verify_cost_fields)
    width = jnp.asarray(width, jnp.float32)
    return 1.0 + jnp.where(width > 0, fixed + per_draft * width, 0.0)


def _best_gain(alpha, k_max, buckets, position_cost):
    """float32 [B]: max over buckets 1..k_max of (1 + G(alpha, k)) / c(k) (0 if none fits)."""
    best = jnp.zeros_like(alpha)
    for k in buckets:
        if k == 0:
            continue
        gain = (1.0 + expected_accepted(alpha, jnp.int32(k))) / verify_cost(position_cost, k)
        best = jnp.where(k_max >= k, jnp.maximum(best, gain), best)
    return best


def gate_rows(fallback: FallbackState, k_want: jax.Array, live: jax.Array, buckets,
              cfg) -> tuple[jax.Array, jax.Array, FallbackState]:
    """Before drafting: (k_want [B] with 0 for rows that skip drafting, probing bool [B],
    FallbackState with the probe countdown advanced). Row-local: no row reads another."""
    worth = _best_gain(fallback.acceptance, k_want, buckets,
                       cfg.assistant_verify_cost) > 1.0  # [B]
    idle = live & ~worth & (k_want > 0)  # [B] rows that could draft but should not
    probing = idle & (fallback.wait <= 0)  # [B]
    base = int(cfg.assistant_probe_interval)
    interval = jnp.where(worth, base, jnp.where(
        probing, jnp.minimum(fallback.interval * 2, base * MAX_BACKOFF), fallback.interval))
    wait = jnp.where(worth, base, jnp.where(probing, interval,
                                            fallback.wait - idle.astype(jnp.int32)))
    k_want = jnp.where(worth, k_want, jnp.where(probing, jnp.minimum(k_want, PROBE_DRAFTS), 0))
    return k_want, probing, dataclasses.replace(fallback, wait=wait, interval=interval,
                                                probing=probing)


def choose_width(fallback: FallbackState, k_row: jax.Array, remaining: jax.Array, live: jax.Array, buckets, cfg) -> jax.Array:
    """After drafting (greedy): every row's drafts cut to the bucket that minimises the
    projected time to finish the batch (module docs). Returns k_row int32 [B]."""
    prior = PRIOR[0] / PRIOR[1]
    alpha = jnp.where(fallback.probing, prior, fallback.acceptance)  # [B]
    rest = jnp.where(live, remaining, 0).astype(jnp.float32)  # [B]
    best_time, best_k = None, jnp.int32(0)
    for k in buckets:  # ascending: ties keep the narrower forward
        tokens = 1.0 + expected_accepted(alpha, jnp.minimum(k_row, k))  # [B]
        time = verify_cost(cfg.assistant_verify_cost, k) * jnp.max(rest / tokens)
        if best_time is None:
            best_time = time
            continue
        better = time < best_time
        best_time = jnp.where(better, time, best_time)
        best_k = jnp.where(better, jnp.int32(k), best_k)
    return jnp.minimum(k_row, best_k).astype(jnp.int32)
