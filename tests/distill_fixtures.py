"""The tiny distillation set the MTP recipes' tests train on: a 2-layer tiny Llama target over
repetitive token sequences, with its final states and the input of its last layer (what an MTP
layer's eh_proj fit and an MTP drafter's K/V read)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxgen.models import tiny_llama
from jaxgen.train.batches import DistillSet

SEQS, LENGTH, PROMPT = 16, 12, 3
VOCAB = tuple(range(0, 32, 2)) + (1, 3)


def repetitive_target_set():
    """(target, params, DistillSet) over SEQS sequences of LENGTH tokens, each a random
    pattern of period 2-4 drawn from VOCAB; the first PROMPT tokens are the prompt."""
    target, params = tiny_llama(seed=1, num_layers=2)
    rng = np.random.default_rng(0)
    period = rng.integers(2, 5, size=SEQS)
    tokens = np.stack([np.resize(rng.choice(VOCAB, size=p), LENGTH) for p in period])
    cache = target.init_cache(SEQS, LENGTH)
    positions = jnp.broadcast_to(jnp.arange(LENGTH), (SEQS, LENGTH))  # [S, T]
    x = target.embed(params, jnp.asarray(tokens))  # [S, T, D]
    mid, cache = target.run_layers(params, x, positions, cache, 0, 1)  # [S, T, D]
    final, _ = target.run_layers(params, mid, positions, cache, 1, 2)  # [S, T, D]
    data = DistillSet(tokens=tokens.reshape(-1).astype(np.int32),
                      starts=np.arange(SEQS + 1) * LENGTH,
                      prompt_lens=np.full(SEQS, PROMPT, np.int32),
                      final=np.asarray(final, np.float16).reshape(SEQS * LENGTH, -1),
                      layers={1: np.asarray(mid, np.float16).reshape(SEQS * LENGTH, -1)})
    return target, params, data
