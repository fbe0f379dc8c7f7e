"""Cache bytes and decode tokens/s for every cache kind at contexts 1k, 4k and 16k.

Model: a random Llama with 8 layers, 8 query heads and 8 KV heads of head_dim 64
(hidden 512, MLP 1024, vocab 2048), fp32, batch 1. The hidden size is small so that the
16k-context runs of every kind fit in ~10 minutes on a 2-core CPU; the KV cache (8 x 8 x 64
per token and layer, 32 KiB/token in fp32) then dominates the bytes read per step, which is
what the cache kinds change.

Each step runs what `jaxgen.generate` runs on CPU (layout="auto"): per-layer weights
(jaxgen/backends/cpu/layer_split.py) and the cache held as one buffer per layer
(jaxgen.cache.layer_forms.to_layer_tuples, as jaxgen/backends/cpu/prepare.py converts it). The
cache is filled with random K/V up to the context (through each kind's own `update`, so
int8 codes and ring slots are real), then `--steps` greedy decode steps run in one jitted
`fori_loop` (timed after a warm-up call); each call splits the cache per layer and stacks it
back, as a generate call does, unless `--held-cache` keeps it per layer between calls (as the
chunked driver and the serving engine do). Fixed-size kinds are allocated for context + 2 *
steps; "dynamic" holds the power-of-two bucket jaxgen.drivers.growing would have grown to;
"sliding_window" uses a 4096-token window (the model gets sliding_window=4096 for that row
only) plus 64 slots of rollback slack; "offloaded" is a no-op on CPU (host memory is the
device memory), so it measures the same program as "static".

    python benchmarks/bench_cache.py [--contexts 1024 4096 16384] [--steps 16] [--stacked-cache]
                                     [--xla-attention] [--held-cache]
    python benchmarks/bench_cache.py --prefill 4096 --kinds static "quantized int8"

Prints a markdown table and saves benchmarks/bench_cache.png.
"""
from __future__ import annotations

import argparse
import functools
import os
import time
from statistics import median

import jax
import jax.numpy as jnp
from bench_generate import measure_bandwidth
from report_table import table_header, table_row

from jaxgen.backends.cpu.kernel_attention import with_kernel_attention, without_kernel_attention
from jaxgen.backends.cpu import prepare
from jaxgen.backends.cpu.layer_split import for_decoding
from jaxgen.cache.layer_forms import to_layer_tuples, to_stacked_layers
from jaxgen.core.state import next_pow2
from jaxgen.models import Llama, LlamaConfig

BASE = dict(vocab_size=2048, hidden_size=512, intermediate_size=1024, num_layers=8,
            num_heads=8, num_kv_heads=8, head_dim=64, max_position_embeddings=32768)
WINDOW = 4096
FILL_CHUNK = 1024
CHUNK = 64  # the growing driver's default chunk_size
KINDS = {  # label -> (cache_implementation, cache_config, model window)
    "static": ("static", None, None),
    "dynamic": ("dynamic", None, None),
    "quantized int8": ("quantized", {"nbits": 8}, None),
    "quantized 4-bit (g=32)": ("quantized", {"nbits": 4, "q_group_size": 32}, None),
    "sliding_window 4096": ("sliding_window", {"rollback_slack": 64}, WINDOW),
    "offloaded (CPU: no-op)": ("offloaded", None, None),
}


@functools.partial(jax.jit, donate_argnums=(0,), static_argnums=(1,))
def fill(cache, context: int, key):
    """Writes random K/V at positions 0..context-1 of every layer, in chunks."""
    heads, head_dim = BASE["num_kv_heads"], BASE["head_dim"]
    for start in range(0, context, FILL_CHUNK):
        size = min(FILL_CHUNK, context - start)
        positions = jnp.arange(start, start + size, dtype=jnp.int32)[None]  # [1, C]

        def body(layer, c, start=start, size=size, positions=positions):
            k1, k2 = jax.random.split(jax.random.fold_in(key, layer * 100003 + start))
            k = jax.random.normal(k1, (1, size, heads, head_dim))  # [1, C, Hkv, Dh]
            v = jax.random.normal(k2, (1, size, heads, head_dim))
            return c.update(layer, k, v, positions)

        cache = jax.lax.fori_loop(0, BASE["num_layers"], body, cache)
    return cache.with_length(jnp.full((1,), context, jnp.int32))


def make_decode(model, steps: int, split: bool = True, kernel_attention: bool = True,
                held: bool = False):
    """`steps` greedy steps in one jitted loop, over what a compiled generate call runs: the
    weights as `for_decoding` lays them out and, with per-layer weights, the cache held per
    layer, attending through the native decode-attention kernel where it is built
    (jaxgen/backends/cpu/prepare.py; split=False keeps the cache stacked, kernel_attention=False
    runs XLA's attention). held: the cache comes and goes one buffer per layer (as the chunked
    driver and the serving engine hold it between calls), not stacked."""
    @functools.partial(jax.jit, donate_argnums=(1,))
    def decode(params, cache, token, start):
        params = for_decoding(model, params, rows=1, layout="auto")
        per_layer = isinstance(params["layers"], (list, tuple))
        if held and not per_layer:
            cache = to_stacked_layers(cache)
        if per_layer and split:
            cache = to_layer_tuples(cache)
            if kernel_attention:
                cache = with_kernel_attention(cache)

        def body(i, carry):
            cache, token = carry
            position = jnp.reshape(start + i, (1, 1)).astype(jnp.int32)
            out = model(params, token[:, None], position, cache)
            return out.cache, jnp.argmax(out.logits[:, 0], axis=-1).astype(jnp.int32)
        cache, token = jax.lax.fori_loop(0, steps, body, (cache, token))
        cache = without_kernel_attention(cache)
        return (to_layer_tuples(cache) if held else to_stacked_layers(cache)), token
    return decode


def run_one(label: str, context: int, steps: int, split: bool = True,
            repeats: int = 3, kernel_attention: bool = True, held: bool = False) -> dict:
    """Cache bytes, decode tokens/s (median of `repeats` calls of `steps` steps), the
    first call's seconds and the bytes a step reads at least (layer weights, head, cache)."""
    kind, cache_config, window = KINDS[label]
    model = Llama(LlamaConfig(**BASE, sliding_window=window))
    params = model.init_params(jax.random.key(0))
    capacity = context + 2 * steps
    if kind == "dynamic":
        capacity = next_pow2(context + 2 * steps + CHUNK)
    cache = model.init_cache(1, capacity, kind=kind, cache_config=cache_config)
    cache = fill(cache, context, jax.random.key(1))
    nbytes = cache.nbytes()
    # laid out once and placed (huge pages), as generate keeps the laid-out weights between
    # calls (in the program for_decoding then finds them laid out already)
    laid_out = prepare.on_huge_pages(params, for_decoding(model, params, rows=1, layout="auto"))
    decode = make_decode(model, steps, split, kernel_attention, held)
    if held:
        cache = to_layer_tuples(cache)
    token = jnp.zeros((1,), jnp.int32)
    t0 = time.perf_counter()
    cache, token = decode(laid_out, cache, token, jnp.int32(context))
    token.block_until_ready()
    compile_and_first = time.perf_counter() - t0
    elapsed = []
    for repeat in range(repeats):  # calls alternate between the two halves of the
        # 2 * steps positions past the context, so none writes past the capacity
        t0 = time.perf_counter()
        cache, token = decode(laid_out, cache, token, jnp.int32(context + steps * (repeat % 2)))
        token.block_until_ready()
        elapsed.append(time.perf_counter() - t0)
    read = [value for name, value in params.items() if name != "embed" or "lm_head" not in params]
    weight_bytes = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(read))  # tied: the head
    return dict(kind=label, context=context, bytes=nbytes, tokens_per_s=steps / median(elapsed),
                first_call_s=compile_and_first, step_bytes=weight_bytes + nbytes)


def prefill_seconds(label: str, context: int, repeats: int = 2) -> float:
    """Best-of-repeats seconds of `jaxgen.generate` for a `context`-token prompt and 4 new
    tokens (the prefill dominates), with the kind's cache, after a compiling call."""
    import jaxgen

    kind, cache_config, window = KINDS[label]
    model = Llama(LlamaConfig(**BASE, sliding_window=window))
    params = model.init_params(jax.random.key(0))
    prompt = jax.random.randint(jax.random.key(2), (1, context), 3, BASE["vocab_size"]).tolist()
    cfg = jaxgen.GenerationConfig(max_new_tokens=4, min_new_tokens=4,
                                  cache_implementation=kind, cache_config=cache_config)
    times = []
    for _ in range(repeats + 1):
        state = jaxgen.init_state(model, prompt, cfg)
        t0 = time.perf_counter()
        jax.block_until_ready(jaxgen.generate(params, state, cfg))
        times.append(time.perf_counter() - t0)
    return min(times[1:])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kinds", nargs="+", default=list(KINDS))
    parser.add_argument("--plot", default=os.path.join(os.path.dirname(__file__),
                                                       "bench_cache.png"))
    parser.add_argument("--stacked-cache", action="store_true",
                        help="keep the cache stacked [L, ...] (what compiled calls ran before "
                             "the cache was held per layer: jaxgen.cache.layer_forms)")
    parser.add_argument("--xla-attention", action="store_true",
                        help="attention through XLA's products, not the native "
                             "decode-attention kernel (jaxgen/backends/cpu/kernel_attention.py)")
    parser.add_argument("--held-cache", action="store_true",
                        help="hold the cache one buffer per layer between calls, as the "
                             "chunked driver and the serving engine do (no split and stack "
                             "copies a call)")
    parser.add_argument("--prefill", type=int, default=0, metavar="TOKENS",
                        help="instead: seconds of generate() for a prompt of TOKENS tokens "
                             "and 4 new ones, per kind")
    args = parser.parse_args(argv)
    if args.prefill:
        for label in args.kinds:
            print(f"  {label:24s} prompt {args.prefill}: "
                  f"{prefill_seconds(label, args.prefill):.2f} s", flush=True)
        return None
    start = time.perf_counter()
    rows = []
    for context in args.contexts:
        for label in args.kinds:
            row = run_one(label, context, args.steps, split=not args.stacked_cache,
                          repeats=args.repeats, kernel_attention=not args.xla_attention,
                          held=args.held_cache)
            rows.append(row)
            print(f"  {label:24s} ctx {context:6d}: {row['bytes'] / 2**20:8.1f} MiB  "
                  f"{row['tokens_per_s']:7.1f} tok/s  (first call {row['first_call_s']:.1f}s)",
                  flush=True)
    static = {r["context"]: r for r in rows if r["kind"] == "static"}
    print(f"\nRandom Llama, 8 layers, 8 KV heads x 64, hidden 512, fp32, batch 1, "
          f"{args.steps} decode steps ({jax.devices()[0].platform}, "
          f"{os.cpu_count()} cores); total {time.perf_counter() - start:.0f}s\n")
    bandwidth = measure_bandwidth()
    print(f"bandwidth probe {bandwidth:.1f} GB/s; floor = (layer weights + head + the "
          f"kind's cache bytes) / bandwidth\n")
    print(table_header("kind", "context", "cache MiB", "x static bytes", "decode tok/s",
                       "x static speed", "ms/step", "floor ms", "x floor", numeric=True))
    for r in rows:
        ref = static.get(r["context"])
        rel_b = f"{r['bytes'] / ref['bytes']:.3f}" if ref else "-"
        rel_s = f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}" if ref else "-"
        step_ms, floor_ms = 1e3 / r["tokens_per_s"], r["step_bytes"] / bandwidth / 1e6
        print(table_row(r["kind"], r["context"], f"{r['bytes'] / 2**20:.1f}", rel_b,
                        f"{r['tokens_per_s']:.1f}", rel_s, f"{step_ms:.2f}", f"{floor_ms:.2f}",
                        f"{step_ms / floor_ms:.2f}"))
    plot(rows, args.plot)
    print(f"\nplot: {args.plot}")
    return rows


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax_bytes, ax_speed) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label in dict.fromkeys(r["kind"] for r in rows):
        mine = [r for r in rows if r["kind"] == label]
        ctx = [r["context"] for r in mine]
        ax_bytes.plot(ctx, [r["bytes"] / 2**20 for r in mine], marker="o", label=label)
        ax_speed.plot(ctx, [r["tokens_per_s"] for r in mine], marker="o", label=label)
    for ax, title, unit in ((ax_bytes, "KV cache size", "MiB"),
                            (ax_speed, "decode speed (batch 1)", "tokens / s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    ax_bytes.set_yscale("log", base=2)
    ax_speed.legend(fontsize=8)
    fig.suptitle("jaxgen cache kinds: random Llama, 8 layers, 8 KV heads x 64, fp32")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
