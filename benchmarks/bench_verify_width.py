"""The cost of a wide verify forward: batch 1, S positions with the cache carried, against S = 1.

SmolLM2-135M-Instruct, fp32, a cache already holding `--position` tokens. For each width S
the forward of S tokens (logits at every one, as speculative and tree verification need) is
timed as a median of `--repeats` with the cache carried from call to call (updated in place,
as a decode loop carries it), the widths in turns: in jaxgen's portable program (stacked
layers, the path a GPU / TPU runs), in the CPU layout `layout="auto"` picks for S rows
(per-layer weights and cache, the native few-row and decode-attention kernels where they are
built; the weights placed on huge pages as a process's third call reads them), and in
llama.cpp (an F32 GGUF written from the same weights, 2 threads) when llama-cpp-python is
installed. Ratios are to each system's own S = 1; the host line names the CPU's vector flags
and the bandwidth probe.

    python benchmarks/bench_verify_width.py [--widths 1 2 4 8 16] [--position 128] [--repeats 15]
        [--isa avx2]
"""
from __future__ import annotations

import argparse

import jax.numpy as jnp
import numpy as np
from bench_ab import host_line
from bench_speed import llama_cpp_f32_forward_seconds
from bench_trained_drafters import CarriedForward
from host_isa import add_isa_argument, isa_line, restart_for_isa
from report_table import table_header, table_row

import jaxgen
from jaxgen.backends.cpu import layer_split, prepare
from jaxgen.backends.cpu.kernel_attention import with_kernel_attention
from jaxgen.cache.layer_forms import to_layer_tuples
from jaxgen.models import DEFAULT_MODEL


def carried_forward(model, params, width: int, position: int, layout: str) -> CarriedForward:
    """A batch-1 forward of `width` tokens over a cache of `position` tokens, in `layout`."""
    if layout == "auto":  # the weights as the backend lays them out for `width` rows and
        # places them for a process that calls more than once (huge pages)
        laid_out = layer_split.for_decoding(model, params, rows=width, layout="auto")
        params = prepare.on_huge_pages(params, laid_out)
    cache = model.init_cache(1, position + width + 16)
    if isinstance(params, dict) and isinstance(params.get("layers"), (list, tuple)):
        # per-layer weights run a per-layer cache, attending through the native kernel
        cache = with_kernel_attention(to_layer_tuples(cache))
    tokens = jnp.zeros((1, width), jnp.int32)  # [1, S]
    positions = jnp.arange(position, position + width, dtype=jnp.int32)[None]  # [1, S]
    return CarriedForward(model, params, tokens, positions, cache)


def interleaved_seconds(forwards: dict, repeats: int, rounds: int = 5) -> dict:
    """{width: median seconds} with the widths timed in turns (`rounds` turns of
    repeats / rounds calls each), so a host's drift hits every width alike."""
    times = {width: [] for width in forwards}
    for _ in range(rounds):
        for width, forward in forwards.items():
            times[width] += [forward.time_once() for _ in range(max(1, repeats // rounds))]
    return {width: float(np.median(t)) for width, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--position", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=15)
    add_isa_argument(parser)
    args = parser.parse_args()
    restart_for_isa(args.isa)
    widths = sorted(set([1] + args.widths))
    model, params, _ = jaxgen.models.load(DEFAULT_MODEL)
    print(f"{host_line()}; cache holds {args.position} tokens\n{isa_line()}")
    rows = {}
    for name, layout in (("jaxgen portable (stacked)", "portable"),
                         ("jaxgen layout=auto (per-layer, kernels)", "auto")):
        forwards = {w: carried_forward(model, params, w, args.position, layout) for w in widths}
        rows[name] = interleaved_seconds(forwards, args.repeats)
        del forwards
    llama = llama_cpp_f32_forward_seconds(widths, args.position, args.repeats)
    if llama is not None:
        rows["llama.cpp F32"] = llama
    print(table_header("system", *(f"S={w}" for w in widths)))
    for name, seconds in rows.items():
        print(table_row(name, *(f"{seconds[w] * 1e3:.1f} ms ({seconds[w] / seconds[1]:.2f}x)"
                                for w in widths)))


if __name__ == "__main__":
    main()
