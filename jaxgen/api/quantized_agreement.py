"""How close quantized weights decode to the float weights: the quality rule for
`load(..., weights="int8")` (jaxgen/models/quantize.py).

Both parameter sets decode every prompt greedily for `new_tokens` tokens (no EOS). A row
*agrees* when its continuation equals the reference's, or when it first departs at a
near-tie: at the first differing position the reference model's logit of the token the
quantized model chose is within `tie_gap` of its top logit (the prefixes are equal up to
there, so this is the decision both models faced). KL(reference || quantized) is averaged
over the reference continuation's positions, teacher-forced (one forward of each parameter
set over prompt + reference continuation).

Example (a tiny random model is its own perfect copy):
    >>> import jax
    >>> from jaxgen.models import tiny_llama
    >>> model, params = tiny_llama()
    >>> report = greedy_agreement(model, params, params, [[1, 2, 3], [4, 5]], new_tokens=4)
    >>> report["agree"], report["exact"], report["mean_kl"] < 1e-9
    (1.0, 1.0, True)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.api.generate import generate
from jaxgen.config.generation import GenerationConfig
from jaxgen.core.state import init_state

TIE_GAP = 0.5  # logits: a departure where the reference's top-2 are this close is a near-tie


def _greedy(model, params, prompts: list[list[int]], new_tokens: int):
    cfg = GenerationConfig(max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0)
    out = generate(params, init_state(model, prompts, cfg), cfg)
    return np.asarray(out.sequences), np.asarray(out.prompt_lengths)


def greedy_agreement(model, reference_params, params, prompts: list[list[int]],
                     new_tokens: int = 32, tie_gap: float = TIE_GAP) -> dict:
    """{"agree": fraction of rows equal or departing at a near-tie, "exact": fraction equal,
    "mean_kl", "max_kl", "token_match": fraction of positions equal, "departures": list of
    (row, position, reference logit gap) for rows that differ}."""
    ref_seq, plen = _greedy(model, reference_params, prompts, new_tokens)
    seq, _ = _greedy(model, params, prompts, new_tokens)
    width = ref_seq.shape[1]
    tokens = jnp.asarray(ref_seq)  # [B, T]
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), tokens.shape)  # [B, T]
    forward = jax.jit(lambda p, t, pos, c: model(p, t, pos, c).logits)
    ref_logits = np.asarray(forward(reference_params, tokens, positions,
                                    model.init_cache(len(prompts), width)))  # [B, T, V]
    logits = np.asarray(forward(params, tokens, positions,
                                model.init_cache(len(prompts), width)))  # [B, T, V]
    agree, exact, departures, kls, matches = 0, 0, [], [], []
    for row in range(len(prompts)):
        start = int(plen[row])
        ref_new = ref_seq[row, start:start + new_tokens]  # [n]
        new = seq[row, start:start + new_tokens]  # [n]
        steps = np.arange(start - 1, start - 1 + new_tokens)  # logits that chose each token
        ref_rows, rows = ref_logits[row, steps], logits[row, steps]  # [n, V]
        logp = jax.nn.log_softmax(ref_rows, -1)
        logq = jax.nn.log_softmax(rows, -1)
        kls.append(np.asarray(jnp.sum(jnp.exp(logp) * (logp - logq), -1)))  # [n]
        matches.append(ref_new == new)
        differ = np.flatnonzero(ref_new != new)
        if differ.size == 0:
            agree, exact = agree + 1, exact + 1
            continue
        first = int(differ[0])
        gap = float(ref_rows[first, ref_new[first]] - ref_rows[first, new[first]])
        departures.append((row, first, round(gap, 4)))
        agree += gap < tie_gap
    kl = np.concatenate(kls)
    return {"agree": agree / len(prompts), "exact": exact / len(prompts),
            "mean_kl": float(kl.mean()), "max_kl": float(kl.max()),
            "token_match": float(np.mean(np.concatenate(matches))), "departures": departures}
