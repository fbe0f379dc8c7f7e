"""Hugging Face's `compute_transition_scores` over a `GenerateOutput`: the score of each
chosen token at each step, read from the per-step scores (beam outputs: along beam_indices).

HF's arithmetic (transformers' GenerationMixin.compute_transition_scores): step j of returned
row i reads scores[step j][beam_indices[i, j], token j of row i], with `normalize_logits`
first taking log_softmax over the vocabulary; without beam_indices row i reads its own row.
jaxgen's layout differs only in where the tokens sit (right-padded rows, per-row prompt
lengths) and in the steps past a row's end, which are 0 here (HF masks them to 0 for beams;
for greedy / sampling it scores the pad token there).

Example:
    >>> import jax.numpy as jnp
    >>> from jaxgen.core.output import GenerateOutput
    >>> scores = jnp.log(jnp.array([[[.5, .25, .25], [.1, .1, .8]]]))   # [1, 2, 3]
    >>> out = GenerateOutput(sequences=jnp.array([[0, 1, 2]]), lengths=jnp.array([3]),
    ...                      prompt_lengths=jnp.array([1]), stop_reason=jnp.array([2]),
    ...                      token_logprobs=jnp.zeros((1, 2)), scores=scores)
    >>> [[round(float(p), 2) for p in row] for row in jnp.exp(compute_transition_scores(out))]
    [[0.25, 0.8]]
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxgen.core.output import GenerateOutput


def compute_transition_scores(out: GenerateOutput, normalize_logits: bool = False, *,
                              scores: jax.Array | None = None) -> jax.Array:
    """float32 [rows, N]: the score of each returned row's j-th new token at step j.

    out: a generate() output; its per-step `scores` (generate with output_scores=True) are
    read unless `scores` [rows or B*num_beams, N, V] is given (e.g. out.logits, with
    output_logits=True). Beam outputs need out.beam_indices (return_dict_in_generate=True).
    normalize_logits: log_softmax over the vocabulary first (HF's flag). Steps past a row's
    last new token (beam: beam_indices == -1) are 0.
    """
    per_step = out.scores if scores is None else scores
    if per_step is None:
        raise ValueError("compute_transition_scores needs per-step scores: generate with "
                         "output_scores=True (or output_logits=True and pass "
                         "scores=out.logits)")
    per_step = jnp.asarray(per_step, jnp.float32)  # [R', N, V]
    if per_step.ndim != 3:
        raise ValueError(f"`scores` must be [rows, steps, vocab], got shape {per_step.shape}")
    if normalize_logits:
        per_step = jax.nn.log_softmax(per_step, axis=-1)  # [R', N, V]
    sequences = jnp.asarray(out.sequences)  # [R, T]
    rows, width = sequences.shape
    steps = per_step.shape[1]
    step = jnp.arange(steps, dtype=jnp.int32)  # [N]
    prompt_len = jnp.asarray(out.prompt_lengths, jnp.int32)  # [R]
    if out.beam_indices is not None:
        source = jnp.asarray(out.beam_indices, jnp.int32)[:, :steps]  # [R, N]
        source = jnp.pad(source, ((0, 0), (0, steps - source.shape[1])), constant_values=-1)
        live = source >= 0  # [R, N]
        source = jnp.where(live, source, 0)
    elif per_step.shape[0] != rows:
        raise ValueError(f"the scores hold {per_step.shape[0]} rows but the output returns "
                         f"{rows}: a beam output needs out.beam_indices (generate with "
                         f"return_dict_in_generate=True)")
    else:
        source = jnp.broadcast_to(jnp.arange(rows, dtype=jnp.int32)[:, None], (rows, steps))
        new = jnp.asarray(out.lengths, jnp.int32) - prompt_len  # [R]
        live = step[None, :] < new[:, None]  # [R, N]
    position = jnp.clip(prompt_len[:, None] + step[None, :], 0, width - 1)  # [R, N]
    tokens = jnp.take_along_axis(sequences, position, axis=1)  # [R, N]
    picked = per_step[source, step[None, :], tokens]  # [R, N]
    return jnp.where(live, picked, 0.0)  # [R, N]


__all__ = ["compute_transition_scores"]
