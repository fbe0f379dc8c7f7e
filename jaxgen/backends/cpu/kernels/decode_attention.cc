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
// only the visible keys, once, split into chunks (units of work) that XLA's thread pool
// shares; each chunk's softmax is partial (its own max and sum) and the chunks are merged at
// the end. int8 codes are widened in registers, never written out as floats.
#include <cmath>
#include <limits>
#include <vector>

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
  float* partial_max;                // [units, R]
  float* partial_sum;                // [units, R]
  float* partial_acc;                // [units, R, D]
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

// The dots of a with the 4 rows of b (4 x dim floats, contiguous) into out[0..3].
inline void dot4(const float* a, const float* b, int64_t dim, float* out, int64_t stride) {
  v8 acc[4] = {};
  for (int64_t d = 0; d < dim; d += 8) {
    v8 x;
    std::memcpy(&x, a + d, sizeof(v8));
    _Pragma("GCC unroll 4") for (int t = 0; t < 4; ++t) {
      v8 y;
      std::memcpy(&y, b + t * stride + d, sizeof(v8));
      acc[t] += x * y;
    }
  }
  _Pragma("GCC unroll 4") for (int t = 0; t < 4; ++t) out[t] = sum_lanes(acc[t]);
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


// The dots of q with 4 rows of int8 codes (rows step apart: codes step * dim, scales
// step * groups) times their group scales, into out[0..3]. A group's products are summed
// before its scale multiplies them, and codes are widened in registers, never stored.
inline void codes_dot4(const float* q, const int8_t* codes, const float* scales, int64_t step,
                       int64_t groups, int64_t dim, float* out) {
  const int64_t width = dim / groups;
  v8 acc[4] = {};
  for (int64_t g = 0; g < groups; ++g) {
    v8 part[4] = {};
    for (int64_t d = g * width; d < (g + 1) * width; d += 8) {
      v8 x;
      std::memcpy(&x, q + d, sizeof(v8));
      _Pragma("GCC unroll 4") for (int t = 0; t < 4; ++t)
        part[t] += x * widen(codes + t * step * dim + d);
    }
    _Pragma("GCC unroll 4") for (int t = 0; t < 4; ++t)
      acc[t] += part[t] * scales[t * step * groups + g];
  }
  _Pragma("GCC unroll 4") for (int t = 0; t < 4; ++t) out[t] = sum_lanes(acc[t]);
}


// Channels [d0, d0 + 8 BLOCKS) of one query row's weighted values over the `count` keys from
// row `first` on (weights w[i]): the sum stays in registers while the keys stream past, 4
// streams at once (the quarters of the span), and is added to acc[d0..] (32-byte aligned).
template <int BLOCKS>
void value_slab(const Problem& p, int64_t first, int64_t count, const float* w, int64_t d0,
                float* acc) {
  const int64_t D = p.dim, quarter = count / 4;
  const int64_t width = p.v ? D : D / p.value_groups;
  int64_t group[BLOCKS];                           // each block's scale group
  _Pragma("GCC unroll 8") for (int b = 0; b < BLOCKS; ++b) group[b] = (d0 + 8 * b) / width;
  v8 sum[BLOCKS] = {};
  for (int64_t i = 0; i < count; ++i) {
    const bool streams = i < quarter;
    if (!streams && i < 4 * quarter) continue;
    const int streams_read = streams ? 4 : 1;
    for (int t = 0; t < streams_read; ++t) {
      const int64_t key = i + t * quarter, row = first + key;
      const float weight = w[key];
      if (p.v) {
        const v8 scale = v8{} + weight;
        const float* values = p.v + row * D + d0;
        _Pragma("GCC unroll 8") for (int b = 0; b < BLOCKS; ++b) {
          v8 x;
          std::memcpy(&x, values + 8 * b, sizeof(v8));
          sum[b] += scale * x;
        }
      } else {
        const int8_t* codes = p.v_codes + row * D + d0;
        const float* scales = p.v_scale + row * p.value_groups;
        _Pragma("GCC unroll 8") for (int b = 0; b < BLOCKS; ++b)
          sum[b] += (v8{} + weight * scales[group[b]]) * widen(codes + 8 * b);
      }
    }
  }
  _Pragma("GCC unroll 8") for (int b = 0; b < BLOCKS; ++b) aligned(acc + d0 + 8 * b) += sum[b];
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
  float high = s[a];
  for (int64_t j = a + 1; j < z; ++j) high = std::max(high, s[j]);
  float sum = 0.0f;
  int64_t j = a;
  for (; j + 8 <= z; j += 8) {
    v8 x;
    std::memcpy(&x, s + j, sizeof(v8));
    v8 e = exp_lanes(x - high);
    std::memcpy(s + j, &e, sizeof(v8));
    sum += sum_lanes(e);
  }
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

// One unit: the partial softmax of every query row of head (b, h) over key chunk c. The keys
// and values are read as 4 interleaved streams (the quarters of the chunk's visible span):
// one stream a core measured ~9 GB/s on a Zen 1 host, four streams more.
void unit(const Problem& p, int64_t index) {
  const int64_t c = index % p.chunks, bh = index / p.chunks, b = bh / p.heads;
  const int64_t R = p.rows, D = p.dim;
  const int64_t C = p.chunk, first = c * C, last = std::min(first + C, p.keys);
  float* maxes = p.partial_max + index * R;
  float* sums = p.partial_sum + index * R;
  float* accs = p.partial_acc + index * R * D;
  int64_t lo[MAX_ROWS], hi[MAX_ROWS];
  int64_t span_lo = last, span_hi = first;
  for (int64_t r = 0; r < R; ++r) {
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
  for (int64_t i = 0; i < count; ++i) {
    const bool streams = i < quarter;
    if (!streams && i < 4 * quarter) continue;
    const int64_t step = streams ? quarter : 0, row = head + span_lo + i;
    for (int64_t r = 0; r < R; ++r) {
      float dots[4];
      if (p.k)
        dot4(q + r * D, p.k + row * D, D, dots, step * D);
      else
        codes_dot4(q + r * D, p.k_codes + row * D, p.k_scale + row * p.key_groups, step,
                   p.key_groups, D, dots);
      float* scores = weights + r * C + i;
      for (int t = 0; t < (streams ? 4 : 1); ++t) scores[t * quarter] = p.scale * dots[t];
    }
  }
  for (int64_t r = 0; r < R; ++r)
    if (lo[r] < hi[r])
      maxes[r] = row_weights(weights + r * C, count, lo[r] - span_lo, hi[r] - span_lo,
                             &sums[r]);
  for (int64_t r = 0; r < R; ++r) {                // values: the same streams
    if (lo[r] >= hi[r]) continue;
    for (int64_t d = 0; d < D; d += SLAB)
      switch (std::min<int64_t>(D - d, SLAB) / 8) {
        case 8: value_slab<8>(p, head + span_lo, count, weights + r * C, d, accs + r * D); break;
        case 7: value_slab<7>(p, head + span_lo, count, weights + r * C, d, accs + r * D); break;
        case 6: value_slab<6>(p, head + span_lo, count, weights + r * C, d, accs + r * D); break;
        case 5: value_slab<5>(p, head + span_lo, count, weights + r * C, d, accs + r * D); break;
        case 4: value_slab<4>(p, head + span_lo, count, weights + r * C, d, accs + r * D); break;
        case 3: value_slab<3>(p, head + span_lo, count, weights + r * C, d, accs + r * D); break;
        case 2: value_slab<2>(p, head + span_lo, count, weights + r * C, d, accs + r * D); break;
        default: value_slab<1>(p, head + span_lo, count, weights + r * C, d, accs + r * D); break;
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
  const int64_t units = p.batch * p.heads * p.chunks;
  std::vector<float> partial(units * p.rows * 2);
  std::vector<v8> accumulators(units * p.rows * p.dim / 8);  // 32-byte aligned
  p.partial_max = partial.data();
  p.partial_sum = p.partial_max + units * p.rows;
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
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgenDecodeAttentionCodes, CodesImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));
