"""Greedy decoding speed: jaxgen vs transformers generate() vs the memory-bandwidth floor.

SmolLM2-135M-Instruct in fp32 (the embedded GGUF, dequantized; both libraries get the same
weights), 32-token prompt, 128 new tokens (EOS disabled so every run decodes all 128),
batch 1 and 8, all measured in one run:

    python benchmarks/bench_generate.py [--new-tokens 128] [--repeats 3]

The floor is (bytes of weights + KV cache read per decode step) / bandwidth, where the
bandwidth is measured in the same run by a jitted fp32 matrix-vector product over 512 MB.
jaxgen runs on `unstack_layers(params)` (one buffer per layer; `--stacked` for the scan
layout); the floor counts the weights once (538 MB), as a decode step reads them once.
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from report_table import table_header, table_row

import jaxgen
from jaxgen.models import DEFAULT_MODEL, load, unstack_layers
from jaxgen.models.hf_export import hf_from_jaxgen


def measure_bandwidth(repeats: int = 10) -> float:
    """GB/s of a jitted fp32 matrix-vector product over a 512 MB matrix."""
    matrix = jax.random.normal(jax.random.key(0), (16384, 8192), jnp.float32)  # 512 MB
    vector = jnp.ones((8192,), jnp.float32)
    matvec = jax.jit(lambda m, v: m @ v)
    matvec(matrix, vector).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matvec(matrix, vector).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return matrix.nbytes / best / 1e9


def prompts_of(tokenizer, batch: int, length: int) -> list[list[int]]:
    text = ("The history of the city begins with a small settlement on the river, where "
            "traders met farmers and fishermen every season to exchange goods and stories. ")
    ids = tokenizer.encode(text * 4)
    return [ids[b:b + length] for b in range(batch)]


def time_jaxgen(model, params, prompts, new_tokens: int, repeats: int) -> tuple[float, float]:
    """(compile-inclusive first call seconds, best steady-state seconds)."""
    cfg = jaxgen.GenerationConfig(max_new_tokens=new_tokens, pad_token_id=0)  # no EOS
    start = time.perf_counter()
    jaxgen.generate(params, jaxgen.init_state(model, prompts, cfg), cfg).sequences.block_until_ready()
    first = time.perf_counter() - start
    best = float("inf")
    for _ in range(repeats):
        state = jaxgen.init_state(model, prompts, cfg)
        start = time.perf_counter()
        out = jaxgen.generate(params, state, cfg)
        out.sequences.block_until_ready()
        best = min(best, time.perf_counter() - start)
        assert int(np.min(np.asarray(out.lengths) - np.asarray(out.prompt_lengths))) == new_tokens
    return first, best


def time_transformers(hf, prompts, new_tokens: int, repeats: int) -> float:
    import torch

    ids = torch.tensor(prompts)
    hf.generation_config.eos_token_id = None
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  pad_token_id=0, attention_mask=torch.ones_like(ids))
    best = float("inf")
    with torch.no_grad():
        hf.generate(ids, **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
        for _ in range(repeats):
            start = time.perf_counter()
            out = hf.generate(ids, **kwargs)
            best = min(best, time.perf_counter() - start)
            assert out.shape[1] == ids.shape[1] + new_tokens
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--stacked", action="store_true",
                        help="run jaxgen on the stacked (scan) layout instead of unstack_layers")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(max(1, torch.get_num_threads()))
    model, params, tokenizer = load(DEFAULT_MODEL, dtype=jnp.float32)
    hf = hf_from_jaxgen(model, params)
    weight_bytes = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(params))
    if not args.stacked:
        params = unstack_layers(model, params)  # same weights, one buffer per layer
    bandwidth = measure_bandwidth()
    cfg = model.config
    rows = []
    for batch in args.batches:
        prompts = prompts_of(tokenizer, batch, args.prompt_tokens)
        first, ours = time_jaxgen(model, params, prompts, args.new_tokens, args.repeats)
        theirs = time_transformers(hf, prompts, args.new_tokens, args.repeats)
        mean_context = args.prompt_tokens + args.new_tokens / 2
        kv_bytes = 2 * cfg.num_layers * batch * mean_context * cfg.num_kv_heads * cfg.head_dim * 4
        floor_ms = (weight_bytes + kv_bytes) / (bandwidth * 1e9) * 1e3
        ours_ms = ours / args.new_tokens * 1e3
        rows.append((batch, batch * args.new_tokens / ours, batch * args.new_tokens / theirs,
                     theirs / ours, ours_ms, floor_ms, ours_ms / floor_ms, first - ours))
    print(f"\nSmolLM2-135M-Instruct fp32, greedy, {args.prompt_tokens}-token prompt, "
          f"{args.new_tokens} new tokens; weights {weight_bytes / 1e6:.0f} MB; "
          f"measured bandwidth {bandwidth:.1f} GB/s; jax {jax.__version__}, "
          f"{jax.devices()[0].platform}\n")
    print(table_header("batch", "jaxgen tok/s", "transformers tok/s", "speed-up",
                       "jaxgen ms/step", "floor ms/step", "x floor", "compile s"))
    for batch, ours_tps, hf_tps, speedup, ours_ms, floor_ms, ratio, compile_s in rows:
        print(table_row(batch, f"{ours_tps:.1f}", f"{hf_tps:.1f}", f"{speedup:.2f}x",
                        f"{ours_ms:.1f}", f"{floor_ms:.1f}", f"{ratio:.2f}", f"{compile_s:.1f}"))


if __name__ == "__main__":
    main()
