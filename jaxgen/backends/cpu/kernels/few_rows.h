// Shared pieces of the few-row kernels (few_rows.cc: float32 weights; quantized_rows.cc:
// int8 and GGUF block weights): float tiles over a few input rows, the one- and two-row
// streaming path, and the driver that splits weight rows into blocks across XLA's thread pool.
#pragma once
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace jaxgen_rows {

typedef float v8 __attribute__((vector_size(32)));  // 8 floats; AVX where the CPU has it
#ifdef __AVX512F__
typedef float v16 __attribute__((vector_size(64)));  // 16 floats: one AVX-512 register
// The widest vector of the build (the prefill-attention kernel's tiles); the few-row tiles
// choose theirs at run time (`tiles_in_16_lanes`).
typedef v16 TileVector;
#else
typedef v8 TileVector;
#endif

constexpr int BLOCK_ROWS = 64;     // weight rows a claimed block covers
#ifdef __AVX512F__
constexpr int REGISTERS = 32;      // vector registers (AVX-512 gives 32 to 8-float vectors too)
#else
constexpr int REGISTERS = 16;
#endif
constexpr int GROUP_ROWS = REGISTERS >= 32 ? 8 : 4;  // input rows that share one weight pass
// Twice as many input rows can share a pass as well, in tiles of one weight row (16 sums with
// 32 registers, 8 with 16; the inputs read from L1 by the products themselves): on Intel
// hosts only (`wide_row_passes`).
constexpr int WIDE_ROWS = REGISTERS >= 32 ? 16 : 8;
// How many tiles ahead the weight rows are prefetched, into every cache level: a
// non-temporal prefetch made 3 to 8 rows 2.3-2.5x slower on an Intel AVX-512 host (30 SmolLM2
// layers, 8 rows: 55 against 22 ms; no prefetch: 30 ms).
constexpr int PREFETCH_TILES = 2;
// The most bytes of input rows a pass reads along K at once: longer rows are walked in parts
// of K (each part's sums added into y), so a pass's inputs stay in L1 beside the weight
// stream. SmolLM2's down projection (K = 1536), 30 layers, with the balanced blocks of
// block_rows_for: AVX-512 build at 16 rows 8.3-9.2 -> 5.4-6.2 ms (16 rows of K = 576 stay one
// part: parts of 288 were slower).
constexpr int64_t INPUT_BYTES = 40 << 10;

// The lanes of a float vector (8 or 16 lanes) summed in lane order.
template <typename V>
inline float sum_lanes(V v) {
  float total = 0.0f;
  for (int lane = 0; lane < static_cast<int>(sizeof(V) / sizeof(float)); ++lane) total += v[lane];
  return total;
}

// The lanes of a float vector (8 or 16 lanes) summed as a tree: halves added until one lane
// is left (3 or 4 dependent adds against sum_lanes' 7 or 15; a tile reduces ROWS * COLS sums
// a few hundred products long, where the lane-order sum cost as much as the products).
inline float tree_sum(v8 v) {
  typedef float v4 __attribute__((vector_size(16)));
  v4 low, high;  // halves by memcpy, which GCC 11 and clang read as register moves
  std::memcpy(&low, &v, sizeof(v4));
  std::memcpy(&high, reinterpret_cast<const char*>(&v) + sizeof(v4), sizeof(v4));
  const v4 four = low + high;
  return (four[0] + four[2]) + (four[1] + four[3]);
}
#ifdef __AVX512F__
// The low and high 8 lanes of a 16-lane vector, by register moves: halves copied out by
// memcpy kept a 16-lane tile's accumulators in memory (GCC 12: loaded and stored around
// every product).
inline v8 low_half(v16 v) { return (v8)_mm512_castps512_ps256((__m512)v); }
inline v8 high_half(v16 v) {
  return (v8)_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd((__m512)v), 1));
}
inline float tree_sum(v16 v) { return tree_sum(low_half(v) + high_half(v)); }
#endif

// ROWS input rows x COLS weight rows (rows `stride` floats apart): ROWS * COLS dot products
// of length k, in vectors V, written to y (add: added to what y holds).
template <typename V, int ROWS, int COLS>
inline void tile(const float* x, int64_t stride, int64_t k, const float* w, float* y, int64_t n,
                 const float* w_end, bool add) {
  constexpr int LANES = sizeof(V) / sizeof(float);
  // where the sums and every input row's vector would overflow the registers, the weight
  // vectors are loaded first and each input vector once, for its COLS products
  constexpr bool WEIGHTS_FIRST = COLS > 1 && ROWS * COLS + ROWS + 1 > REGISTERS;
  V acc[ROWS][COLS];
  _Pragma("GCC unroll 16") for (int r = 0; r < ROWS; ++r)
    _Pragma("GCC unroll 16") for (int c = 0; c < COLS; ++c) acc[r][c] = V{};
  const int64_t k_vectors = k - k % LANES;
  for (int64_t i = 0; i < k_vectors; i += LANES) {
    _Pragma("GCC unroll 16") for (int c = 0; c < COLS; ++c) {
      const float* ahead = w + (c + PREFETCH_TILES * COLS) * stride + i;
      if (ahead < w_end) __builtin_prefetch(ahead, 0, 3);  // into every level (T0)
    }
    if constexpr (WEIGHTS_FIRST) {
      V wv[COLS];
      _Pragma("GCC unroll 16") for (int c = 0; c < COLS; ++c)
        std::memcpy(&wv[c], w + c * stride + i, sizeof(V));
      _Pragma("GCC unroll 16") for (int r = 0; r < ROWS; ++r) {
        V xv;
        std::memcpy(&xv, x + r * stride + i, sizeof(V));
        // kept in a register: GCC would read it from memory again in each of its products
#ifdef __AVX512F__
        asm("" : "+v"(xv));
#else
        asm("" : "+x"(xv));
#endif
        _Pragma("GCC unroll 16") for (int c = 0; c < COLS; ++c) acc[r][c] += xv * wv[c];
      }
    } else {
      V xv[ROWS];
      _Pragma("GCC unroll 16") for (int r = 0; r < ROWS; ++r)
        std::memcpy(&xv[r], x + r * stride + i, sizeof(V));
      _Pragma("GCC unroll 16") for (int c = 0; c < COLS; ++c) {
        V wv;
        std::memcpy(&wv, w + c * stride + i, sizeof(V));
        _Pragma("GCC unroll 16") for (int r = 0; r < ROWS; ++r) acc[r][c] += xv[r] * wv;
      }
    }
  }
  _Pragma("GCC unroll 16") for (int r = 0; r < ROWS; ++r)
    _Pragma("GCC unroll 16") for (int c = 0; c < COLS; ++c) {
      float total = tree_sum(acc[r][c]);
      for (int64_t i = k_vectors; i < k; ++i) total += x[r * stride + i] * w[c * stride + i];
      y[r * n + c] = add ? y[r * n + c] + total : total;
    }
}

// One or two input rows: each weight row is read whole before the next (the block is one
// linear stream, which the hardware prefetcher follows; software prefetches measured slower
// here), with ACCUMULATORS independent sums per input row.
template <int ROWS>
void stream_rows(const float* x, int64_t k, const float* w, float* y, int64_t n, int64_t begin,
                 int64_t end) {
  constexpr int ACCUMULATORS = 4;
  constexpr int STEP = 8 * ACCUMULATORS;  // floats of a weight row per iteration
  const int64_t k_steps = k - k % STEP;
  for (int64_t col = begin; col < end; ++col) {
    const float* row = w + col * k;
    v8 acc[ROWS][ACCUMULATORS];
    _Pragma("GCC unroll 16") for (int r = 0; r < ROWS; ++r)
      _Pragma("GCC unroll 16") for (int a = 0; a < ACCUMULATORS; ++a) acc[r][a] = v8{};
    for (int64_t i = 0; i < k_steps; i += STEP) {
      v8 wv[ACCUMULATORS];
      _Pragma("GCC unroll 16") for (int a = 0; a < ACCUMULATORS; ++a)
        std::memcpy(&wv[a], row + i + 8 * a, sizeof(v8));
      _Pragma("GCC unroll 16") for (int r = 0; r < ROWS; ++r)
        _Pragma("GCC unroll 16") for (int a = 0; a < ACCUMULATORS; ++a) {
          v8 xv;
          std::memcpy(&xv, x + r * k + i + 8 * a, sizeof(v8));
          acc[r][a] += xv * wv[a];
        }
    }
    _Pragma("GCC unroll 16") for (int r = 0; r < ROWS; ++r) {
      v8 sum = acc[r][0];
      _Pragma("GCC unroll 16") for (int a = 1; a < ACCUMULATORS; ++a) sum += acc[r][a];
      float total = sum_lanes(sum);
      for (int64_t i = k_steps; i < k; ++i) total += x[r * k + i] * row[i];
      y[r * n + col] = total;
    }
  }
}

// Whether the CPU is an Intel one (asked once, at run time).
inline bool intel_host() {
  static const bool intel = (__builtin_cpu_init(), __builtin_cpu_is("intel"));
  return intel;
}

// Whether this is an AVX-512 build running on an Intel CPU: the settings below were measured
// faster there; AMD hosts keep the ones measured on them.
inline bool intel_avx512_host() {
#ifdef __AVX512F__
  return intel_host();
#else
  return false;
#endif
}

// Whether the tiles multiply in vectors of 16 lanes rather than 8: on Intel AVX-512 hosts,
// half the instructions (30 SmolLM2 layers, 2 / 4 / 8 / 16 rows: 18.8 / 21.5 / 25.3 / 33.8 ms
// against 19.9 / 22.7 / 26.3 / 37.6 in 8 lanes), not on AMD ones, whose cores run a 16-lane
// operation as two halves (Zen 4: a batch-8 decode step 48.5 ms in 16 lanes against 40.9 in
// 8, benchmarks/bench_ab.py).
inline bool tiles_in_16_lanes() { return intel_avx512_host(); }

// Whether WIDE_ROWS input rows share a pass, for weights `streamed` from memory or (false) held
// in L1 (the quantized kernel's expanded rows). On Intel AVX-512 hosts (30 SmolLM2 layers at 16
// rows: 31.8 ms against 34.7 as two groups of 8), not on AMD ones (Zen 4: a 16 / 32-token
// prompt's call 62-63 / 98-101 ms against 48 / 76-83 in groups of 8). AVX2 builds on Intel
// hosts: for streamed weights only (a batch-8 decode step 36.7 against 39.1 ms in groups of 4,
// benchmarks/bench_ab.py; weights in L1 run 8 rows at 102 against 56 GFLOP/s a thread in
// groups of 4 x 3 tiles); AMD AVX2 hosts keep the 4-row groups measured on a Zen 1.
inline bool wide_row_passes(bool streamed) {
  return REGISTERS >= 32 ? intel_avx512_host() : intel_host() && streamed;
}

// Whether two input rows run the tiles rather than the streaming path: on Intel hosts (30
// SmolLM2 layers, two rows: AVX-512 build tiles 19.2-19.7 ms, streaming 21.8-23.9, one row
// level at 18.6-19.9; AVX2 build 20.0-20.1 against 23.5-23.7, one row 19.8-20.1), not on AMD
// ones, where the streaming path was measured the faster.
inline bool two_rows_by_tiles() { return intel_host(); }

// One block a thread: n weight rows over `threads` (fewer than 1: one) in whole tiles of up to
// 8 rows.
inline int64_t contiguous_share(int64_t n, int64_t threads) {
  threads = std::max<int64_t>(threads, 1);
  const int64_t share = (n + threads - 1) / threads;
  return std::max<int64_t>((share + 7) / 8 * 8, 8);
}

// Weight rows a claimed block of an n-row weight covers with `threads` threads: on Intel
// hosts one contiguous share a thread, so each thread's reads are one long stream (AVX-512
// build, 60 SmolLM2 layers from memory, 1 / 2 / 4 / 8 rows: 32.6-33.1 / 29.6-30.3 / 32.4-32.6 /
// 37.7-40.0 ms against 34.9-35.4 / 33.3-33.5 / 36.3-36.4 / 41.7-42.5 with 64-row blocks;
// 32- or 16-row blocks slower still; AVX2 build, 30 layers, 1 / 8 / 16 rows: 20.3-20.5 /
// 25.1-25.3 / 36.9-37.3 against 20.8-21.1 / 26.1-26.7 / 38.4-39.3). Elsewhere BLOCK_ROWS or
// fewer (down to 32, whole tiles), whichever leaves the busiest thread the fewest rows: 576
// rows on 2 threads as 12 blocks of 48, not 9 of 64 (one thread 5 blocks, the other 4; see
// INPUT_BYTES).
inline int64_t block_rows_for(int64_t n, int64_t threads) {
  threads = std::max<int64_t>(threads, 1);
  if (!intel_host()) {
    int64_t best = BLOCK_ROWS, best_load = INT64_MAX;
    for (int64_t rows = BLOCK_ROWS; rows >= 32; rows -= 8) {
      const int64_t load = ((n + rows - 1) / rows + threads - 1) / threads * rows;
      if (load < best_load) best = rows, best_load = load;
    }
    return best;
  }
  return contiguous_share(n, threads);
}

// The weight rows of a tile of ROWS input rows. 16 registers: 2 for 2 rows, 4 for 3, 3 for 4
// (12 sums, where 4 x 2 had 8 dependent chains; AVX2 build on an Intel host, one thread, 4
// rows against weights held in L2: 91 against 62 GFLOP/s; 2 x 4 was faster in L2 but up to 8%
// slower from memory, where two rows run), 1 for 8 (the wide passes). 32 registers: 4 weight
// rows up to 4 rows, 2 up to 10 (sums and operands within the registers), then 1 (the inputs
// read by the products themselves).
template <int ROWS>
constexpr int tile_cols() {
  if constexpr (REGISTERS == 16) return ROWS == 3 ? 4 : ROWS == 4 ? 3 : ROWS > 4 ? 1 : 2;
  return ROWS * 3 + 2 > REGISTERS ? 1 : ROWS <= 4 ? 4 : 2;
}

// Input rows [0, ROWS) against the weight rows from col on, in tiles of COLS weight rows while
// COLS are left; returns the first weight row not done.
template <typename V, int ROWS, int COLS>
inline int64_t tile_columns(const float* x, int64_t stride, int64_t len, const float* w, float* y,
                            int64_t n, int64_t col, int64_t end, const float* w_end, bool add) {
  for (; col + COLS <= end; col += COLS)
    tile<V, ROWS, COLS>(x, stride, len, w + col * stride, y + col, n, w_end, add);
  return col;
}

// Input rows [0, ROWS) against weight rows [begin, end) in vectors V: tiles of tile_cols()
// weight rows (the last ones in tiles of half as many, then of one); K in parts of at most
// INPUT_BYTES of input rows (whole vectors).
template <typename V, int ROWS>
void tiled_rows_in(const float* x, int64_t k, const float* w, float* y, int64_t n,
                   int64_t begin, int64_t end, const float* w_end) {
  constexpr int COLS = tile_cols<ROWS>();
  constexpr int LANES = sizeof(V) / sizeof(float);
  const int64_t parts = (ROWS * k * 4 + INPUT_BYTES - 1) / INPUT_BYTES;
  const int64_t part = ((k + parts - 1) / parts + LANES - 1) / LANES * LANES;
  for (int64_t start = 0; start < k; start += part) {
    const int64_t len = std::min(part, k - start);
    const bool add = start > 0;
    const float* xs = x + start;
    const float* ws = w + start;
    int64_t col = tile_columns<V, ROWS, COLS>(xs, k, len, ws, y, n, begin, end, w_end, add);
    if constexpr (COLS > 3)
      col = tile_columns<V, ROWS, COLS / 2>(xs, k, len, ws, y, n, col, end, w_end, add);
    for (; col < end; ++col)
      tile<V, ROWS, 1>(xs, k, len, ws + col * k, y + col, n, w_end, add);
  }
}

// Input rows [0, ROWS) against weight rows [begin, end), in this host's tile vectors.
template <int ROWS>
void tiled_rows(const float* x, int64_t k, const float* w, float* y, int64_t n,
                int64_t begin, int64_t end, const float* w_end) {
#ifdef __AVX512F__
  if (tiles_in_16_lanes()) return tiled_rows_in<v16, ROWS>(x, k, w, y, n, begin, end, w_end);
#endif
  tiled_rows_in<v8, ROWS>(x, k, w, y, n, begin, end, w_end);
}

// Input rows [0, ROWS) against weight rows [begin, end).
template <int ROWS>
void weight_rows(const float* x, int64_t k, const float* w, float* y, int64_t n,
                 int64_t begin, int64_t end, const float* w_end) {
  if constexpr (ROWS == 2) {
    if (two_rows_by_tiles())
      tiled_rows<2>(x, k, w, y, n, begin, end, w_end);
    else
      stream_rows<2>(x, k, w, y, n, begin, end);
  } else if constexpr (ROWS == 1) {
    stream_rows<1>(x, k, w, y, n, begin, end);
  } else {
    tiled_rows<ROWS>(x, k, w, y, n, begin, end, w_end);
  }
}

// Input rows [0, m) against weight rows [begin, end); streamed: whether the weights come from
// memory (false: rows the caller holds in L1, see wide_row_passes).
inline void block(const float* x, int64_t m, int64_t k, const float* w, float* y, int64_t n,
                  int64_t begin, int64_t end, bool streamed = true) {
  if (m > GROUP_ROWS && end - begin > BLOCK_ROWS) {
    // several passes read each weight row: BLOCK_ROWS rows at a time, so the passes after
    // the first read them from L1 / L2, not again from memory (a whole share a thread on
    // Intel AVX-512 hosts is megabytes: 30 layers at 16 rows in two groups of 8, 37.2 ms
    // against 39.3)
    for (int64_t part = begin; part < end; part += BLOCK_ROWS)
      block(x, m, k, w, y, n, part, std::min(part + BLOCK_ROWS, end), streamed);
    return;
  }
  const float* w_end = w + n * k;
  int64_t row = 0;
  if (wide_row_passes(streamed))
    for (; row + WIDE_ROWS <= m; row += WIDE_ROWS)
      tiled_rows<WIDE_ROWS>(x + row * k, k, w, y + row * n, n, begin, end, w_end);
  for (; row + GROUP_ROWS <= m; row += GROUP_ROWS)
    weight_rows<GROUP_ROWS>(x + row * k, k, w, y + row * n, n, begin, end, w_end);
  const float* xr = x + row * k;
  float* yr = y + row * n;
  switch (m - row) {  // with 4-row groups cases 4..7 never occur (the modulo keeps them valid)
    case 7: weight_rows<7 % GROUP_ROWS>(xr, k, w, yr, n, begin, end, w_end); break;
    case 6: weight_rows<6 % GROUP_ROWS>(xr, k, w, yr, n, begin, end, w_end); break;
    case 5: weight_rows<5 % GROUP_ROWS>(xr, k, w, yr, n, begin, end, w_end); break;
    case 4: weight_rows<4>(xr, k, w, yr, n, begin, end, w_end); break;
    case 3: weight_rows<3>(xr, k, w, yr, n, begin, end, w_end); break;
    case 2: weight_rows<2>(xr, k, w, yr, n, begin, end, w_end); break;
    case 1: weight_rows<1>(xr, k, w, yr, n, begin, end, w_end); break;
    default: break;
  }
}

// Runs body(begin, end) over [0, n) in blocks of `block_size` items (BLOCK_ROWS weight rows
// unless told) that the calling thread and tasks on XLA's intra-op thread pool claim from one
// atomic counter; the caller
// waits only for blocks another thread has claimed, so a busy or missing pool slows the call
// but never blocks it.
struct Blocks {
  std::function<void(int64_t, int64_t)> body;
  int64_t n, blocks, block_size;
  std::atomic<int64_t> next{0};      // the next unclaimed block
  std::atomic<int64_t> finished{0};  // blocks done
};

inline void drain(Blocks& s) {
  for (int64_t b = s.next.fetch_add(1); b < s.blocks; b = s.next.fetch_add(1)) {
    int64_t begin = b * s.block_size, end = std::min(begin + s.block_size, s.n);
    s.body(begin, end);
    s.finished.fetch_add(1, std::memory_order_release);
  }
}

inline void run_blocks(xla::ffi::ThreadPool& pool, int64_t n,
                       std::function<void(int64_t, int64_t)> body,
                       int64_t block_size = BLOCK_ROWS) {
  auto shared = std::make_shared<Blocks>();
  shared->body = std::move(body);
  shared->n = n;
  shared->block_size = block_size;
  shared->blocks = (n + block_size - 1) / block_size;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), shared->blocks) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([shared] { drain(*shared); });
  drain(*shared);
  // Every block is claimed; wait for the ones other threads are still running.
  while (shared->finished.load(std::memory_order_acquire) < shared->blocks)
    std::this_thread::yield();
}

// x[0..n) as int16 codes out[i] = round(x[i] / step), step = max |x| / 32767, for the integer
// paths (decode_attention.cc's query rows, quantized_rows.cc's 32-input blocks); returns step
// (0 for zeros), or -1 where x holds a NaN or an infinity (the float path serves it).
inline float round_to_int16(const float* x, int64_t n, int16_t* out) {
  float high = 0.0f;
  for (int64_t i = 0; i < n; ++i) high = std::max(high, std::fabs(x[i]));
  if (!std::isfinite(high) || std::isnan(high)) return -1.0f;
  const float inverse = high > 0.0f ? 32767.0f / high : 0.0f;
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<int16_t>(std::lrint(x[i] * inverse));
  return high / 32767.0f;
}

}  // namespace jaxgen_rows
