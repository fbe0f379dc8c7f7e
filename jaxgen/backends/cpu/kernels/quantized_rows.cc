// y[M, N] = x[M, K] @ w[N, K]^T for a few rows M, with w kept as integer codes: int8 codes
// (load(weights="int8"), GGUF Q8_0) or 4-bit codes two to a byte (GGUF Q4_0 / Q4_1), each
// group of `group` inputs of an output row with one scale and, for Q4_1, one offset:
//     w[n, i] = scale[n, g] * (code[n, i] - code_offset) + offset[n, g],  g = i / group.
// XLA:CPU converts a quantized matrix to float32 in memory before its product (so int8 weights
// read more bytes than float ones); here the codes are read once and expanded in registers.
//
// Up to `fused_max_rows` input rows (3 on AVX2 builds; a row group of 8 with AVX-512, on Intel
// hosts one row of 4-bit codes and 4 of Q8_0 blocks) multiply the codes as they are expanded,
// one linear stream per weight row: sum_g scale_g * (x_g . code_g) + (offset_g - scale_g *
// code_offset) * sum(x_g), where the sums of x over each group are taken once per call. More
// rows expand a few weight rows at a time into a float buffer that stays in cache and run the
// float tiles of few_rows.h on it.
//
// Layout of row n: codes[n] = K int8 codes, or K / 2 bytes in which byte j of each 32-input
// block holds input j in its low nibble and input j + 16 in its high one (GGUF's packing);
// scale[n] and offset[n] = K / group float32 or float16 values.
#include <cmath>
#include <vector>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "few_rows.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxgen_rows;

typedef int8_t i8x8 __attribute__((vector_size(8)));
typedef uint8_t u8x8 __attribute__((vector_size(8)));
typedef int32_t i32x8 __attribute__((vector_size(32)));

#ifdef __AVX512F__
#define GROUP_ROWS_IS_8 1  // few_rows.h's GROUP_ROWS: the fused path's most rows
#else
#define GROUP_ROWS_IS_8 0
#endif

// AVX2 cores without AVX-512 (measured on Zen 1) multiply int16 codes of the input rows
// (int16_dots); AVX-512 builds widen the codes to 16-float vectors instead.
#if defined(__AVX2__) && !defined(__AVX512F__)
#define INT16_ROWS 1
#else
#define INT16_ROWS 0
#endif

constexpr int64_t INT16_MAX_ROWS = INT16_ROWS ? 3 : 0;  // 4 rows measured faster as floats

// The most input rows the fused path multiplies for codes in groups of `group` inputs (more:
// weight rows expanded into a float buffer and the float tiles of few_rows.h); 30 SmolLM2
// layers, fused against the buffer. AVX2 builds: the int16 codes' 3 rows (at 4 rows through
// the buffer and few_rows.h's 4 x 3 tiles, AVX2 build on an Intel host: per-channel int8 17.0
// against 21.4 ms, Q4_1 14.3 against 18.5, Q8_0 18.4 against 28.5). AVX-512 builds: a row
// group, except GGUF blocks on Intel hosts (16-lane tiles): one row of 4-bit codes (2 / 3 / 4
// / 8 rows 12.5 / 13.0 / 15.4 / 20.1 ms through the buffer against 13.7 / 16.2 / 18.0 / 23.3;
// one row 7.9 against 12.9), 4 of Q8_0 (4 / 5 / 6 / 8 rows 15.4 / 21.2 / 25.6 / 27.7 fused
// against 18.0 / 19.8 / 20.1 / 23.6). Per-channel int8 stays fused there (2 / 3 / 4 / 8 rows
// 11.8 / 12.8 / 14.7 / 19.8 against 16.1 / 16.4 / 17.0 / 21.7).
inline int64_t fused_max_rows(bool nibbles, int64_t group) {
#if INT16_ROWS
  (void)nibbles, (void)group;
  return INT16_MAX_ROWS;
#else
  if (group != 32 || !intel_avx512_host()) return GROUP_ROWS;
  return nibbles ? 1 : 4;
#endif
}

constexpr int64_t BUFFER_FLOATS = 16384;  // floats of expanded weight rows per tile (64 KB)

template <typename Scale>
inline float to_float(const Scale* values, int64_t i) {
  Scale value;
  std::memcpy(&value, values + i, sizeof(Scale));
  return static_cast<float>(value);
}

struct Quantized {
  const uint8_t* codes;  // row n at codes + n * row_bytes
  const void* scale;     // [N, groups]
  const void* offset;    // [N, groups], or nullptr
  int64_t row_bytes, groups, group, k, n;
  float code_offset;
  bool half;  // scales and offsets are float16 (else float32)
};

inline v8 expand8(const uint8_t* row, int64_t i) {  // 8 int8 codes -> 8 floats
#ifdef __AVX2__
  const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + i));
  return (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes));
#else
  i8x8 c;
  std::memcpy(&c, row + i, 8);
  return __builtin_convertvector(__builtin_convertvector(c, i32x8), v8);
#endif
}

// 32 codes of a block starting at input i of a row -> 4 x 8 floats (inputs i .. i + 31).
// (GCC 12 turns __builtin_convertvector of 8-bit lanes to floats into one scalar conversion a
// lane, hence the AVX2 intrinsics; the portable branch is for other CPUs.)
template <bool NIBBLES>
inline void expand32(const uint8_t* row, int64_t i, v8 w[4]) {
  if constexpr (NIBBLES) {
#ifdef __AVX2__
    const __m256i mask = _mm256_set1_epi32(15);
    const __m256i first = _mm256_cvtepu8_epi32(  // bytes 0..7 of the block, one a lane
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + static_cast<uint64_t>(i) / 2)));
    const __m256i second = _mm256_cvtepu8_epi32(  // bytes 8..15
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + static_cast<uint64_t>(i) / 2 + 8)));
    w[0] = (v8)_mm256_cvtepi32_ps(_mm256_and_si256(first, mask));   // inputs 0..7
    w[1] = (v8)_mm256_cvtepi32_ps(_mm256_and_si256(second, mask));  // inputs 8..15
    w[2] = (v8)_mm256_cvtepi32_ps(_mm256_srli_epi32(first, 4));     // inputs 16..23
    w[3] = (v8)_mm256_cvtepi32_ps(_mm256_srli_epi32(second, 4));    // inputs 24..31
#else
    u8x8 first, second;  // bytes 0..7 and 8..15 of the block
    std::memcpy(&first, row + i / 2, 8);
    std::memcpy(&second, row + static_cast<uint64_t>(i) / 2 + 8, 8);
    w[0] = __builtin_convertvector(__builtin_convertvector(first & 15, i32x8), v8);
    w[1] = __builtin_convertvector(__builtin_convertvector(second & 15, i32x8), v8);
    w[2] = __builtin_convertvector(__builtin_convertvector(first >> 4, i32x8), v8);
    w[3] = __builtin_convertvector(__builtin_convertvector(second >> 4, i32x8), v8);
#endif
  } else {
    _Pragma("GCC unroll 4") for (int a = 0; a < 4; ++a) w[a] = expand8(row, i + 8 * a);
  }
}

inline v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof(v8));
  return v;
}

// 8 float16 values from p as float32 (F16C's conversion where the CPU has it).
inline v8 load8_half(const _Float16* p) {
#ifdef __F16C__
  return (v8)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  v8 out;
  for (int lane = 0; lane < 8; ++lane) out[lane] = to_float(p, lane);
  return out;
#endif
}

// Weight row col's `groups` scales (values = q.scale) or offsets (q.offset) as float32: the
// row itself, or widened from float16 into `out` (32-byte aligned: RowValues).
inline const float* row_values(const Quantized& q, const void* values, int64_t col, float* out) {
  if (!q.half) return static_cast<const float*>(values) + col * q.groups;
  const _Float16* row = static_cast<const _Float16*>(values) + col * q.groups;
  int64_t g = 0;
  for (; g + 8 <= q.groups; g += 8)  // out is 32-byte aligned: whole stores (a split one
    //                                   cannot forward to the loads that follow)
    *reinterpret_cast<v8*>(__builtin_assume_aligned(out + g, sizeof(v8))) = load8_half(row + g);
  for (; g < q.groups; ++g) out[g] = to_float(row, g);
  return out;
}

// Scratch for one row's scales and offsets as float32, each 32-byte aligned (row_values).
struct RowValues {
  std::vector<v8> storage;
  int64_t stride;  // floats from the scales to the offsets
  explicit RowValues(int64_t groups)
      : storage(2 * ((groups + 15) / 8)), stride(8 * ((groups + 15) / 8)) {}
  float* scales() { return reinterpret_cast<float*>(storage.data()); }
  float* offsets() { return scales() + stride; }
};

#ifdef __AVX512F__

// 32 codes from input i of a row -> 2 x 16 floats (inputs i .. i + 15, i + 16 .. i + 31).
template <bool NIBBLES>
inline void expand32(const uint8_t* row, int64_t i, v16 w[2]) {
  if constexpr (NIBBLES) {  // the block's 16 bytes, one a lane: low nibbles, then high ones
    const __m512i bytes = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + static_cast<uint64_t>(i) / 2)));
    w[0] = (v16)_mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(15)));
    w[1] = (v16)_mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
  } else {
    _Pragma("GCC unroll 2") for (int h = 0; h < 2; ++h)
      w[h] = (v16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i + 16 * h))));
  }
}

using BlockVector = v16;  // 16 lanes: half the instructions, which the widening makes the bound
#else
using BlockVector = v8;
#endif

template <typename V>
inline V load_lanes(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}

// fused_rows' products for groups of 32 inputs (GGUF blocks), in vectors V (8 or 16 lanes):
// totals[r] = sum_g scale_g * (x_g . code_g) for the ROWS input rows. One or two rows: each
// block's product in two chains, times its scale, into one of two running sums; more rows:
// the block's weights scaled once and multiplied into every row's sums.
template <int ROWS, bool NIBBLES, typename V>
void block_dots(const Quantized& q, const uint8_t* row, const float* x, const float* row_scales,
                float* totals) {
  constexpr int LANES = sizeof(V) / sizeof(float), PARTS = 32 / LANES;
  V acc[ROWS][2];
  _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = V{};
  for (int64_t g = 0; g < q.groups; g += 2) {  // two blocks a turn: two running sums
    _Pragma("GCC unroll 2") for (int half = 0; half < 2; ++half) {
      if (half == 1 && g + 1 == q.groups) break;
      V w[PARTS];
      expand32<NIBBLES>(row, 32 * (g + half), w);
      const float* xg = x + 32 * (g + half);
      if constexpr (ROWS <= 2) {
        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; ++r) {
          const float* xr = xg + r * q.k;
          V product = load_lanes<V>(xr) * w[0];  // 16 lanes: one chain of two
          if constexpr (PARTS == 2) {
            product += load_lanes<V>(xr + LANES) * w[1];
          } else {  // 8 lanes: two chains of two
            V back = load_lanes<V>(xr + LANES * (PARTS / 2)) * w[PARTS / 2];
            _Pragma("GCC unroll 2") for (int p = 1; p < PARTS / 2; ++p) {
              product += load_lanes<V>(xr + LANES * p) * w[p];
              back += load_lanes<V>(xr + LANES * (PARTS / 2 + p)) * w[PARTS / 2 + p];
            }
            product += back;
          }
          acc[r][half] += product * row_scales[g + half];
        }
      } else {
        _Pragma("GCC unroll 4") for (int p = 0; p < PARTS; ++p) w[p] *= row_scales[g + half];
        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; ++r)
          _Pragma("GCC unroll 4") for (int p = 0; p < PARTS; ++p)
            acc[r][half] += load_lanes<V>(xg + r * q.k + LANES * p) * w[p];
      }
    }
  }
  _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; ++r)
    totals[r] = sum_lanes(acc[r][0] + acc[r][1]);
}

// 8 lanes as the first 8 of a V (8 or 16 lanes), the rest zero.
template <typename V>
inline V first_lanes(v8 v) {
  if constexpr (sizeof(V) == sizeof(v8)) {
    return v;
  } else {
    V lanes{};  // by memcpy, not __builtin_shufflevector (which GCC has only from 12)
    std::memcpy(&lanes, &v, sizeof(v8));
    return lanes;
  }
}

// fused_rows' products for groups longer than 32 inputs (int8 rows, whole-row groups), in
// vectors V (8 or 16 lanes): totals[r] = sum_g scale_g * (x_g . code_g). CHAINS independent
// sums a row, summed at the group's end; with 16 lanes two blocks a turn feed four chains.
// An int8 group's last 8 * j inputs (past its multiple of 32) run in 8 lanes.
template <int ROWS, bool NIBBLES, typename V>
void group_dots(const Quantized& q, const uint8_t* row, const float* x, const float* row_scales,
                float* totals) {
  constexpr int LANES = sizeof(V) / sizeof(float), PARTS = 32 / LANES;
  constexpr int CHAINS = ROWS <= 2 ? 4 : ROWS <= 4 ? 2 : 1;
  constexpr int TURN = CHAINS > PARTS ? CHAINS / PARTS : 1;  // blocks a turn
  const int64_t whole = q.group - q.group % 32;  // inputs of a group taken 32 at a time
  V acc[ROWS];
  _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; ++r) acc[r] = V{};
  for (int64_t g = 0; g < q.groups; ++g) {
    const int64_t start = g * q.group;
    V part[ROWS][4];
    _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; ++r)
      _Pragma("GCC unroll 4") for (int c = 0; c < 4; ++c) part[r][c] = V{};
    // the 32-input block at input `at` into the chains of turn slot t (inlined where t is
    // known, so the chains stay in registers)
    auto add_block = [&](int64_t at, int t) __attribute__((always_inline)) {
      V w[PARTS];
      expand32<NIBBLES>(row, at, w);
      _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; ++r)
        _Pragma("GCC unroll 4") for (int p = 0; p < PARTS; ++p)
          part[r][(t * PARTS + p) % CHAINS] += load_lanes<V>(x + r * q.k + at + LANES * p) * w[p];
    };
    int64_t i = start;
    for (; i + 32 * TURN <= start + whole; i += 32 * TURN)
      _Pragma("GCC unroll 2") for (int t = 0; t < TURN; ++t) add_block(i + 32 * t, t);
    for (; i < start + whole; i += 32) add_block(i, 0);  // a block left over from the turns
    if constexpr (!NIBBLES) {  // int8 groups of 8 * j inputs
      for (int64_t j = start + whole; j < start + q.group; j += 8) {
        const v8 w = expand8(row, j);
        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; ++r)
          part[r][0] += first_lanes<V>(load8(x + r * q.k + j) * w);
      }
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; ++r)
      acc[r] += ((part[r][0] + part[r][1]) + (part[r][2] + part[r][3])) * row_scales[g];
  }
  _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; ++r) totals[r] = sum_lanes(acc[r]);
}

#if INT16_ROWS
// Input rows as int16 codes, each 32-input block with its own step (max |block| / 32767), for
// the integer path of int16_dots; empty where the rows hold a NaN or an infinity.
struct RoundedRows {
  std::vector<int16_t> codes;  // [M, K]
  std::vector<float> steps;    // [M, K / 32]
};

inline RoundedRows round_rows(const float* x, int64_t m, int64_t k) {
  RoundedRows out;
  out.codes.resize(m * k);
  out.steps.resize(m * (k / 32));
  for (int64_t b = 0; b < m * (k / 32); ++b) {  // k is a multiple of 32: blocks run on across rows
    out.steps[b] = round_to_int16(x + 32 * b, 32, &out.codes[32 * b]);
    if (out.steps[b] < 0.0f) return RoundedRows{};
  }
  return out;
}

// Block b's 32 codes of a weight row as two vectors of 16 int16 (inputs 0..15, 16..31).
template <bool NIBBLES>
inline void widen_block(const uint8_t* row, int64_t b, __m256i* low, __m256i* high) {
  if constexpr (NIBBLES) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * b));
    const __m128i mask = _mm_set1_epi8(15);
    *low = _mm256_cvtepu8_epi16(_mm_and_si128(bytes, mask));
    *high = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask));
  } else {
    *low = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 32 * b)));
    *high = _mm256_cvtepi8_epi16(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 32 * b + 16)));
  }
}

// fused_rows' products with the input rows as int16 codes (round_rows), groups of a multiple
// of 32 inputs: totals[r] = sum_g scale_g * sum_b step_rb * (xcodes_rb . code_b). A block's 32
// products are two multiply-adds of int16 pairs into 8 int32 lanes and one conversion to
// float, where widening the codes to floats takes four conversions (the bound on AVX2 cores
// that run 256-bit conversions as two halves).
template <int ROWS, bool NIBBLES>
void int16_dots(const Quantized& q, const uint8_t* row, const RoundedRows& xr,
                const float* row_scales, float* totals) {
  const int64_t blocks = q.k / 32, per_group = q.group / 32;
  const int16_t* codes = xr.codes.data();
  const float* steps = xr.steps.data();
  // the int32 sums of block b's products with row r, as floats
  auto block_sums = [&](int64_t b, v8* out) {
    __m256i low, high;
    widen_block<NIBBLES>(row, b, &low, &high);
    _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; ++r) {
      const int16_t* xb = codes + r * q.k + 32 * b;
      const __m256i sums = _mm256_add_epi32(
          _mm256_madd_epi16(low, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb))),
          _mm256_madd_epi16(high, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 16))));
      out[r] = (v8)_mm256_cvtepi32_ps(sums);
    }
  };
  if (per_group == 1) {  // GGUF blocks: independent sums for consecutive blocks (a chain of
    //                      one multiply-add a block would bound the loop by its latency)
    constexpr int CHAINS = ROWS == 1 ? 4 : 2;
    v8 acc[ROWS][CHAINS];
    _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; ++r)
      _Pragma("GCC unroll 4") for (int c = 0; c < CHAINS; ++c) acc[r][c] = v8{};
    int64_t b = 0;
    for (; b + CHAINS <= blocks; b += CHAINS)
      _Pragma("GCC unroll 4") for (int c = 0; c < CHAINS; ++c) {
        v8 sums[ROWS];
        block_sums(b + c, sums);
        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; ++r)
          acc[r][c] += sums[r] * (steps[r * blocks + b + c] * row_scales[b + c]);
      }
    for (; b < blocks; ++b) {
      v8 sums[ROWS];
      block_sums(b, sums);
      _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; ++r)
        acc[r][0] += sums[r] * (steps[r * blocks + b] * row_scales[b]);
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; ++r) {
      v8 total = acc[r][0];
      _Pragma("GCC unroll 4") for (int c = 1; c < CHAINS; ++c) total += acc[r][c];
      totals[r] = sum_lanes(total);
    }
    return;
  }
  v8 acc[ROWS];  // longer groups: a group's blocks summed, then its scale
  _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; ++r) acc[r] = v8{};
  for (int64_t g = 0; g < q.groups; ++g) {
    v8 part[ROWS];
    _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; ++r) part[r] = v8{};
    for (int64_t j = 0; j < per_group; ++j) {
      const int64_t b = g * per_group + j;
      v8 sums[ROWS];
      block_sums(b, sums);
      _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; ++r) part[r] += sums[r] * steps[r * blocks + b];
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; ++r) acc[r] += part[r] * row_scales[g];
  }
  _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; ++r) totals[r] = sum_lanes(acc[r]);
}
#endif

// Up to a row group of input rows against weight rows [begin, end), codes multiplied as they
// are widened. xsums: ROWS x groups sums of x over each group (read when groups are shifted).
// Groups of 32 (GGUF blocks) run block_dots; longer groups keep product chains summed at the
// group's end. A row's scales are widened to float32 once, and its shifts
// sum_g (offset_g - scale_g * code_offset) * xsums_g are one dot product.
template <int ROWS, bool NIBBLES>
void fused_rows(const Quantized& q, const float* x, const float* xsums, const void* rounded,
                float* y, int64_t begin, int64_t end) {
  const bool shifted = q.offset != nullptr || q.code_offset != 0.0f;
  RowValues widened(q.groups);  // one row's scales and offsets as float32
  for (int64_t col = begin; col < end; ++col) {
    const uint8_t* row = q.codes + col * q.row_bytes;
    const float* row_scales = row_values(q, q.scale, col, widened.scales());
    const float* row_offsets =
        q.offset ? row_values(q, q.offset, col, widened.offsets()) : nullptr;
    float shift_total[ROWS] = {};
    if (shifted) {  // sum_g (offset_g - scale_g * code_offset) * xsums_g, 8 groups at a time
      v8 shift_sum[ROWS];
      _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; ++r) shift_sum[r] = v8{};
      int64_t g = 0;
      for (; g + 8 <= q.groups; g += 8) {
        const v8 shift = (row_offsets ? load8(row_offsets + g) : v8{}) -
                         load8(row_scales + g) * q.code_offset;
        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; ++r)
          shift_sum[r] += shift * load8(xsums + r * q.groups + g);
      }
      _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; ++r) {
        shift_total[r] = sum_lanes(shift_sum[r]);
        for (int64_t h = g; h < q.groups; ++h)
          shift_total[r] += ((row_offsets ? row_offsets[h] : 0.0f) -
                             row_scales[h] * q.code_offset) * xsums[r * q.groups + h];
      }
    }
#if INT16_ROWS
    if (rounded != nullptr) {
      float totals[ROWS];
      int16_dots<ROWS, NIBBLES>(q, row, *static_cast<const RoundedRows*>(rounded), row_scales,
                                totals);
      _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; ++r)
        y[r * q.n + col] = totals[r] + shift_total[r];
      continue;
    }
#endif
    if (q.group == 32) {
      float totals[ROWS];
      block_dots<ROWS, NIBBLES, BlockVector>(q, row, x, row_scales, totals);
      _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; ++r)
        y[r * q.n + col] = totals[r] + shift_total[r];
      continue;
    }
    float totals[ROWS];
    group_dots<ROWS, NIBBLES, BlockVector>(q, row, x, row_scales, totals);
    _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; ++r)
      y[r * q.n + col] = totals[r] + shift_total[r];
  }
}

// Weight row col expanded to K floats: scale * (code - code_offset) + offset.
template <bool NIBBLES>
void expand_row(const Quantized& q, int64_t col, float* out, RowValues& widened) {
  const uint8_t* row = q.codes + col * q.row_bytes;
  const float* scales = row_values(q, q.scale, col, widened.scales());
  const float* offsets = q.offset ? row_values(q, q.offset, col, widened.offsets()) : nullptr;
  const int64_t whole = q.group - q.group % 32;
  for (int64_t g = 0; g < q.groups; ++g) {
    const int64_t start = g * q.group;
    const float scale = scales[g];
    const float offset = offsets ? offsets[g] : 0.0f;
    for (int64_t i = start; i < start + whole; i += 32) {
      v8 w[4];
      expand32<NIBBLES>(row, i, w);
      _Pragma("GCC unroll 4") for (int a = 0; a < 4; ++a) {
        const v8 value = (w[a] - q.code_offset) * scale + offset;
        std::memcpy(out + i + 8 * a, &value, sizeof(v8));
      }
    }
    if constexpr (!NIBBLES) {
      for (int64_t i = start + whole; i < start + q.group; i += 8) {
        const v8 value = (expand8(row, i) - q.code_offset) * scale + offset;
        std::memcpy(out + i, &value, sizeof(v8));
      }
    }
  }
}

// Rows [0, m) of x against weight rows [begin, end); fused: the codes multiplied as they are
// widened (m <= fused_max_rows, xsums taken), else through the float buffer.
template <bool NIBBLES>
void quantized_block(const Quantized& q, const float* x, int64_t m, bool fused,
                     const float* xsums, const void* rounded, float* y, int64_t begin,
                     int64_t end) {
  if (fused) switch (m) {
    case 1: return fused_rows<1, NIBBLES>(q, x, xsums, rounded, y, begin, end);
    case 2: return fused_rows<2, NIBBLES>(q, x, xsums, rounded, y, begin, end);
    case 3: return fused_rows<3, NIBBLES>(q, x, xsums, rounded, y, begin, end);
    case 4: return fused_rows<4, NIBBLES>(q, x, xsums, rounded, y, begin, end);
#if GROUP_ROWS_IS_8
    case 5: return fused_rows<5, NIBBLES>(q, x, xsums, rounded, y, begin, end);
    case 6: return fused_rows<6, NIBBLES>(q, x, xsums, rounded, y, begin, end);
    case 7: return fused_rows<7, NIBBLES>(q, x, xsums, rounded, y, begin, end);
    case 8: return fused_rows<8, NIBBLES>(q, x, xsums, rounded, y, begin, end);
#endif
    default: break;
  }
  const int64_t tile_rows = std::max<int64_t>(1, std::min<int64_t>(16, BUFFER_FLOATS / q.k));
  std::vector<float> expanded(tile_rows * q.k);  // [tile_rows, K]
  RowValues widened(q.groups);  // a row's scales and offsets
  for (int64_t col = begin; col < end; col += tile_rows) {
    const int64_t count = std::min(tile_rows, end - col);
    for (int64_t c = 0; c < count; ++c)
      expand_row<NIBBLES>(q, col + c, &expanded[c * q.k], widened);
    block(x, m, q.k, expanded.data(), y + col, q.n, 0, count, false);  // rows in L1
  }
}

// Weight rows a claimed block of m input rows covers: on Intel hosts one contiguous share a
// thread, as few_rows.h's block_rows_for gives float32 weights there, for int8 codes, and for
// 4-bit codes on AVX2 builds beyond one row. 30 SmolLM2 layers, 1 / 4 / 8 rows, against
// 64-row blocks: AVX2 build, per-channel int8 9.0-9.1 / - / 22.3-22.4 ms against 9.8-9.9 / -
// / 23.8-24.3, Q4_1 at 8 rows 19.1-19.4 against 21.9-22.2 (one row 8.7-9.0 against 8.4-8.7);
// AVX-512 build, per-channel int8 9.2-9.6 / 12.9-13.1 / 17.0-17.4 against 10.2-10.5 /
// 13.8-14.5 / 17.8-19.1, Q8_0 9.9-10.0 / 14.9-15.1 / 21.1-21.2 against 10.5-10.6 /
// 15.2-15.9 / 23.0-23.4, Q4_1 at 8 rows 18.3-19.0 against 18.0-18.3 and one row 9.0 against
// 8.0. Elsewhere BLOCK_ROWS.
inline int64_t quantized_block_rows(int64_t n, int64_t threads, bool nibbles, int64_t m) {
  const bool shares = intel_host() && (!nibbles || (REGISTERS == 16 && m > 1));
  return shares ? contiguous_share(n, threads) : BLOCK_ROWS;
}

template <bool NIBBLES>
void run(ffi::ThreadPool& pool, const Quantized& q, const float* x, int64_t m, float* y) {
  const void* rounded = nullptr;  // the integer path's input rows (groups of 32 j inputs)
#if INT16_ROWS
  RoundedRows rows;
  if (m <= INT16_MAX_ROWS && q.group % 32 == 0) {
    rows = round_rows(x, m, q.k);
    if (!rows.codes.empty()) rounded = &rows;
  }
#endif
  // [m, groups] sums of x over each group, for the fused path's shifts: of the rows as the
  // products see them (rounded or not), so the call is one product of those rows
  const bool fused = m <= fused_max_rows(NIBBLES, q.group);
  std::vector<float> xsums;
  if (fused && (q.offset != nullptr || q.code_offset != 0.0f)) {
    xsums.assign(m * q.groups, 0.0f);
    for (int64_t r = 0; r < m; ++r)
      for (int64_t g = 0; g < q.groups; ++g) {
        float& sum = xsums[r * q.groups + g];
        for (int64_t i = g * q.group; i < (g + 1) * q.group; ++i) {
#if INT16_ROWS
          if (rounded) {
            sum += rows.codes[r * q.k + i] * rows.steps[(r * q.k + i) / 32];
            continue;
          }
#endif
          sum += x[r * q.k + i];
        }
      }
  }
  const float* sums = xsums.data();
  run_blocks(pool, q.n, [&q, x, m, fused, sums, rounded, y](int64_t begin, int64_t end) {
    quantized_block<NIBBLES>(q, x, m, fused, sums, rounded, y, begin, end);
  }, quantized_block_rows(q.n, pool.num_threads(), NIBBLES, m));
}

// codes: int8 [N, K] or uint8 [N, K / 2], or a stack [L, N, ...] of which `layer` is read;
// scale, offset: float32 or float16 [(L,) N, G] (offset empty: none).
ffi::Error QuantizedRowsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer codes,
                             ffi::AnyBuffer scale, ffi::AnyBuffer offset,
                             ffi::ResultBuffer<ffi::F32> y, int64_t layer, int64_t code_offset) {
  const auto code_dims = codes.dimensions();
  const auto scale_dims = scale.dimensions();
  const size_t rank = code_dims.size();
  const bool nibbles = codes.element_type() == ffi::DataType::U8;
  if (!nibbles && codes.element_type() != ffi::DataType::S8)
    return ffi::Error::InvalidArgument("quantized_rows: codes must be int8 or uint8");
  if (scale.element_type() != ffi::DataType::F32 && scale.element_type() != ffi::DataType::F16)
    return ffi::Error::InvalidArgument("quantized_rows: scales must be float32 or float16");
  const bool has_offset = offset.element_count() != 0;
  if (has_offset && offset.element_type() != scale.element_type())
    return ffi::Error::InvalidArgument("quantized_rows: offsets must have the scales' dtype");
  if ((rank != 2 && rank != 3) || scale_dims.size() != rank ||
      (has_offset && offset.dimensions().size() != rank))
    return ffi::Error::InvalidArgument("quantized_rows: codes [N, Kc] or [L, N, Kc] expected");
  const int64_t layers = rank == 3 ? code_dims[0] : 1;
  if (layer < 0 || layer >= layers)
    return ffi::Error::InvalidArgument("quantized_rows: layer outside the weight stack");
  Quantized q;
  q.n = code_dims[rank - 2];
  q.row_bytes = code_dims[rank - 1];
  q.k = nibbles ? 2 * q.row_bytes : q.row_bytes;
  q.groups = scale_dims[rank - 1];
  if (x.dimensions().size() < 1 || x.dimensions().back() != q.k || scale_dims[rank - 2] != q.n ||
      q.groups < 1 || q.k % q.groups)
    return ffi::Error::InvalidArgument("quantized_rows: x [..., K], scales [N, G] with G | K");
  q.group = q.k / q.groups;
  if (q.group % (nibbles ? 32 : 8))
    return ffi::Error::InvalidArgument("quantized_rows: groups of 32 (4-bit) or 8 (int8) inputs");
  const int64_t scale_bytes = scale.element_type() == ffi::DataType::F32 ? 4 : 2;
  q.codes = static_cast<const uint8_t*>(codes.untyped_data()) + layer * q.n * q.row_bytes;
  q.scale = static_cast<const char*>(scale.untyped_data()) + layer * q.n * q.groups * scale_bytes;
  q.offset = has_offset ? static_cast<const char*>(offset.untyped_data()) +
                              layer * q.n * q.groups * scale_bytes
                        : nullptr;
  q.code_offset = static_cast<float>(code_offset);
  q.half = scale_bytes == 2;
  const float* xs = x.typed_data();
  float* ys = y->typed_data();
  if (q.k == 0) {
    std::fill(ys, ys + y->element_count(), 0.0f);
    return ffi::Error::Success();
  }
  const int64_t m = static_cast<int64_t>(x.element_count()) / q.k;
  if (m == 0 || q.n == 0) return ffi::Error::Success();
  if (nibbles) run<true>(pool, q, xs, m, ys); else run<false>(pool, q, xs, m, ys);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgenQuantizedRows, QuantizedRowsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("layer")
                                  .Attr<int64_t>("code_offset"));

// The most input rows the fused path rounds to int16 codes, each 32-input block with its own
// step, for groups of a multiple of 32 inputs (0: none, float rows), for the Python side
// (`quantized_rows.rounded_row_limit`).
extern "C" int JaxgenQuantizedRowsRoundedRows() { return static_cast<int>(INT16_MAX_ROWS); }
