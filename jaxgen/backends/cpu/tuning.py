"""The constants tuned on CPU hosts: where each XLA:CPU path pays (measured on SmolLM2-135M,
2 vCPUs; `benchmarks/` reproduces each figure).

Example:
    >>> STACKED_KERNEL_MAX_ROWS > KERNEL_MAX_ROWS > ROWWISE_MAX_ROWS >= HEAD_BY_VOCAB_MIN_ROWS
    True
    >>> KERNEL_MAX_ROWS >= INTEL_AVX512_KERNEL_MAX_ROWS > ROWWISE_MAX_ROWS
    True
    >>> STACKED_KERNEL_MAX_ROWS > INTEL_AVX512_STACKED_NIBBLE_KERNEL_MAX_ROWS
    True
    >>> INTEL_AVX512_STACKED_NIBBLE_KERNEL_MAX_ROWS > INTEL_AVX512_STACKED_KERNEL_MAX_ROWS
    True
    >>> INTEL_AVX512_STACKED_KERNEL_MAX_ROWS > KERNEL_MAX_ROWS
    True
"""
from __future__ import annotations

# Few-row kernel (kernel_matrix.py): more rows run XLA's matrix-matrix product (16 rows: the
# kernel 1.7x faster, 32: 1.15x, on the first host).
KERNEL_MAX_ROWS = 32
# ... on Intel AVX-512 hosts (`kernels/few_rows.max_rows`), where XLA's products of more rows
# are the faster (30 SmolLM2 layers, kernel against XLA: 16 rows 43.0 vs 44.7 ms, 20 rows
# 50.2 vs 44.7, 32 rows 75.0 vs 47.2).
INTEL_AVX512_KERNEL_MAX_ROWS = 16
# A layer of a stack (the layout's quantized matrices; float32 layers have buffers of their
# own): XLA's product would first copy the layer out of the stack (a dot reads whole
# buffers; SmolLM2's 30 layers: 150-240 ms a pass), so the kernel runs further (30 float32
# layers, Zen 4: 48 rows 127 vs 221 ms, 96: 209 vs 289, 192: 343 vs 369, 256: 490 vs 474;
# SmolLM2 forwards with int8 / Q4_1 stacks, Zen 4, benchmarks/bench_quantized_rows.py: 192
# rows 483 vs 476 / 495 vs 553 ms, 256: 626 vs 574 / 678 vs 639).
STACKED_KERNEL_MAX_ROWS = 192
# ... for a layer of a quantized stack on Intel AVX-512 hosts (`quantized_rows.stacked_max_rows`),
# where XLA's product with the expanded layer overtakes the quantized kernel sooner (SmolLM2
# forwards of S rows with the cache carried, kernel against XLA,
# benchmarks/bench_quantized_rows.py: int8 64 rows 202 vs 211 ms, 80 rows 243 vs 225; GGUF
# Q4_1 96 rows 270 vs 271, 128 rows 347 vs 300; at 192 rows XLA's was 1.3-1.4x faster):
# int8 codes, and 4-bit codes (two a byte).
INTEL_AVX512_STACKED_KERNEL_MAX_ROWS = 64
INTEL_AVX512_STACKED_NIBBLE_KERNEL_MAX_ROWS = 96
# Row by row (rowwise.py): up to this many rows run one matrix-vector product each (8 rows: no
# gain).
ROWWISE_MAX_ROWS = 4
# "auto" splits stacked layer weights of at least this many bytes (smaller models' steps are
# bound by per-op overhead, not by weight reads, and keep the scan's short compile).
SPLIT_MIN_BYTES = 16 << 20
# A tied head's [D, V] copy is read by forwards of fewer rows than this; more rows read the
# embedding [V, D] itself (tied_head.py): XLA:CPU's matrix-matrix kernel runs SmolLM2's
# 49152 x 576 head 1.6-1.8x faster that way round (3 to 32 rows; 2 rows equal), while one row
# runs 1.3x faster on [D, V].
HEAD_BY_VOCAB_MIN_ROWS = 3

__all__ = ["HEAD_BY_VOCAB_MIN_ROWS", "INTEL_AVX512_KERNEL_MAX_ROWS",
           "INTEL_AVX512_STACKED_KERNEL_MAX_ROWS", "INTEL_AVX512_STACKED_NIBBLE_KERNEL_MAX_ROWS",
           "KERNEL_MAX_ROWS", "ROWWISE_MAX_ROWS",
           "SPLIT_MIN_BYTES", "STACKED_KERNEL_MAX_ROWS"]
