"""Native CPU kernels that XLA:CPU calls through its FFI (built from source on first use).

`few_rows.few_rows_product(x, w_nk)`: x [..., K] @ w_nk[N, K]^T for a few rows, reading the
weight once (see `few_rows.cc`); `build.ffi_target()` compiles and registers it.
"""
