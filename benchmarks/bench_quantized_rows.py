"""Where a quantized layer stack's products should leave the native kernel for XLA's: the
batch-1 forward of S positions (cache carried), SmolLM2-135M with int8 or GGUF Q4_1 weights,
in the CPU layout with the stacked layers' products on the quantized kernel against the same
layout with them on XLA's product of the expanded layer, the widths and both sides timed in
turns. The host line names the CPU's vector flags; `tuning.py`'s stacked bounds come from
this table (`quantized_rows.stacked_max_rows(codes dtype)` is this host's).

    python benchmarks/bench_quantized_rows.py [--weights int8 gguf] [--widths 32 48 64 80 96 128]
"""
from __future__ import annotations

import argparse

import jax.numpy as jnp

from bench_ab import host_line
from bench_verify_width import carried_forward, interleaved_seconds
from report_table import table_header, table_row

import jaxgen
import jaxgen.backends.cpu.quantized_kernel_matrix as quantized_kernel_matrix
from jaxgen.backends.cpu.kernels.quantized_rows import stacked_max_rows
from jaxgen.models import DEFAULT_MODEL


def forwards(weights: str, widths: list[int]) -> dict:
    """{(width, side): CarriedForward}: side "kernel" (every stacked product on the quantized
    kernel) or "xla" (none), each compiled with that bound in place (read at trace time)."""
    model, params, _ = jaxgen.models.load(DEFAULT_MODEL, weights=weights)
    own = quantized_kernel_matrix.stacked_max_rows
    built = {}
    try:
        for width in widths:
            for side, bound in (("kernel", max(widths)), ("xla", 0)):
                quantized_kernel_matrix.stacked_max_rows = lambda _codes, bound=bound: bound
                built[(width, side)] = carried_forward(model, params, width, 128, "auto")
    finally:
        quantized_kernel_matrix.stacked_max_rows = own
    return built


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", nargs="+", default=["int8", "gguf"])
    parser.add_argument("--widths", type=int, nargs="+", default=[32, 48, 64, 80, 96, 128])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    print(f"{host_line()}; this host's stacked bounds: int8 {stacked_max_rows(jnp.int8)} "
          f"rows, 4-bit {stacked_max_rows(jnp.uint8)} rows")
    print(table_header("weights", *(f"S={w}" for w in args.widths)))
    for weights in args.weights:
        seconds = interleaved_seconds(forwards(weights, args.widths), args.repeats)
        print(table_row(weights, *(
            f"{seconds[(w, 'kernel')] * 1e3:.0f} / {seconds[(w, 'xla')] * 1e3:.0f} ms "
            f"({seconds[(w, 'xla')] / seconds[(w, 'kernel')]:.2f}x)" for w in args.widths)))
    print("cells: kernel / XLA's product of the expanded layer (XLA / kernel)")


if __name__ == "__main__":
    main()
