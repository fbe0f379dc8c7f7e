"""What a generate call returns (`GenerateOutput`) and the per-step records the loops fill.

Example:
    >>> import jax.numpy as jnp
    >>> from jaxgen.config.generation import GenerationConfig
    >>> record = StepRecord.empty(2, 3, 5, GenerationConfig(output_scores=True))
    >>> record.token_logprobs.shape, record.scores.shape, record.logits is None
    ((2, 3), (2, 3, 5), True)
    >>> record = StepRecord.empty(1, 3, 5, GenerationConfig(top_logprobs=2))
    >>> record = record.write(0, jnp.zeros(1), jnp.log(jnp.array([[.1, .5, .1, .3, 0.]])), None)
    >>> record.top_ids[0, 0].tolist(), record.top_logprobs.shape
    ([1, 3], (1, 3, 2))
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.config.generation import GenerationConfig

if TYPE_CHECKING:  # annotations only: the state module does not import this one
    from jaxgen.core.speculative_stats import SpeculativeStats
    from jaxgen.core.state import DecodeState


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepRecord:
    """Per-step outputs, indexed by step number i (the i-th new token of every row)."""

    token_logprobs: jax.Array  # float32 [B, N]
    scores: jax.Array | None  # float32 [B, N, V] processed scores (output_scores)
    logits: jax.Array | None  # float32 [B, N, V] raw logits (output_logits)
    top_ids: jax.Array | None = None  # int32 [B, N, k] most likely tokens (top_logprobs=k)
    top_logprobs: jax.Array | None = None  # float32 [B, N, k] their log-probs, descending
    prompt_logprobs: jax.Array | None = None  # float32 [B, P] (prompt_logprobs; prefill)

    @classmethod
    def empty(cls, batch: int, steps: int, vocab: int, cfg: GenerationConfig) -> "StepRecord":
        full = lambda on: jnp.zeros((batch, steps, vocab), jnp.float32) if on else None  # noqa: E731
        k = int(cfg.top_logprobs)
        return cls(token_logprobs=jnp.zeros((batch, steps), jnp.float32),
                   scores=full(cfg.output_scores), logits=full(cfg.output_logits),
                   top_ids=jnp.zeros((batch, steps, k), jnp.int32) if k else None,
                   top_logprobs=jnp.zeros((batch, steps, k), jnp.float32) if k else None)

    def _top(self, scores):
        """(ids, log-probs) of the k most likely tokens of processed scores [..., V] under
        the log-softmax token_logprobs uses, each [..., k]; (None, None) when k = 0."""
        if self.top_ids is None:
            return None, None
        logprobs = jax.nn.log_softmax(scores.astype(jnp.float32), axis=-1)  # [..., V]
        values, ids = jax.lax.top_k(logprobs, self.top_ids.shape[-1])  # [..., k]
        return ids.astype(jnp.int32), values

    @classmethod
    def for_state(cls, state, cfg: GenerationConfig) -> "StepRecord":
        """Empty records for every new-token slot of `state` (at least one)."""
        steps = max(state.buffer_len - state.prompt_bucket, 1)
        return cls.empty(state.batch, steps, state.model.vocab_size, cfg)

    def write(self, step, logprobs, scores, logits) -> "StepRecord":
        """Step `step` (int32 []) of every row: logprobs [B], scores / logits [B, V]."""
        put = lambda buf, value: None if buf is None else buf.at[:, step].set(value)  # noqa: E731
        top_ids, top_logprobs = self._top(scores)  # [B, k] each
        return dataclasses.replace(
            self, token_logprobs=self.token_logprobs.at[:, step].set(logprobs),
            scores=put(self.scores, scores), logits=put(self.logits, logits),
            top_ids=put(self.top_ids, top_ids), top_logprobs=put(self.top_logprobs, top_logprobs))

    def write_rows(self, step, logprobs, scores, logits) -> "StepRecord":
        """Per-row steps: step int32 [B, S] (out of range = dropped), logprobs [B, S],
        scores / logits [B, S, V]."""
        rows = jnp.arange(step.shape[0])[:, None]
        put = lambda buf, v: None if buf is None else buf.at[rows, step].set(v, mode="drop")  # noqa: E731
        top_ids, top_logprobs = self._top(scores)  # [B, S, k] each
        return dataclasses.replace(
            self, token_logprobs=put(self.token_logprobs, logprobs),
            scores=put(self.scores, scores), logits=put(self.logits, logits),
            top_ids=put(self.top_ids, top_ids), top_logprobs=put(self.top_logprobs, top_logprobs))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GenerateOutput:
    """What `generate` returns (all arrays; row b's text is sequences[b, :lengths[b]]).

    sequences       int32 [B, T]      prompt + generated, right-padded with pad_token_id
    lengths         int32 [B]         valid tokens per row
    prompt_lengths  int32 [B]
    stop_reason     int32 [B]         jaxgen.stopping.STOP_REASONS
    token_logprobs  float32 [B, N]    log-prob of the i-th new token under the processed scores
    scores          float32 [B, N, V] processed scores per step (cfg.output_scores) or None
    logits          float32 [B, N, V] raw logits per step (cfg.output_logits) or None
    state           DecodeState       the final state (its buffers alias the donated input)
    sequences_scores float32 [B*R]    beam modes: HF's sequences_scores, else None
    beam_indices    int32 [B*R, N]    beam modes with return_dict_in_generate: HF's beam_indices
                                      (b*num_beams + beam per new token, -1 past the end), else None
    speculative     SpeculativeStats  assisted modes (assistant_model / prompt lookup): acceptance
                                      statistics (jaxgen.core.speculative_stats.SpeculativeStats), else None
    top_ids         int32 [B, N, k]   cfg.top_logprobs = k > 0: the k most likely tokens of each
                                      step, most likely first (same distribution as token_logprobs)
    top_logprobs    float32 [B, N, k] their log-probs (log_softmax of the processed scores)
    prompt_logprobs float32 [B, P]    cfg.prompt_logprobs: log-prob of prompt token p given tokens
                                      < p under the raw model (log_softmax of the logits); 0 at
                                      p = 0 and at the padding past each row's prompt, else None

    Beam modes (num_beams > 1) return R = num_return_sequences rows per prompt, batch-major
    (rows b*R .. b*R+R-1 belong to prompt b, best first); `scores` / `logits` then hold the
    K running beams of every step, [B*K, N, V], as HF's do; `state` is None. Sampling with
    num_return_sequences = R: init_state already expanded every prompt to R adjacent rows
    (each with its own key), so B here counts B*R rows, batch-major as well.
    """

    sequences: jax.Array
    lengths: jax.Array
    prompt_lengths: jax.Array
    stop_reason: jax.Array
    token_logprobs: jax.Array
    scores: Optional[jax.Array] = None
    logits: Optional[jax.Array] = None
    state: Optional["DecodeState"] = None
    sequences_scores: Optional[jax.Array] = None
    beam_indices: Optional[jax.Array] = None
    speculative: Optional["SpeculativeStats"] = None
    top_ids: Optional[jax.Array] = None
    top_logprobs: Optional[jax.Array] = None
    prompt_logprobs: Optional[jax.Array] = None

    @classmethod
    def from_state(cls, final, record: StepRecord, stats=None) -> "GenerateOutput":
        """The output of a loop that carries a DecodeState: final state + step records."""
        return cls(sequences=final.tokens, lengths=final.length,
                   prompt_lengths=final.prompt_len, stop_reason=final.stop_reason,
                   token_logprobs=record.token_logprobs, scores=record.scores,
                   logits=record.logits, state=final, speculative=stats,
                   top_ids=record.top_ids, top_logprobs=record.top_logprobs,
                   prompt_logprobs=record.prompt_logprobs)


def _first(array, count: int, axis: int):
    """array's first `count` entries along `axis`: a static slice under a trace, else cut on
    the host and put back with the array's sharding (no program compiles for a new count)."""
    if array is None or array.shape[axis] <= count:
        return array
    index = (slice(None),) * axis + (slice(0, count),)
    if isinstance(array, jax.core.Tracer):
        return array[index]
    host = np.ascontiguousarray(np.asarray(array)[index])
    return jax.device_put(host, array.sharding)


def trim_output(out: GenerateOutput, visible_len: int | None,
                prompt_bucket: int) -> GenerateOutput:
    """`out` with the token buffer cut to `visible_len` positions and the per-step records to
    visible_len - prompt_bucket steps (at least one): what the call returns when the state's
    buffer was padded to a bucket of new tokens (DecodeState.visible_len). `state` keeps the
    padded buffer. None: `out` as it is.

    >>> out = GenerateOutput(sequences=jnp.zeros((2, 80), jnp.int32), lengths=jnp.ones(2),
    ...                      prompt_lengths=jnp.ones(2), stop_reason=jnp.ones(2),
    ...                      token_logprobs=jnp.zeros((2, 64)))
    >>> cut = trim_output(out, 20, 16)
    >>> cut.sequences.shape, cut.token_logprobs.shape
    ((2, 20), (2, 4))
    """
    if visible_len is None:
        return out
    steps = max(int(visible_len) - int(prompt_bucket), 1)
    return dataclasses.replace(
        out, sequences=_first(out.sequences, int(visible_len), 1),
        token_logprobs=_first(out.token_logprobs, steps, 1),
        scores=_first(out.scores, steps, 1), logits=_first(out.logits, steps, 1),
        beam_indices=_first(out.beam_indices, steps, 1),
        top_ids=_first(out.top_ids, steps, 1), top_logprobs=_first(out.top_logprobs, steps, 1))


def outputs_to_lists(out: GenerateOutput) -> list[list[int]]:
    """Row-wise prompt + generated ids with the padding removed.

    >>> out = GenerateOutput(sequences=jnp.array([[1, 2, 0], [3, 4, 5]]),
    ...                      lengths=jnp.array([2, 3]), prompt_lengths=jnp.array([1, 1]),
    ...                      stop_reason=jnp.array([1, 2]), token_logprobs=jnp.zeros((2, 2)))
    >>> outputs_to_lists(out)
    [[1, 2], [3, 4, 5]]
    """
    sequences = np.asarray(out.sequences)
    lengths = np.asarray(out.lengths)
    return [sequences[b, :lengths[b]].tolist() for b in range(sequences.shape[0])]
