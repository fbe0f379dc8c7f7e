// Causal attention of many query positions (a prefill, a long chunk of one) over one layer of
// a heads-major KV cache (float32, or int8 codes with group scales), as tiles of matrix
// products with an online softmax.
//
//   q     [B, S, H, D]   float32 queries (H = G * Hkv query heads, G per KV head)
//   k, v  [B, Hkv, T, D] float32 keys and values (slot j holds position j), or int8 codes
//                        with per-token group scales k_scale [B, Hkv, T, Nk], v_scale
//                        [B, Hkv, T, Nv] (an int8 cache: widened and scaled once a call, as
//                        the keys are transposed)
//   pos   [B, S]         int32 position of each query; key j is visible to it iff
//                        j <= pos and (window <= 0 or pos - j < window): a contiguous range
//   out   [B, S, H, D]   float32 softmax(scale * q . k) . v over the visible keys (0: none)
//
// XLA:CPU runs a long causal forward as loops of batched products, softmax pieces and
// copies between them (SmolLM2's 30 layers at 512 positions: 189 ms, 48 here; Intel AVX-512,
// 2 threads). Here each unit of work (one row, one KV head, about TARGET_ROWS query rows: the G
// heads of a group at consecutive positions) walks the key chunks its rows can see: the
// scores of ROW_TILE rows x CHUNK keys stay in registers over the head dimension (keys
// transposed once a call, chunk by chunk, so a chunk's key channels are contiguous), their
// online softmax runs in vectors, and the weights times the chunk's values accumulate into
// the rows' outputs, ROW_TILE rows x 4 vectors of channels at a time. Only the chunks on a
// row tile's causal edge (or its sliding window's) are masked.
#include <cmath>
#include <limits>
#include <memory>
#include <new>
#include <vector>

#include "attention_ffi.h"
#include "few_rows.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxgen_rows;

typedef TileVector V;                                    // 16 lanes on AVX-512, else 8
constexpr int LANES = sizeof(V) / sizeof(float);
typedef uint32_t UV __attribute__((vector_size(sizeof(V))));  // bit patterns of V's lanes
constexpr int CHUNK_VECTORS = 4;                         // a chunk's keys, in vectors
constexpr int CHUNK = CHUNK_VECTORS * LANES;             // keys a chunk (64 / 32)
constexpr int ROW_TILE = REGISTERS >= 32 ? 6 : 3;        // 24 / 12 accumulators
constexpr int64_t TARGET_ROWS = 192;                     // query rows a unit, about
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
constexpr float SHIFT_MARGIN = 8.0f;

// e^x lane by lane for x <= 88 (a few ulp; -inf gives exactly 0, below -80 as e^-80; the
// lazy reference max keeps x <= SHIFT_MARGIN): 2^n e^f with n = round(x / ln 2) read from the
// low bits of x / ln 2 + 1.5 * 2^23 (no conversions), e^f by a degree-6 polynomial (minimax
// coefficients, as decode_attention.cc's), and 2^n added to e^f's exponent bits (-116 <= n
// <= 127: no underflow, no overflow).
inline V exp_lanes(V given) {
  const V lowest = V{} - 80.0f;
  const V x = given < lowest ? lowest : given;
  const V shifter = V{} + 12582912.0f;                   // 1.5 * 2^23
  const V scaled = x * 1.44269504088896341f + shifter;   // n in the low mantissa bits
  const V nf = scaled - shifter;
  const V f = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  V p = f * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * f + 8.3334519073e-3f;
  p = p * f + 4.1665795894e-2f;
  p = p * f + 1.6666665459e-1f;
  p = p * f + 5.0000001201e-1f;
  const V e = p * f * f + f + 1.0f;
  UV e_bits, n_bits;
  std::memcpy(&e_bits, &e, sizeof(V));
  std::memcpy(&n_bits, &scaled, sizeof(V));
  e_bits += n_bits << 23;                  // bits(scaled) << 23 == n << 23 (mod 2^32)
  V out;
  std::memcpy(&out, &e_bits, sizeof(V));
  return given == NEG_INF ? V{} : out;                   // masked keys weigh exactly 0
}

// The largest lane, as a tree: halves compared until one lane is left (a lane-order walk is
// a chain of 15 dependent compares a row and chunk).
inline float max_lanes(V v) {
  typedef float v4 __attribute__((vector_size(16)));
#ifdef __AVX512F__  // V is 16 lanes: its halves first (few_rows.h, by register moves)
  const v8 low = low_half(v), high = high_half(v);
  const v8 eight = low > high ? low : high;
#else
  const v8 eight = v;
#endif
  v4 a, c;
  std::memcpy(&a, &eight, sizeof(v4));
  std::memcpy(&c, reinterpret_cast<const char*>(&eight) + sizeof(v4), sizeof(v4));
  const v4 four = a > c ? a : c;
  return std::max(std::max(four[0], four[2]), std::max(four[1], four[3]));
}

struct Problem {
  int64_t batch, seq, heads, kv_heads, group, keys, dim;
  const float* q;
  const float* k;           // float32 keys and values, or nullptr
  const float* v;
  const int8_t* k_codes;    // int8 codes with per-token group scales, or nullptr
  const int8_t* v_codes;
  const float* k_scale;     // [B, Hkv, T, key_groups]
  const float* v_scale;     // [B, Hkv, T, value_groups]
  int64_t key_groups, value_groups;
  float* values_f;          // [B, Hkv, chunks * CHUNK, D]: int8 values widened (codes only)
  const int32_t* pos;
  int64_t window;
  float scale;
  int64_t reach;          // keys any query sees: [0, reach)
  int64_t chunks;         // CHUNK-key chunks covering [0, reach)
  int64_t query_rows;     // query positions a unit covers
  int64_t blocks;         // units a (row, KV head)
  float* keys_t;          // [B, Hkv, chunks, D, CHUNK]: each chunk's keys transposed
  float* out;
};

// The keys of (b, h)'s chunk c transposed into [D][CHUNK] (zeros past the last key); int8
// codes are widened and scaled on the way, and their values widened into values_f.
void transpose_chunk(const Problem& p, int64_t bh, int64_t c) {
  const int64_t D = p.dim, first = bh * p.keys + c * CHUNK;
  float* out = p.keys_t + (bh * p.chunks + c) * D * CHUNK;
  const int64_t count = std::min<int64_t>(CHUNK, p.reach - c * CHUNK);
  if (p.k) {
    const float* rows = p.k + first * D;
    for (int64_t j = 0; j < count; ++j)
      for (int64_t d = 0; d < D; ++d) out[d * CHUNK + j] = rows[j * D + d];
  } else {
    const int64_t key_width = D / p.key_groups, value_width = D / p.value_groups;
    for (int64_t j = 0; j < count; ++j) {
      const int8_t* codes = p.k_codes + (first + j) * D;
      const float* scales = p.k_scale + (first + j) * p.key_groups;
      for (int64_t d = 0; d < D; ++d) out[d * CHUNK + j] = codes[d] * scales[d / key_width];
      const int8_t* value_codes = p.v_codes + (first + j) * D;
      const float* value_scales = p.v_scale + (first + j) * p.value_groups;
      float* values = p.values_f + (bh * p.chunks * CHUNK + c * CHUNK + j) * D;
      for (int64_t d = 0; d < D; ++d) values[d] = value_codes[d] * value_scales[d / value_width];
    }
  }
  for (int64_t j = count; j < CHUNK; ++j)
    for (int64_t d = 0; d < D; ++d) out[d * CHUNK + j] = 0.0f;
}

// scores[r][0..CHUNK) = q_rows[r] . keys (transposed [D][CHUNK]), ROWS rows.
template <int ROWS>
inline void score_tile(const float* q_rows, int64_t D, const float* keys_t, float* scores) {
  V acc[ROWS][CHUNK_VECTORS];
  _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; ++r)
    _Pragma("GCC unroll 4") for (int c = 0; c < CHUNK_VECTORS; ++c) acc[r][c] = V{};
  for (int64_t d = 0; d < D; ++d) {
    V key[CHUNK_VECTORS];
    _Pragma("GCC unroll 4") for (int c = 0; c < CHUNK_VECTORS; ++c)
      std::memcpy(&key[c], keys_t + d * CHUNK + c * LANES, sizeof(V));
    _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; ++r) {
      const float query = q_rows[r * D + d];
      _Pragma("GCC unroll 4") for (int c = 0; c < CHUNK_VECTORS; ++c) acc[r][c] += query * key[c];
    }
  }
  _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; ++r)
    _Pragma("GCC unroll 4") for (int c = 0; c < CHUNK_VECTORS; ++c)
      std::memcpy(scores + r * CHUNK + c * LANES, &acc[r][c], sizeof(V));
}

// out[r][0..NV vectors of W) += weights[r][0..count) . values[0..count)[0..NV vectors), ROWS
// rows; values (and out) rows D floats apart, weights rows CHUNK apart.
template <int ROWS, int NV, typename W>
inline void value_tile(const float* weights, int64_t count, const float* values, int64_t D,
                       float* out) {
  constexpr int WL = sizeof(W) / sizeof(float);
  W acc[ROWS][NV];
  _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; ++r)
    _Pragma("GCC unroll 4") for (int c = 0; c < NV; ++c)
      std::memcpy(&acc[r][c], out + r * D + c * WL, sizeof(W));
  for (int64_t j = 0; j < count; ++j) {
    W value[NV];
    _Pragma("GCC unroll 4") for (int c = 0; c < NV; ++c)
      std::memcpy(&value[c], values + j * D + c * WL, sizeof(W));
    _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; ++r) {
      const float weight = weights[r * CHUNK + j];
      _Pragma("GCC unroll 4") for (int c = 0; c < NV; ++c) acc[r][c] += weight * value[c];
    }
  }
  _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; ++r)
    _Pragma("GCC unroll 4") for (int c = 0; c < NV; ++c)
      std::memcpy(out + r * D + c * WL, &acc[r][c], sizeof(W));
}

// value_tile over all D channels: 4 vectors at a time, then the rest (D a multiple of 8).
template <int ROWS>
inline void value_rows(const float* weights, int64_t count, const float* values, int64_t D,
                       float* out) {
  int64_t d = 0;
  for (; d + 4 * LANES <= D; d += 4 * LANES)
    value_tile<ROWS, 4, V>(weights, count, values + d, D, out + d);
  switch ((D - d) / LANES) {
    case 3: value_tile<ROWS, 3, V>(weights, count, values + d, D, out + d); break;
    case 2: value_tile<ROWS, 2, V>(weights, count, values + d, D, out + d); break;
    case 1: value_tile<ROWS, 1, V>(weights, count, values + d, D, out + d); break;
    default: break;
  }
  d += (D - d) / LANES * LANES;
  if constexpr (LANES > 8) {
    if (d < D) value_tile<ROWS, 1, v8>(weights, count, values + d, D, out + d);
  }
}

// Row state of a unit: the rows' visible key ranges [lo, hi), running max, sum and output.
struct Rows {
  std::vector<float> q;       // [R, D] queries times scale
  std::vector<float> out;     // [R, D] unnormalized outputs
  std::vector<float> high;    // [R] running max score
  std::vector<float> total;   // [R] running sum of weights
  std::vector<int64_t> lo, hi;
};

// ROWS rows (from `first`) against chunk c: scores, mask, online softmax, values.
template <int ROWS>
void rows_chunk(const Problem& p, int64_t bh, int64_t c, Rows& s, int64_t first) {
  const int64_t D = p.dim, begin = c * CHUNK;
  const int64_t count = std::min<int64_t>(CHUNK, p.reach - begin);
  alignas(64) float scores[ROWS * CHUNK];
  score_tile<ROWS>(s.q.data() + first * D, D, p.keys_t + (bh * p.chunks + c) * D * CHUNK,
                   scores);
  bool edge = false;                            // a row sees part of the chunk only
  _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; ++r)
    edge |= s.lo[first + r] > begin || s.hi[first + r] < begin + CHUNK;
  if (edge)
    for (int r = 0; r < ROWS; ++r) {
      const int64_t lo = s.lo[first + r] - begin, hi = s.hi[first + r] - begin;
      float* row = scores + r * CHUNK;
      for (int64_t j = 0; j < CHUNK; ++j)
        if (j < lo || j >= hi) row[j] = NEG_INF;
    }
  // Every row's step of the online softmax side by side (independent chains, no branches
  // but the rare rescale). A row's reference max moves only when a score passes it by more
  // than SHIFT_MARGIN (weights up to e^8 before the final division), so most chunks after
  // the first rescale nothing; a row that has seen no key keeps -inf and weighs 0.
  float old_high[ROWS], high[ROWS];
  _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; ++r) {
    V top;
    std::memcpy(&top, scores + r * CHUNK, sizeof(V));
    _Pragma("GCC unroll 4") for (int t = 1; t < CHUNK_VECTORS; ++t) {
      V next;
      std::memcpy(&next, scores + r * CHUNK + t * LANES, sizeof(V));
      top = top > next ? top : next;
    }
    const float chunk_high = max_lanes(top);
    old_high[r] = s.high[first + r];
    high[r] = chunk_high > old_high[r] + SHIFT_MARGIN || old_high[r] == NEG_INF ? chunk_high
                                                                                : old_high[r];
  }
  V sums[ROWS];
  _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; ++r) {
    const float reference = high[r] == NEG_INF ? 0.0f : high[r];  // all -inf: weights 0
    sums[r] = V{};
    _Pragma("GCC unroll 4") for (int t = 0; t < CHUNK_VECTORS; ++t) {
      V x;
      std::memcpy(&x, scores + r * CHUNK + t * LANES, sizeof(V));
      x = exp_lanes(x - reference);
      sums[r] += x;
      std::memcpy(scores + r * CHUNK + t * LANES, &x, sizeof(V));
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    const float rescale = old_high[r] == high[r] ? 1.0f
                          : old_high[r] == NEG_INF ? 0.0f : std::exp(old_high[r] - high[r]);
    s.total[first + r] = s.total[first + r] * rescale + tree_sum(sums[r]);
    s.high[first + r] = high[r];
    if (rescale != 1.0f) {
      float* o = s.out.data() + (first + r) * D;
      for (int64_t d = 0; d < D; ++d) o[d] *= rescale;
    }
  }
  const float* values = p.v ? p.v + (bh * p.keys + begin) * D
                            : p.values_f + (bh * p.chunks * CHUNK + begin) * D;
  value_rows<ROWS>(scores, count, values, D,
                   s.out.data() + first * D);
}

// Rows [first, first + count) against chunk c, ROW_TILE at a time.
void tile_chunk(const Problem& p, int64_t bh, int64_t c, Rows& s, int64_t first, int64_t count) {
  int64_t r = 0;
  for (; r + ROW_TILE <= count; r += ROW_TILE) rows_chunk<ROW_TILE>(p, bh, c, s, first + r);
  switch (count - r) {  // with ROW_TILE = 3 cases 3..5 never occur (the bound keeps them valid)
    case 5: rows_chunk<std::min(5, ROW_TILE - 1)>(p, bh, c, s, first + r); break;
    case 4: rows_chunk<std::min(4, ROW_TILE - 1)>(p, bh, c, s, first + r); break;
    case 3: rows_chunk<std::min(3, ROW_TILE - 1)>(p, bh, c, s, first + r); break;
    case 2: rows_chunk<2>(p, bh, c, s, first + r); break;
    case 1: rows_chunk<1>(p, bh, c, s, first + r); break;
    default: break;
  }
}

// One unit: (b, h) and query positions [s0, s1), every row tile over the chunks it sees.
void unit(const Problem& p, int64_t index) {
  const int64_t bh = index / p.blocks, block = p.blocks - 1 - index % p.blocks;  // long first
  const int64_t b = bh / p.kv_heads, h = bh % p.kv_heads, D = p.dim, G = p.group;
  const int64_t s0 = block * p.query_rows, s1 = std::min(s0 + p.query_rows, p.seq);
  const int64_t R = (s1 - s0) * G;
  thread_local Rows s;
  s.q.resize(R * D), s.out.assign(R * D, 0.0f), s.high.assign(R, NEG_INF);
  s.total.assign(R, 0.0f), s.lo.resize(R), s.hi.resize(R);
  for (int64_t i = 0; i < s1 - s0; ++i) {
    const int64_t position = p.pos[b * p.seq + s0 + i];
    const int64_t hi = std::min<int64_t>(position + 1, p.reach);
    const int64_t lo = p.window > 0 ? std::max<int64_t>(position - p.window + 1, 0) : 0;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = i * G + g;
      const float* query = p.q + ((b * p.seq + s0 + i) * p.heads + h * G + g) * D;
      for (int64_t d = 0; d < D; ++d) s.q[r * D + d] = query[d] * p.scale;
      s.lo[r] = lo, s.hi[r] = std::max(hi, lo);
    }
  }
  // Row tiles of ROW_TILE rows: each walks only the chunks one of its rows sees.
  for (int64_t first = 0; first < R; first += ROW_TILE) {
    const int64_t count = std::min<int64_t>(ROW_TILE, R - first);
    int64_t lo = p.reach, hi = 0;
    for (int64_t r = first; r < first + count; ++r)
      if (s.lo[r] < s.hi[r]) lo = std::min(lo, s.lo[r]), hi = std::max(hi, s.hi[r]);
    for (int64_t c = lo / CHUNK; c * CHUNK < hi; ++c) tile_chunk(p, bh, c, s, first, count);
  }
  for (int64_t i = 0; i < s1 - s0; ++i)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = i * G + g;
      const float inverse = s.total[r] > 0.0f ? 1.0f / s.total[r] : 0.0f;
      float* target = p.out + ((b * p.seq + s0 + i) * p.heads + h * G + g) * D;
      for (int64_t d = 0; d < D; ++d) target[d] = s.out[r * D + d] * inverse;
    }
}

// Shapes of q [B, S, H, D], k / v [B, Hkv, T, D] and pos [B, S] into p; an error if they
// disagree.
ffi::Error shapes(ffi::Span<const int64_t> qd, ffi::Span<const int64_t> kd,
                  ffi::Span<const int64_t> vd, ffi::Span<const int64_t> pd, Problem* p) {
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || pd.size() != 2)
    return ffi::Error::InvalidArgument("prefill_attention: q, k, v rank 4 and positions rank 2");
  for (int axis = 0; axis < 4; ++axis)
    if (kd[axis] != vd[axis])
      return ffi::Error::InvalidArgument("prefill_attention: keys and values disagree");
  if (kd[0] != qd[0] || kd[3] != qd[3] || pd[0] != qd[0] || pd[1] != qd[1] || kd[1] < 1 ||
      qd[2] % kd[1] != 0 || qd[3] % 8 != 0)
    return ffi::Error::InvalidArgument(
        "prefill_attention: q [B, S, H, D], k / v [B, Hkv, T, D] with H a multiple of Hkv, "
        "positions [B, S], D a multiple of 8");
  p->batch = qd[0], p->seq = qd[1], p->heads = qd[2], p->dim = qd[3];
  p->kv_heads = kd[1], p->keys = kd[2], p->group = p->heads / p->kv_heads;
  return ffi::Error::Success();
}

ffi::Error run(ffi::ThreadPool& pool, Problem p) {
  if (p.batch * p.seq == 0 || p.dim == 0) return ffi::Error::Success();
  p.reach = 0;
  for (int64_t i = 0; i < p.batch * p.seq; ++i)
    p.reach = std::max<int64_t>(p.reach, std::min<int64_t>(int64_t{p.pos[i]} + 1, p.keys));
  p.chunks = (p.reach + CHUNK - 1) / CHUNK;
  // Units of about TARGET_ROWS query rows, or more of them (down to 4 row tiles each) where
  // that leaves fewer than 4 units a thread
  const int64_t pairs = p.batch * p.kv_heads, rows = p.seq * p.group;  // (row, KV head) pairs
  const int64_t wanted = std::min((4 * pool.num_threads() + pairs - 1) / pairs,
                                  std::max<int64_t>(rows / (4 * ROW_TILE), 1));
  const int64_t units = std::max({(rows + TARGET_ROWS - 1) / TARGET_ROWS, wanted, int64_t{1}});
  p.query_rows = (p.seq + units - 1) / units;
  p.blocks = (p.seq + p.query_rows - 1) / p.query_rows;
  // Scratch, uninitialized (every float read is written first): the transposed keys and, for
  // int8 codes, the widened values of the keys some query sees.
  std::unique_ptr<V[]> keys_t, values_f;
  try {
    keys_t.reset(new V[std::max<int64_t>(pairs * p.chunks * p.dim * CHUNK / LANES, 1)]);
    if (!p.v) values_f.reset(new V[std::max<int64_t>(pairs * p.chunks * CHUNK * p.dim / LANES, 1)]);
  } catch (const std::bad_alloc&) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      "prefill_attention: no memory for the transposed keys");
  }
  p.keys_t = reinterpret_cast<float*>(keys_t.get());
  p.values_f = reinterpret_cast<float*>(values_f.get());
  const Problem& shared = p;
  run_blocks(pool, pairs * p.chunks, [&shared](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      transpose_chunk(shared, i / shared.chunks, i % shared.chunks);
  }, 16);
  run_blocks(pool, pairs * p.blocks, [&shared](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) unit(shared, u);
  }, 1);
  return ffi::Error::Success();
}

ffi::Error DenseImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                     ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> pos,
                     ffi::Buffer<ffi::S32> window, ffi::ResultBuffer<ffi::F32> out,
                     float scale) {
  Problem p{};
  auto error = shapes(q.dimensions(), k.dimensions(), v.dimensions(), pos.dimensions(), &p);
  if (error.failure()) return error;
  p.q = q.typed_data(), p.k = k.typed_data(), p.v = v.typed_data(), p.pos = pos.typed_data();
  p.window = window.typed_data()[0], p.scale = scale, p.out = out->typed_data();
  return run(pool, p);
}

ffi::Error CodesImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S8> k,
                     ffi::Buffer<ffi::S8> v, ffi::Buffer<ffi::F32> k_scale,
                     ffi::Buffer<ffi::F32> v_scale, ffi::Buffer<ffi::S32> pos,
                     ffi::Buffer<ffi::S32> window, ffi::ResultBuffer<ffi::F32> out,
                     float scale) {
  Problem p{};
  auto error = shapes(q.dimensions(), k.dimensions(), v.dimensions(), pos.dimensions(), &p);
  if (error.failure()) return error;
  auto ks = k_scale.dimensions(), vs = v_scale.dimensions();
  if (ks.size() != 4 || vs.size() != 4 || ks[2] != p.keys || vs[2] != p.keys ||
      ks[0] != p.batch || vs[0] != p.batch || ks[1] != p.kv_heads || vs[1] != p.kv_heads)
    return ffi::Error::InvalidArgument("prefill_attention: scales [B, Hkv, T, N] expected");
  p.key_groups = ks[3], p.value_groups = vs[3];
  if (p.key_groups < 1 || p.value_groups < 1 || p.dim % p.key_groups != 0 ||
      p.dim % p.value_groups != 0)
    return ffi::Error::InvalidArgument("prefill_attention: scale groups must divide D");
  p.q = q.typed_data(), p.k_codes = k.typed_data(), p.v_codes = v.typed_data();
  p.k_scale = k_scale.typed_data(), p.v_scale = v_scale.typed_data(), p.pos = pos.typed_data();
  p.window = window.typed_data()[0], p.scale = scale, p.out = out->typed_data();
  return run(pool, p);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgenPrefillAttention, DenseImpl,
                              jaxgen_rows::dense_attention_binding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgenPrefillAttentionCodes, CodesImpl,
                              jaxgen_rows::codes_attention_binding());
