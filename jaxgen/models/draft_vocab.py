"""A pruned draft vocabulary: a drafter whose head computes logits only for the few thousand
tokens that carry nearly all of the target's mass, with -inf everywhere else.

q (the draft's distribution) is then defined over the full vocabulary with exactly zero mass
outside the draft vocabulary, so speculative verification stays exact: a draft token is
always inside the vocabulary, acceptance min(1, p/q) and the residual max(0, p - q) use the
true q, and the target can still emit any token (through the residual or the bonus token).

    DraftVocabModel(model, vocab)   wraps any Llama-family model under the Model contract
    restricted_logits(...)          the head on the draft-vocabulary rows only [..., V_d]
    select_draft_vocab(counts, n)   the n most frequent tokens (+ the ids that must stay)
    with_draft_head(model, params)  adds a contiguous [D, V_d] head matrix to the params

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxgen.models import tiny_llama
    >>> model, params = tiny_llama()
    >>> small = DraftVocabModel(model, (0, 3, 5))
    >>> cache = small.init_cache(1, 4)
    >>> out = small(params, jnp.zeros((1, 2), jnp.int32), jnp.arange(2)[None], cache)
    >>> probs = jax.nn.softmax(out.logits[0, -1])
    >>> round(float(probs[jnp.array([0, 3, 5])].sum()), 6), float(probs[1])
    (1.0, 0.0)
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.models.llama import Llama, ModelOutput, rms_norm
from jaxgen.models.quantize import dense


def select_draft_vocab(counts: np.ndarray, size: int, keep=()) -> tuple[int, ...]:
    """The `size` token ids with the largest `counts` [V] (ties: lower id first), plus every
    id in `keep` (e.g. EOS), sorted ascending."""
    order = np.lexsort((np.arange(len(counts)), -np.asarray(counts)))
    chosen = set(int(i) for i in order[:size]) | {int(k) for k in keep}
    return tuple(sorted(chosen))


def restricted_logits(model: Llama, params: dict, hidden: jax.Array, vocab) -> jax.Array:
    """Final norm + the head's rows for `vocab` only: hidden [..., D] -> [..., V_d] float32.

    vocab: int32 [V_d] token ids. Uses params["draft_head"] [D, V_d] when present."""
    normed = rms_norm(hidden, params["final_norm"], model.config.rms_norm_eps)  # [..., D]
    head = params.get("lm_head")
    if "draft_head" in params:
        rows = params["draft_head"]  # [D, V_d]
    elif head is None:  # tied: the embedding's rows
        rows = jnp.take(params["embed"], jnp.asarray(vocab), axis=0).T  # [D, V_d]
    elif isinstance(head, jax.Array):
        rows = jnp.take(head, jnp.asarray(vocab), axis=1)  # [D, V_d]
    else:  # a weight object (quantized, or laid out by a backend): its own columns
        rows = head.columns(jnp.asarray(vocab))  # [D, V_d] array or weight object
        if not isinstance(rows, jax.Array):
            return (normed @ rows).astype(jnp.float32)  # [..., V_d]
    return jnp.einsum("...d,dv->...v", normed, rows.astype(normed.dtype),
                      preferred_element_type=jnp.float32)  # [..., V_d]


def with_draft_head(model: "DraftVocabModel", params: dict) -> dict:
    """params plus "draft_head" [D, V_d]: the head's vocabulary rows as one contiguous
    matrix, so a draft step reads V_d rows instead of gathering them each time."""
    vocab = np.asarray(model.vocab, np.int32)
    if "lm_head" in params:
        head = np.asarray(dense(params["lm_head"]))[:, vocab]  # [D, V_d]
    else:
        head = np.asarray(params["embed"])[vocab].T  # [D, V_d]
    return {**params, "draft_head": jnp.asarray(np.ascontiguousarray(head))}


@dataclasses.dataclass(frozen=True)
class DraftVocabModel:
    """`model` whose logits are -inf outside `vocab` (a sorted tuple of token ids); only the
    vocabulary's head rows are computed. Everything else (cache, layers) is the model's."""

    model: Llama
    vocab: tuple

    def __post_init__(self):
        ids = np.asarray(self.vocab)
        if ids.ndim != 1 or not len(ids) or np.any(np.diff(ids) <= 0) or ids[0] < 0 \
                or ids[-1] >= self.model.vocab_size:
            raise ValueError(f"vocab must be a non-empty sorted tuple of distinct token ids in "
                             f"[0, {self.model.vocab_size}), got {len(ids)} ids")

    @property
    def config(self):
        return self.model.config

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    def init_cache(self, *args, **kwargs):
        return self.model.init_cache(*args, **kwargs)

    def check_params(self, params: Any) -> None:
        """The wrapped model's check; an optional "draft_head" must be [D, len(vocab)]."""
        if isinstance(params, dict) and "draft_head" in params:
            want = (self.model.config.hidden_size, len(self.vocab))
            if tuple(params["draft_head"].shape) != want:
                raise ValueError(f"params['draft_head'] has shape "
                                 f"{tuple(params['draft_head'].shape)}, expected {want}")
            params = {k: v for k, v in params.items() if k != "draft_head"}
        self.model.check_params(params)

    def __call__(self, params: dict, tokens: jax.Array, positions: jax.Array, cache, *,
                 logits_index: jax.Array | None = None) -> ModelOutput:
        """The wrapped forward; logits [B, S', V] are -inf outside the vocabulary."""
        inner = {k: v for k, v in params.items() if k != "draft_head"}
        x = self.model.embed(inner, tokens)  # [B, S, D]
        x, cache = self.model.run_layers(inner, x, positions, cache, 0,
                                         self.model.config.num_layers)  # [B, S, D]
        hidden = x
        if logits_index is not None:
            x = jnp.take_along_axis(x, logits_index[:, :, None].astype(jnp.int32),
                                    axis=1)  # [B, S', D]
        small = restricted_logits(self.model, params, x, self.vocab)  # [B, S', V_d]
        full = jnp.full(small.shape[:-1] + (self.model.vocab_size,), -jnp.inf,
                        jnp.float32)  # [B, S', V]
        logits = full.at[..., jnp.asarray(self.vocab, jnp.int32)].set(small)  # [B, S', V]
        return ModelOutput(logits=logits, hidden=hidden,
                           cache=cache.with_length(positions[:, -1] + 1))
