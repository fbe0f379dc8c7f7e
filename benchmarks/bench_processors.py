"""Per-step cost of the logits-processor chain: search (default) vs sort path.

The chain alone is jitted (`process_logits` on [B, V] logits with a 512-token history) and
timed over many calls; figures are ms per step (one call = one decode step's processing).
When the embedded SmolLM2-135M-Instruct is available, each figure is also given as a ratio to
one SmolLM2 decode step (fp32, batch 1, 512-slot cache), measured in the same run.

    python benchmarks/bench_processors.py [--calls 50]

Chains:
    sampling   temperature + top-k + top-p + repetition penalty (the README target: <= 10%
               of one decode step)
    full       the sampling chain + min-p, typical-p, presence/frequency, no-repeat-ngram
               (n=3), bad words, sequence bias, min_new_tokens, suppress tokens
    top_h      temperature + top-H (entropy cut over the 100 best tokens)
    wm_left    the sampling chain + the green-list watermark, lefthash (a green list of
               V/4 ids drawn per row per step with torch's permutation)
    wm_self    the sampling chain + the green-list watermark, selfhash (a [V] table built
               once on the host, then a top-40 per step; the build time is printed)
    synthid    the sampling chain + SynthID-text (ngram 5, depth 9: 64-bit hashes of every
               candidate)

    python benchmarks/bench_processors.py --chains top_h wm_left --vocabs 49152 --batches 1 8
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from report_table import table_header, table_row

from jaxgen.config.generation import GenerationConfig
from jaxgen.config.watermarking import SynthIDTextWatermarkingConfig, WatermarkingConfig
from jaxgen.logits.chain import ProcessorContext, process_logits
from jaxgen.logits.watermark.green_list import self_green_table

HISTORY = 512

CHAINS = {
    "sampling": dict(do_sample=True, temperature=0.7, top_k=50, top_p=0.9,
                     repetition_penalty=1.2),
    "full": dict(do_sample=True, temperature=0.7, top_k=50, top_p=0.9, repetition_penalty=1.2,
                 min_p=0.05, typical_p=0.95, presence_penalty=0.3, frequency_penalty=0.2,
                 no_repeat_ngram_size=3, bad_words_ids=[[11, 12], [13], [14, 15, 16]],
                 sequence_bias=[[[17], 1.0], [[18, 19], -2.0]], min_new_tokens=4,
                 eos_token_id=2, suppress_tokens=[20, 21]),
    "top_h": dict(do_sample=True, temperature=0.7, top_h=0.4),
}
SAMPLING = CHAINS["sampling"]
CHAINS["wm_left"] = dict(SAMPLING, watermarking_config=WatermarkingConfig())
CHAINS["wm_self"] = dict(SAMPLING, watermarking_config=WatermarkingConfig(
    seeding_scheme="selfhash"))
CHAINS["synthid"] = dict(SAMPLING, watermarking_config=SynthIDTextWatermarkingConfig(
    ngram_len=5, keys=(654, 400, 836, 123, 340, 443, 597, 160, 57)))


def time_calls(fn, args, calls: int) -> float:
    """Best-of-3 mean milliseconds per call (compile excluded)."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e3


def chain_ms(chain: str, vocab: int, batch: int, impl: str, calls: int) -> float:
    rng = np.random.default_rng(0)
    logits = jnp.asarray((rng.normal(size=(batch, vocab)) * 4).astype(np.float32))
    tokens = jnp.asarray(rng.integers(0, vocab, size=(batch, HISTORY)).astype(np.int32))
    length = jnp.full((batch,), HISTORY - 8, jnp.int32)
    ctx = ProcessorContext(tokens=tokens, length=length, prompt_len=length - 100,
                           max_new=jnp.full((batch,), 200, jnp.int32))
    cfg = GenerationConfig(**CHAINS[chain], filter_impl=impl)
    fn = jax.jit(lambda c, x, s: process_logits(c, s, x))
    return time_calls(fn, (cfg, ctx, logits), calls)


def decode_step_ms(calls: int) -> float | None:
    """One SmolLM2-135M decode step at batch 1 (None if the model is unavailable)."""
    try:
        from jaxgen.models import DEFAULT_MODEL, load
        model, params, _ = load(DEFAULT_MODEL)
    except Exception as error:  # noqa: BLE001 - the embedded model is optional here
        print(f"(SmolLM2 unavailable: {error})")
        return None
    cache = model.init_cache(1, HISTORY, jnp.float32)
    prompt = jnp.arange(1, 101, dtype=jnp.int32)[None]  # [1, 100]
    out = jax.jit(lambda p, t, pos, c: model(p, t, pos, c))(
        params, prompt, jnp.arange(100, dtype=jnp.int32)[None], cache)
    cache = out.cache.with_length(jnp.array([100], jnp.int32))
    step = jax.jit(lambda p, t, pos, c: model(p, t, pos, c).logits)
    token = jnp.array([[42]], jnp.int32)
    position = jnp.array([[100]], jnp.int32)
    return time_calls(step, (params, token, position, cache), calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--chains", nargs="+", default=list(CHAINS), choices=list(CHAINS))
    parser.add_argument("--vocabs", nargs="+", type=int, default=[49152, 128256])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    args = parser.parse_args()
    step = decode_step_ms(args.calls)
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, history {HISTORY} tokens")
    if step is not None:
        print(f"SmolLM2-135M decode step, batch 1: {step:.2f} ms")
    print()
    if "wm_self" in args.chains:
        for vocab in args.vocabs:
            start = time.perf_counter()
            self_green_table(CHAINS["wm_self"]["watermarking_config"], vocab)
            print(f"selfhash table, vocab {vocab}: built in "
                  f"{time.perf_counter() - start:.1f} s (once per key and vocabulary)")
        print()
    print(table_header("chain", "vocab", "batch", "search ms/step", "sort ms/step",
                       "search / decode step", "sort / decode step", numeric=True))
    for chain in args.chains:
        for vocab in args.vocabs:
            for batch in args.batches:
                fast = chain_ms(chain, vocab, batch, "search", args.calls)
                exact = chain_ms(chain, vocab, batch, "sort", args.calls)
                ratio = (lambda ms: f"{ms / step:.1%}" if step else "n/a")
                print(table_row(chain, vocab, batch, f"{fast:.3f}", f"{exact:.3f}",
                                ratio(fast), ratio(exact)), flush=True)


if __name__ == "__main__":
    main()
