// Attention of a few query rows (a decode step, a verify forward) over one layer of a
// heads-major KV cache, float32 or int8 codes with per-group scales, in one pass over the
// keys each row can see.
//
//   q     [B, H, R, D]  float32 query rows of each KV head (R = G * S: G query heads of the
//                       group, then S positions, group-major: row r sits at position s = r % S)
//   k, v  [B, H, T, D]  float32, or int8 codes with k_scale [B, H, T, Nk], v_scale [B, H, T, Nv]
//   pos   [B, S]        int32 position of each query; key j is visible to it iff
//                       j <= pos and (window <= 0 or pos - j < window): a contiguous range
//   out   [B, H, R, D]  float32 softmax(scale * q . k) . v over the visible keys (0: none)
//
// XLA:CPU runs the batched products of one query row against every key slot of the cache
// (allocated for the whole generation) at about half the bandwidth probe's rate; this reads
// only the visible keys, once, split into chunks (units of work, or a chunk's query rows in
// parts where the chunks are too few) that XLA's thread pool shares; each chunk's softmax is
// partial (its own max and sum) and the chunks are merged at the end. int8 codes are widened
// in registers, never written out as floats.
#include <cmath>
#include <limits>
#include <vector>

#include "attention_ffi.h"
#include "few_rows.h"

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

using namespace jaxgen_rows;

typedef int32_t i8x __attribute__((vector_size(32)));   // 8 int32 lanes

constexpr int64_t MIN_CHUNK = 256;    // keys a unit of work covers at least,
constexpr int64_t MAX_CHUNK = 8192;   // at most (its scores stay in cache),
constexpr int64_t TARGET_UNITS = 64;  // and enough units for the pool where keys allow
constexpr int64_t SLAB = 64;        // value channels one pass keeps in registers
constexpr int64_t MAX_ROWS = 64;    // query rows per KV head (decode_attention.MAX_ROWS)
// Where a short context's few KV heads give the pool's threads fewer than
// MIN_UNITS_PER_THREAD units each, a chunk's query rows are split into parts of at least
// MIN_PART_ROWS rows, a unit each (the parts read the same keys again, from cache):
// SmolLM2's 3 KV heads over 152 keys, 30 layers of an 8 / 16-position verify, 1.30-1.76 /
// 2.28-2.56 ms in 3 units against 1.03 / 1.94-2.01 in 12. The part count is then raised
// to one that gives every thread as many units, where parts of at least two score tiles
// allow (9 units on 2 threads had left one thread a fifth of the work: 12; AVX2 build, 30
// calls at 8 / 16 positions 1.30-1.38 / 2.37 -> 1.20-1.23 / 2.20-2.31 ms with the cache in
// L2; the AVX-512 build's 8 positions in 18 parts of one tile were 3-6% slower than in 9).
constexpr int64_t MIN_UNITS_PER_THREAD = 4;
constexpr int64_t MIN_PART_ROWS = 4;

// e^x of 8 lanes, x <= 0 (a few ulp): 2^n e^f with n = round(x / ln 2), |f| <= ln 2 / 2,
// e^f by its degree-6 Taylor-like polynomial (minimax coefficients).
inline v8 exp_lanes(v8 x) {
  const v8 lowest = v8{} - 87.0f;
  x = x < lowest ? lowest : x;
  v8 scaled = x * 1.44269504088896341f + 0.5f;
  i8x n = __builtin_convertvector(scaled, i8x);                   // toward zero
  n += (__builtin_convertvector(n, v8) > scaled);                  // floor: -1 where above
  v8 nf = __builtin_convertvector(n, v8);
  v8 f = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  v8 p = f * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * f + 8.3334519073e-3f;
  p = p * f + 4.1665795894e-2f;
  p = p * f + 1.6666665459e-1f;
  p = p * f + 5.0000001201e-1f;
  v8 e = p * f * f + f + 1.0f;
  i8x bits = (n + 127) << 23;
  v8 power;
  std::memcpy(&power, &bits, sizeof(v8));
  return e * power;
}

struct Problem {
  int64_t batch, heads, rows, seq, keys, dim;
  int64_t key_groups, value_groups;  // scales per token (int8 codes only)
  const float* q;
  const float* k;                    // float32 keys / values, or nullptr
  const float* v;
  const int8_t* k_codes;             // int8 codes / scales, or nullptr
  const int8_t* v_codes;
  const float* k_scale;
  const float* v_scale;
  const int32_t* pos;
  int64_t window;
  float scale;
  int64_t chunks, chunk;             // key chunks per (row, head), keys a chunk
  int64_t parts, part_rows;          // query-row parts per chunk, rows a part
  float* partial_max;                // [slots, R]
  float* partial_sum;                // [slots, R]
  float* partial_acc;                // [slots, R, D]
};

// 8 int8 codes as floats (AVX2: one sign extension and one conversion; compilers widen a
// generic 8-byte vector lane by lane).
inline v8 widen(const int8_t* codes) {
#ifdef __AVX2__
  __m256 floats = _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes))));
  v8 out;
  std::memcpy(&out, &floats, sizeof(v8));
  return out;
#else
  v8 out;
  for (int lane = 0; lane < 8; ++lane) out[lane] = codes[lane];
  return out;
#endif
}

// The sums of 4 accumulators' lanes, as lanes 0..3 (three pairwise adds where AVX2 has
// them, instead of four scalar reductions).
inline void sum4(const v8* acc, float* out) {
#ifdef __AVX2__
  __m256 a, b, c, d;
  std::memcpy(&a, &acc[0], sizeof(v8)), std::memcpy(&b, &acc[1], sizeof(v8));
  std::memcpy(&c, &acc[2], sizeof(v8)), std::memcpy(&d, &acc[3], sizeof(v8));
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
#else
  for (int t = 0; t < 4; ++t) out[t] = sum_lanes(acc[t]);
#endif
}

// Query rows a dense score tile reads each key for: QUERY_TILE rows x 4 keys of accumulators
// (16 on AVX-512's 32 vector registers, 8 on AVX2's 16) beside 4 key and 1 query operand.
constexpr int QUERY_TILE = REGISTERS >= 32 ? 4 : 2;

// The dots of ROWS query rows (a, dim floats apart) with 4 key rows (b, stride floats apart):
// each key block is loaded once for all of them; out + r * out_stride receives row r's 4.
template <int ROWS>
inline void dot4_rows(const float* a, const float* b, int64_t dim, float* out,
                      int64_t out_stride, int64_t stride) {
  v8 acc[ROWS][4] = {};
  for (int64_t d = 0; d < dim; d += 8) {
    v8 y[4];
    _Pragma("GCC unroll 4") for (int t = 0; t < 4; ++t)
      std::memcpy(&y[t], b + t * stride + d, sizeof(v8));
    _Pragma("GCC unroll 4") for (int r = 0; r < ROWS; ++r) {
      v8 x;
      std::memcpy(&x, a + r * dim + d, sizeof(v8));
      _Pragma("GCC unroll 4") for (int t = 0; t < 4; ++t) acc[r][t] += x * y[t];
    }
  }
  _Pragma("GCC unroll 4") for (int r = 0; r < ROWS; ++r) sum4(acc[r], out + r * out_stride);
}

inline void add_scaled(float* acc, const float* row, float weight, int64_t dim) {
  const v8 w = v8{} + weight;
  for (int64_t d = 0; d < dim; d += 8) {
    v8 a, x;
    std::memcpy(&a, acc + d, sizeof(v8));
    std::memcpy(&x, row + d, sizeof(v8));
    a += w * x;
    std::memcpy(acc + d, &a, sizeof(v8));
  }
}

// 8 floats of a 32-byte aligned accumulator, in place: whole-register loads and stores (a
// store the compiler splits in halves cannot forward to the next key's load).
inline v8& aligned(float* at) {
  return *reinterpret_cast<v8*>(__builtin_assume_aligned(at, sizeof(v8)));
}


// The 4 rows of int8 codes a dot reads (step rows apart) and their group scales.
struct KeyRows {
  const int8_t* codes[4];
  const float* scales[4];
  KeyRows(const int8_t* first, const float* first_scales, int64_t step, int64_t groups,
          int64_t dim) {
    for (int t = 0; t < 4; ++t)
      codes[t] = first + t * step * dim, scales[t] = first_scales + t * step * groups;
  }
};

// The dots of q with 4 rows of int8 codes (rows step apart: codes step * dim, scales
// step * groups) times their group scales, into out[0..3]. A group's products (WIDTH blocks
// of 8 channels; 0: dim / groups, known only at run time) are summed before its scale
// multiplies them, and codes are widened in registers, never stored.
template <int WIDTH>
inline void codes_dot4(const float* q, const int8_t* codes, const float* scales, int64_t step,
                       int64_t groups, int64_t dim, float* out) {
  const int64_t blocks = WIDTH ? WIDTH : dim / groups / 8;
  const KeyRows keys(codes, scales, step, groups, dim);
  v8 acc[4] = {};
  for (int64_t g = 0; g < groups; ++g) {
    v8 part[4] = {};
    _Pragma("GCC unroll 8") for (int64_t b = 0; b < blocks; ++b) {
      const int64_t d = (g * blocks + b) * 8;
      v8 x;
      std::memcpy(&x, q + d, sizeof(v8));
      _Pragma("GCC unroll 4") for (int t = 0; t < 4; ++t) part[t] += x * widen(keys.codes[t] + d);
    }
    _Pragma("GCC unroll 4") for (int t = 0; t < 4; ++t) acc[t] += part[t] * keys.scales[t][g];
  }
  sum4(acc, out);
}

#ifdef __AVX2__
// codes_dot4 with the query as int16 codes (round_to_int16): 16 channels a multiply-add of
// int16 pairs into int32 lanes (one instruction, where widening codes to floats takes two
// per 8 channels), one conversion to float a group of PAIRS x 16 channels (0: known at run
// time). Exact in int32 for groups of up to 2^14 channels.
template <int PAIRS>
inline void codes_dot4_i16(const int16_t* q16, float unit, const int8_t* codes,
                           const float* scales, int64_t step, int64_t groups, int64_t dim,
                           float* out) {
  const int64_t pairs = PAIRS ? PAIRS : dim / groups / 16;
  const KeyRows keys(codes, scales, step, groups, dim);
  v8 acc[4] = {};
  for (int64_t g = 0; g < groups; ++g) {
    __m256i part[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                       _mm256_setzero_si256()};
    _Pragma("GCC unroll 8") for (int64_t b = 0; b < pairs; ++b) {
      const int64_t d = (g * pairs + b) * 16;
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q16 + d));
      _Pragma("GCC unroll 4") for (int t = 0; t < 4; ++t) {
        const __m256i k16 = _mm256_cvtepi8_epi16(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(keys.codes[t] + d)));
        part[t] = _mm256_add_epi32(part[t], _mm256_madd_epi16(x, k16));
      }
    }
    _Pragma("GCC unroll 4") for (int t = 0; t < 4; ++t) {
      const __m256 sums = _mm256_cvtepi32_ps(part[t]);
      v8 f;
      std::memcpy(&f, &sums, sizeof(v8));
      acc[t] += f * keys.scales[t][g];
    }
  }
  sum4(acc, out);
  _Pragma("GCC unroll 4") for (int t = 0; t < 4; ++t) out[t] *= unit;
}

using CodesDot16 = void (*)(const int16_t*, float, const int8_t*, const float*, int64_t,
                            int64_t, int64_t, float*);
// The int16 dot for groups of `width` channels, or nullptr (not a multiple of 16).
inline CodesDot16 codes_dot16_for(int64_t width) {
  if (width % 16 != 0 || width > (int64_t{1} << 14)) return nullptr;
  switch (width / 16) {
    case 1: return codes_dot4_i16<1>;
    case 2: return codes_dot4_i16<2>;
    case 4: return codes_dot4_i16<4>;
    default: return codes_dot4_i16<0>;
  }
}
#endif

// Which codes_dot4 serves a group of `blocks` blocks of 8 channels.
using CodesDot = void (*)(const float*, const int8_t*, const float*, int64_t, int64_t, int64_t,
                          float*);
inline CodesDot codes_dot_for(int64_t blocks) {
  switch (blocks) {
    case 1: return codes_dot4<1>;
    case 2: return codes_dot4<2>;
    case 4: return codes_dot4<4>;
    case 8: return codes_dot4<8>;
    default: return codes_dot4<0>;
  }
}

// add(i) for the `count` keys of a span in the order the value passes read them: the 4
// quarters of the span as interleaved streams, then the last count % 4 keys.
template <typename Add>
inline __attribute__((always_inline)) void in_stream_order(int64_t count, Add&& add) {
  const int64_t quarter = count / 4;
  for (int64_t i = 0; i < quarter; ++i)
    _Pragma("GCC unroll 4") for (int t = 0; t < 4; ++t) add(i + t * quarter);
  for (int64_t i = 4 * quarter; i < count; ++i) add(i);
}

// One key's contribution to a slab of BLOCKS value blocks: sum[b] += weight * row[b], the
// row float32 or int8 codes (GROUP blocks share a scale, the slab starting on a group's
// first block; GROUP 0: scales[group[b]]).
template <int BLOCKS, int GROUP>
inline void add_value(v8* sum, const Problem& p, int64_t row, int64_t d0, float weight,
                      const int64_t* group) {
  if (p.v) {
    const v8 w = v8{} + weight;
    const float* values = p.v + row * p.dim + d0;
    _Pragma("GCC unroll 8") for (int b = 0; b < BLOCKS; ++b) {
      v8 x;
      std::memcpy(&x, values + 8 * b, sizeof(v8));
      sum[b] += w * x;
    }
    return;
  }
  const int8_t* codes = p.v_codes + row * p.dim + d0;
  const float* scales = p.v_scale + row * p.value_groups;
  if constexpr (GROUP > 0) {
    constexpr int GROUPS = (BLOCKS + GROUP - 1) / GROUP;
    v8 w[GROUPS];
    _Pragma("GCC unroll 8") for (int g = 0; g < GROUPS; ++g) w[g] = v8{} + weight * scales[group[0] + g];
    _Pragma("GCC unroll 8") for (int b = 0; b < BLOCKS; ++b) sum[b] += w[b / GROUP] * widen(codes + 8 * b);
  } else {
    _Pragma("GCC unroll 8") for (int b = 0; b < BLOCKS; ++b)
      sum[b] += (v8{} + weight * scales[group[b]]) * widen(codes + 8 * b);
  }
}

// Channels [d0, d0 + 8 BLOCKS) of one query row's weighted values over the `count` keys from
// row `first` on (weights w[i]): the sum stays in registers while the keys stream past, 4
// streams at once (the quarters of the span, then the last count % 4 keys), and is added to
// acc[d0..] (32-byte aligned).
template <int BLOCKS, int GROUP>
void value_slab(const Problem& p, int64_t first, int64_t count, const float* w, int64_t d0,
                float* acc) {
  const int64_t width = p.v ? p.dim : p.dim / p.value_groups;
  int64_t group[BLOCKS];                           // each block's scale group
  _Pragma("GCC unroll 8") for (int b = 0; b < BLOCKS; ++b) group[b] = (d0 + 8 * b) / width;
  v8 sum[BLOCKS] = {};
  in_stream_order(count, [&](int64_t i) __attribute__((always_inline)) {
    add_value<BLOCKS, GROUP>(sum, p, first + i, d0, w[i], group);
  });
  _Pragma("GCC unroll 8") for (int b = 0; b < BLOCKS; ++b) aligned(acc + d0 + 8 * b) += sum[b];
}

// value_slab for float32 values, a full slab (SLAB channels) and ROWS query rows at once
// (weights w + r * w_stride, sums into acc + r * acc_stride): each value block is loaded once
// for all of them; every row's sums run in value_slab's order.
template <int ROWS>
void dense_value_rows(const Problem& p, int64_t first, int64_t count, const float* w,
                      int64_t w_stride, int64_t d0, float* acc, int64_t acc_stride) {
  constexpr int BLOCKS = SLAB / 8;
  v8 sum[ROWS][BLOCKS] = {};
  in_stream_order(count, [&](int64_t i) __attribute__((always_inline)) {
    const float* values = p.v + (first + i) * p.dim + d0;
    v8 weight[ROWS];
    _Pragma("GCC unroll 4") for (int r = 0; r < ROWS; ++r) weight[r] = v8{} + w[r * w_stride + i];
    _Pragma("GCC unroll 8") for (int b = 0; b < BLOCKS; ++b) {
      v8 x;
      std::memcpy(&x, values + 8 * b, sizeof(v8));
      _Pragma("GCC unroll 4") for (int r = 0; r < ROWS; ++r) sum[r][b] += weight[r] * x;
    }
  });
  _Pragma("GCC unroll 4") for (int r = 0; r < ROWS; ++r)
    _Pragma("GCC unroll 8") for (int b = 0; b < BLOCKS; ++b)
      aligned(acc + r * acc_stride + d0 + 8 * b) += sum[r][b];
}

// Query rows a dense value pass serves at once: 2 x 8 sums where AVX-512 gives 32 vector
// registers, else 1 (value_slab).
constexpr int VALUE_TILE = REGISTERS >= 32 ? 2 : 1;

// Slab [d0, d0 + 8 blocks) through the value_slab that fits: GROUP blocks a scale group
// where every group starts on a slab block (8: one group over the slab), else the general one.
template <int BLOCKS>
void value_slab_for(const Problem& p, int64_t first, int64_t count, const float* w, int64_t d0,
                    float* acc) {
  const int64_t group_blocks = p.v ? 8 : p.dim / p.value_groups / 8;
  if (group_blocks % 8 == 0 || group_blocks >= BLOCKS && (d0 / 8) % group_blocks == 0)
    value_slab<BLOCKS, 8>(p, first, count, w, d0, acc);
  else if (group_blocks == 4)
    value_slab<BLOCKS, 4>(p, first, count, w, d0, acc);
  else if (group_blocks == 2)
    value_slab<BLOCKS, 2>(p, first, count, w, d0, acc);
  else if (group_blocks == 1)
    value_slab<BLOCKS, 1>(p, first, count, w, d0, acc);
  else
    value_slab<BLOCKS, 0>(p, first, count, w, d0, acc);
}

// Visible keys [lo, hi) of query row r of batch row b.
inline void visible(const Problem& p, int64_t b, int64_t r, int64_t* lo, int64_t* hi) {
  const int64_t position = p.pos[b * p.seq + r % p.seq];
  if (position < 0) {
    *lo = *hi = 0;
    return;
  }
  *hi = std::min(position + 1, p.keys);
  *lo = p.window > 0 ? std::max<int64_t>(position - p.window + 1, 0) : 0;
  if (*lo > *hi) *lo = *hi;
}

// Softmax weights of one row over keys [a, z) of its scores s (in place, relative to their
// max, which is returned with their sum in *total); s outside [a, z) set to 0.
inline float row_weights(float* s, int64_t count, int64_t a, int64_t z, float* total) {
  v8 highs = v8{} + s[a];                          // the max, 8 lanes at a time
  int64_t j = a;
  for (; j + 8 <= z; j += 8) {
    v8 x;
    std::memcpy(&x, s + j, sizeof(v8));
    highs = x > highs ? x : highs;
  }
  float high = highs[0];
  for (int lane = 1; lane < 8; ++lane) high = std::max(high, highs[lane]);
  for (; j < z; ++j) high = std::max(high, s[j]);
  v8 sums = {};
  for (j = a; j + 8 <= z; j += 8) {
    v8 x;
    std::memcpy(&x, s + j, sizeof(v8));
    v8 e = exp_lanes(x - high);
    std::memcpy(s + j, &e, sizeof(v8));
    sums += e;
  }
  float sum = sum_lanes(sums);
  if (j < z) {                                     // the tail: lanes past z are not read
    v8 x = v8{} - 1e30f;
    std::memcpy(&x, s + j, (z - j) * sizeof(float));
    v8 e = exp_lanes(x - high);
    std::memcpy(s + j, &e, (z - j) * sizeof(float));
    for (int64_t t = 0; t < z - j; ++t) sum += e[t];
  }
  std::fill(s, s + a, 0.0f);
  std::fill(s + z, s + count, 0.0f);
  *total = sum;
  return high;
}

// One unit: the partial softmax of query rows [r0, r1) (a part, or all) of head (b, h) over
// key chunk c, into the chunk's slot of the partial sums. The keys
// and values are read as 4 interleaved streams (the quarters of the chunk's visible span):
// one stream a core measured ~9 GB/s on a Zen 1 host, four streams more.
void unit(const Problem& p, int64_t index) {
  const int64_t part = index % p.parts, slot = index / p.parts;
  const int64_t c = slot % p.chunks, bh = slot / p.chunks, b = bh / p.heads;
  const int64_t R = p.rows, D = p.dim;
  const int64_t r0 = part * p.part_rows, r1 = std::min(r0 + p.part_rows, R);
  const int64_t C = p.chunk, first = c * C, last = std::min(first + C, p.keys);
  float* maxes = p.partial_max + slot * R;
  float* sums = p.partial_sum + slot * R;
  float* accs = p.partial_acc + slot * R * D;
  int64_t lo[MAX_ROWS], hi[MAX_ROWS];
  int64_t span_lo = last, span_hi = first;
  for (int64_t r = r0; r < r1; ++r) {
    int64_t a, z;
    visible(p, b, r, &a, &z);
    lo[r] = std::max(a, first);
    hi[r] = std::min(z, last);
    if (lo[r] < hi[r]) {
      span_lo = std::min(span_lo, lo[r]);
      span_hi = std::max(span_hi, hi[r]);
    }
    maxes[r] = -std::numeric_limits<float>::infinity();
    sums[r] = 0.0f;
    std::fill(accs + r * D, accs + (r + 1) * D, 0.0f);
  }
  if (span_lo >= span_hi) return;
  thread_local std::vector<float> scratch;
  scratch.resize(R * C);
  float* weights = scratch.data();                 // [R, C]: key span_lo + i at i
  const float* q = p.q + bh * R * D;
  const int64_t head = bh * p.keys;                // row index of this head's key 0
  const int64_t count = span_hi - span_lo, quarter = count / 4;
  // Scores: keys i, i + quarter, i + 2 quarter, i + 3 quarter at once, then the last
  // count % 4 keys one at a time (step 0: one key read 4 times, its first dot kept).
  const CodesDot codes_dot = p.k ? nullptr : codes_dot_for(D / p.key_groups / 8);
#ifdef __AVX2__
  // int8 keys: each query row as int16 codes where it is finite (units[r] >= 0)
  const CodesDot16 codes_dot16 = p.k ? nullptr : codes_dot16_for(D / p.key_groups);
  thread_local std::vector<int16_t> query_codes;
  float units[MAX_ROWS];
  if (codes_dot16) {
    query_codes.resize(R * D);
    for (int64_t r = r0; r < r1; ++r) units[r] = round_to_int16(q + r * D, D, &query_codes[r * D]);
  }
#endif
  auto scores = [&](int64_t i, int64_t step, int keys) {
    const int64_t row = head + span_lo + i;
    int64_t r = r0;
    if (p.k) {                                     // dense keys: QUERY_TILE rows at once
      float dots[QUERY_TILE * 4];
      for (; r + QUERY_TILE <= r1; r += QUERY_TILE) {
        dot4_rows<QUERY_TILE>(q + r * D, p.k + row * D, D, dots, 4, step * D);
        for (int u = 0; u < QUERY_TILE; ++u) {
          float* out = weights + (r + u) * C + i;
          for (int t = 0; t < keys; ++t) out[t * step] = p.scale * dots[u * 4 + t];
        }
      }
    }
    for (; r < r1; ++r) {
      float dots[4];
      if (p.k) {
        dot4_rows<1>(q + r * D, p.k + row * D, D, dots, 4, step * D);
      } else {
        const int8_t* codes = p.k_codes + row * D;
        const float* scales = p.k_scale + row * p.key_groups;
#ifdef __AVX2__
        if (codes_dot16 && units[r] >= 0.0f)
          codes_dot16(&query_codes[r * D], units[r], codes, scales, step, p.key_groups, D, dots);
        else
#endif
          codes_dot(q + r * D, codes, scales, step, p.key_groups, D, dots);
      }
      float* out = weights + r * C + i;
      for (int t = 0; t < keys; ++t) out[t * step] = p.scale * dots[t];
    }
  };
  for (int64_t i = 0; i < quarter; ++i) scores(i, quarter, 4);
  for (int64_t i = 4 * quarter; i < count; ++i) scores(i, 0, 1);
  for (int64_t r = r0; r < r1; ++r)
    if (lo[r] < hi[r])
      maxes[r] = row_weights(weights + r * C, count, lo[r] - span_lo, hi[r] - span_lo,
                             &sums[r]);
  for (int64_t r = r0; r < r1; ++r) {              // values: the same streams
    if (lo[r] >= hi[r]) continue;
    if (VALUE_TILE > 1 && p.v && D % SLAB == 0 && r + 1 < r1 && lo[r + 1] < hi[r + 1]) {
      for (int64_t d = 0; d < D; d += SLAB)          // rows r and r + 1 in one pass
        dense_value_rows<2>(p, head + span_lo, count, weights + r * C, C, d, accs + r * D, D);
      ++r;
      continue;
    }
    for (int64_t d = 0; d < D; d += SLAB)
      switch (std::min<int64_t>(D - d, SLAB) / 8) {
        case 8: value_slab_for<8>(p, head + span_lo, count, weights + r * C, d, accs + r * D); break;
        case 7: value_slab_for<7>(p, head + span_lo, count, weights + r * C, d, accs + r * D); break;
        case 6: value_slab_for<6>(p, head + span_lo, count, weights + r * C, d, accs + r * D); break;
        case 5: value_slab_for<5>(p, head + span_lo, count, weights + r * C, d, accs + r * D); break;
        case 4: value_slab_for<4>(p, head + span_lo, count, weights + r * C, d, accs + r * D); break;
        case 3: value_slab_for<3>(p, head + span_lo, count, weights + r * C, d, accs + r * D); break;
        case 2: value_slab_for<2>(p, head + span_lo, count, weights + r * C, d, accs + r * D); break;
        default: value_slab_for<1>(p, head + span_lo, count, weights + r * C, d, accs + r * D); break;
      }
  }
}

// The chunks' partial softmaxes of each (b, h, r) merged into out.
void merge(const Problem& p, float* out) {
  const int64_t R = p.rows, D = p.dim;
  for (int64_t bh = 0; bh < p.batch * p.heads; ++bh)
    for (int64_t r = 0; r < R; ++r) {
      float high = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < p.chunks; ++c) high = std::max(high, p.partial_max[(bh * p.chunks + c) * R + r]);
      float* o = out + (bh * R + r) * D;
      std::fill(o, o + D, 0.0f);
      if (!std::isfinite(high)) continue;
      float total = 0.0f;
      for (int64_t c = 0; c < p.chunks; ++c) {
        const int64_t u = bh * p.chunks + c;
        if (p.partial_sum[u * R + r] == 0.0f) continue;
        const float weight = std::exp(p.partial_max[u * R + r] - high);
        total += weight * p.partial_sum[u * R + r];
        add_scaled(o, p.partial_acc + (u * R + r) * D, weight, D);
      }
      const float inverse = total > 0.0f ? 1.0f / total : 0.0f;
      for (int64_t d = 0; d < D; ++d) o[d] *= inverse;
    }
}

ffi::Error run(ffi::ThreadPool& pool, Problem p, float* out) {
  if (p.dim % 8 != 0 || p.rows > MAX_ROWS)
    return ffi::Error::InvalidArgument(
        "decode_attention: head_dim a multiple of 8 and at most 64 query rows per head");
  int64_t reach = 0;                               // keys any query sees: [0, reach)
  for (int64_t i = 0; i < p.batch * p.seq; ++i)
    reach = std::max<int64_t>(reach, std::min<int64_t>(int64_t{p.pos[i]} + 1, p.keys));
  // Chunks a head: TARGET_UNITS units in all, within [MIN_CHUNK, MAX_CHUNK] keys each (the
  // partial sums are chunks x rows x head_dim floats a head).
  const int64_t heads = p.batch * p.heads;
  int64_t chunks = std::min((reach + MIN_CHUNK - 1) / MIN_CHUNK, (TARGET_UNITS + heads - 1) / heads);
  chunks = std::max({chunks, (reach + MAX_CHUNK - 1) / MAX_CHUNK, int64_t{1}});
  p.chunk = std::max<int64_t>((reach + chunks - 1) / chunks, 1);
  p.chunks = (reach + p.chunk - 1) / p.chunk;
  if (p.chunks < 1) p.chunks = 1;
  const int64_t slots = p.batch * p.heads * p.chunks;  // partial softmaxes, each R rows
  if (slots == 0 || p.rows == 0) return ffi::Error::Success();  // an empty output
  // Too few slots for the pool's threads (a short context's few KV heads): each slot's
  // query rows in parts of at least MIN_PART_ROWS (whole score tiles), a unit each.
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  const int64_t want = MIN_UNITS_PER_THREAD * threads;
  // rows a part for `parts` parts (whole score tiles)
  auto rows_of = [&p](int64_t parts) {
    return ((p.rows + parts - 1) / parts + QUERY_TILE - 1) / QUERY_TILE * QUERY_TILE;
  };
  const int64_t parts =
      std::max<int64_t>(std::min((want + slots - 1) / slots, p.rows / MIN_PART_ROWS), 1);
  p.part_rows = rows_of(parts);
  if (parts > 1)  // as many units for every thread, where parts of two tiles allow
    for (int64_t more = parts; more <= p.rows / MIN_PART_ROWS; ++more) {
      const int64_t rows = rows_of(more);
      if (rows < 2 * QUERY_TILE) break;
      if (slots * ((p.rows + rows - 1) / rows) % threads == 0) {
        p.part_rows = rows;
        break;
      }
    }
  p.parts = (p.rows + p.part_rows - 1) / p.part_rows;
  const int64_t units = slots * p.parts;
  std::vector<float> partial(slots * p.rows * 2);
  std::vector<v8> accumulators(slots * p.rows * p.dim / 8);  // 32-byte aligned
  p.partial_max = partial.data();
  p.partial_sum = p.partial_max + slots * p.rows;
  p.partial_acc = reinterpret_cast<float*>(accumulators.data());
  const Problem& shared = p;
  run_blocks(pool, units, [&shared](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) unit(shared, u);
  }, 1);
  merge(p, out);
  return ffi::Error::Success();
}

// Shapes of q [B, H, R, D], k / v [B, H, T, D] and pos [B, S] into p; an error if they disagree.
ffi::Error shapes(ffi::Span<const int64_t> q, ffi::Span<const int64_t> k,
                  ffi::Span<const int64_t> v, ffi::Span<const int64_t> pos, Problem* p) {
  if (q.size() != 4 || k.size() != 4 || v.size() != 4 || pos.size() != 2)
    return ffi::Error::InvalidArgument("decode_attention: q, k, v rank 4 and positions rank 2");
  for (int axis : {0, 1, 3})
    if (k[axis] != q[axis] || v[axis] != q[axis])
      return ffi::Error::InvalidArgument("decode_attention: q, k and v disagree on B, H or D");
  if (k[2] != v[2] || pos[0] != q[0] || pos[1] < 1 || q[2] % pos[1] != 0)
    return ffi::Error::InvalidArgument("decode_attention: keys, values or positions mismatch");
  p->batch = q[0], p->heads = q[1], p->rows = q[2], p->dim = q[3];
  p->keys = k[2], p->seq = pos[1];
  return ffi::Error::Success();
}

ffi::Error DenseImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                     ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> pos,
                     ffi::Buffer<ffi::S32> window, ffi::ResultBuffer<ffi::F32> out, float scale) {
  Problem p{};
  auto error = shapes(q.dimensions(), k.dimensions(), v.dimensions(), pos.dimensions(), &p);
  if (error.failure()) return error;
  p.q = q.typed_data(), p.k = k.typed_data(), p.v = v.typed_data();
  p.pos = pos.typed_data(), p.window = window.typed_data()[0], p.scale = scale;
  return run(pool, p, out->typed_data());
}

ffi::Error CodesImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S8> k,
                     ffi::Buffer<ffi::S8> v, ffi::Buffer<ffi::F32> k_scale,
                     ffi::Buffer<ffi::F32> v_scale, ffi::Buffer<ffi::S32> pos,
                     ffi::Buffer<ffi::S32> window, ffi::ResultBuffer<ffi::F32> out, float scale) {
  Problem p{};
  auto error = shapes(q.dimensions(), k.dimensions(), v.dimensions(), pos.dimensions(), &p);
  if (error.failure()) return error;
  auto ks = k_scale.dimensions(), vs = v_scale.dimensions();
  if (ks.size() != 4 || vs.size() != 4 || ks[2] != p.keys || vs[2] != p.keys)
    return ffi::Error::InvalidArgument("decode_attention: scales [B, H, T, N] expected");
  p.key_groups = ks[3], p.value_groups = vs[3];
  if (p.key_groups < 1 || p.value_groups < 1 || p.dim % (8 * p.key_groups) != 0 ||
      p.dim % (8 * p.value_groups) != 0)
    return ffi::Error::InvalidArgument("decode_attention: scale groups of a multiple of 8");
  p.q = q.typed_data(), p.k_codes = k.typed_data(), p.v_codes = v.typed_data();
  p.k_scale = k_scale.typed_data(), p.v_scale = v_scale.typed_data();
  p.pos = pos.typed_data(), p.window = window.typed_data()[0], p.scale = scale;
  return run(pool, p, out->typed_data());
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgenDecodeAttention, DenseImpl,
                              jaxgen_rows::dense_attention_binding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgenDecodeAttentionCodes, CodesImpl,
                              jaxgen_rows::codes_attention_binding());

// Bits of the integer codes the int8 path rounds each query row to for key scale groups of a
// multiple of 16 channels (16, where AVX2 has the int16 multiply-adds; 0: float queries), for
// the Python side (`decode_attention.query_bits`).
extern "C" int JaxgenDecodeAttentionQueryBits() {
#ifdef __AVX2__
  return 16;
#else
  return 0;
#endif
}
