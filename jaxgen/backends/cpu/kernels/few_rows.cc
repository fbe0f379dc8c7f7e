// y[M, N] = x[M, K] @ w[N, K]^T in float32 for a few rows M, reading w once from memory.
//
// XLA:CPU's matrix-matrix kernels pack the weight before they multiply, which for a handful of
// rows costs more than the arithmetic; this kernel streams each weight row (K contiguous
// floats, the [N, K] layout) once per group of up to GROUP_ROWS input rows (4, or 8 where
// AVX-512 gives 32 vector registers for the tile's accumulators; on Intel hosts twice as
// many, few_rows.h's wide_row_passes), with every later group reading it again from the
// L1/L2 cache, so M rows cost little more than one.
//
// One input row takes another path, and two rows too except on Intel hosts
// (few_rows.h, two_rows_by_tiles): each weight row read whole, one linear stream (SmolLM2's
// 30 layers and head, one row: 26 -> 19-21 ms on a Zen 4 host, two rows 28 -> 24).
//
// The tiles, the streaming path and the thread-pool driver live in few_rows.h.
#include "few_rows.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxgen_rows;

// w: one weight [N, K], or a stack [L, N, K] of which `layer` is read.
ffi::Error FewRowsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                       ffi::ResultBuffer<ffi::F32> y, int64_t layer) {
  auto x_dims = x.dimensions();
  auto w_dims = w.dimensions();
  const size_t rank = w_dims.size();
  if ((rank != 2 && rank != 3) || x_dims.size() < 1 || x_dims.back() != w_dims[rank - 1])
    return ffi::Error::InvalidArgument("few_rows: x [..., K] and w [N, K] or [L, N, K] expected");
  const int64_t layers = rank == 3 ? w_dims[0] : 1;
  if (layer < 0 || layer >= layers)
    return ffi::Error::InvalidArgument("few_rows: layer outside the weight stack");
  const int64_t k = w_dims[rank - 1], n = w_dims[rank - 2];
  const int64_t m = k ? static_cast<int64_t>(x.element_count()) / k : 0;
  const float* xs = x.typed_data();
  const float* ws = w.typed_data() + layer * n * k;
  float* ys = y->typed_data();
  if (m == 0 || n == 0) return ffi::Error::Success();
  if (k == 0) {
    std::fill(ys, ys + m * n, 0.0f);
    return ffi::Error::Success();
  }
  run_blocks(pool, n, [=](int64_t begin, int64_t end) { block(xs, m, k, ws, ys, n, begin, end); },
             block_rows_for(n, pool.num_threads()));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgenFewRows, FewRowsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("layer"));

// The input rows one weight pass serves (4, or 8 with AVX-512), for the Python side's reports
// (`few_rows.group_rows`).
extern "C" int JaxgenFewRowsGroupRows() { return GROUP_ROWS; }

// Whether this is an AVX-512 build on an Intel CPU (few_rows.h), for the Python side's
// per-host choices (`build.intel_avx512_host`).
extern "C" int JaxgenFewRowsIntelAvx512() { return intel_avx512_host() ? 1 : 0; }
