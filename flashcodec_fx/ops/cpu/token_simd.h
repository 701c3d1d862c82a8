// The SIMD inner loops of the per-token attention kernel (token_attention.cpp): scores and value sums straight from
// packed codes, the levels expanded in registers, never in a row in memory.
//
// A query tile of M rows (GQA heads x query tokens of one kv head) shares every code load: 8 codes of a stored row
// (channels 8j .. 8j + 7) become 8 unscaled levels in one 8-lane register: the bit slices of codecs/pack.py are
// shifted into dword lanes and the level table (at most 16 fp32 values for 1-4 bits) is held in one or two
// registers and read with a cross-lane permute (`vpermps`, the float form of a byte shuffle); 8-bit codes (affine
// levels: code + offset) convert directly. Then M FMAs use those levels. Dot products accumulate per lane over the
// row and are reduced 8 rows at a time by one transposing horizontal sum. The value loop keeps M x C accumulator
// registers (C chunks of 8 channels) over a run of tokens and expands each code chunk once.
//
// Build-time selection: the compiler's own macros say what -march=native enabled (build.py). AVX2 + FMA + F16C: the code
// below; anything else (including AArch64, where no NEON intrinsics are written yet): the portable path of
// token_attention.cpp. simd_isa() names the compiled choice, simd_loops(D) the loops serving head_dim D; row_codes / with_decoder / with_rows pick the loops for a
// codec and a tile (also used by the vLLM plugin's per-token kernel, vllm/cpu/paged_attention.cpp).

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define FC_TOKEN_AVX2 1
#include <immintrin.h>
#endif

namespace fc {

inline const char* simd_isa() {
#if defined(FC_TOKEN_AVX2) && defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__AVX512BW__)
  return "avx512";
#elif defined(FC_TOKEN_AVX2)
  return "avx2";
#else
  return "portable";
#endif
}

// The loops that read codes of head_dim D: the AVX-512 ones need D % 16 == 0 (AVX2 serves the others).
inline const char* simd_loops(int D) {
  const char* isa = simd_isa();
  return std::strcmp(isa, "avx512") == 0 && D % 16 != 0 ? "avx2" : isa;
}

#ifdef FC_TOKEN_AVX2
// How far ahead of the row being read the code loops ask for rows (a prefetch hint per row): in a model the codes
// come from L3 or memory (the layer's weights went through the caches since its last step), and a row read when it
// is needed stalls on its cache line (an archive read from L3 took 1.9x its time from L2, most of it on each token's
// first code load).
constexpr int64_t kPrefetchBytes = 2048;

// A decoder's operator(): always inlined into the code loops (GCC left the trellis decoders as calls, one per chunk
// of a token, in the value loop).
#define FC_DECODE inline __attribute__((always_inline))

inline void prefetch_row(const uint8_t* row) { __builtin_prefetch(row + kPrefetchBytes, 0, 3); }

namespace avx2 {

constexpr int kLanes = 8;  // fp32 lanes of a register: one chunk of 8 channels

// The codes of channels 8j .. 8j + 7 of one W-bit slice (channel d in byte d * W / 8, at bit d * W % 8) as dwords.
template <int W>
inline __m256i slice_codes(const uint8_t* slice, int j);

template <>
inline __m256i slice_codes<8>(const uint8_t* slice, int j) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(slice + 8 * j)));
}

template <>
inline __m256i slice_codes<4>(const uint8_t* slice, int j) {
  uint32_t word;
  std::memcpy(&word, slice + 4 * j, sizeof(word));
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(word)), shifts), _mm256_set1_epi32(15));
}

template <>
inline __m256i slice_codes<2>(const uint8_t* slice, int j) {
  uint16_t word;
  std::memcpy(&word, slice + 2 * j, sizeof(word));
  const __m256i shifts = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
  return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(word), shifts), _mm256_set1_epi32(3));
}

template <>
inline __m256i slice_codes<1>(const uint8_t* slice, int j) {
  const __m256i shifts = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(slice[j]), shifts), _mm256_set1_epi32(1));
}

// Unscaled levels of BITS-bit codes (1: one 1-bit slice; 2: one 2-bit slice; 3: a 2-bit then a 1-bit slice; 4: one
// 4-bit slice; 8: one byte per code, affine levels) from a level table of 2**BITS entries (8-bit: code + offset).
template <int BITS>
struct Codes {
  __m256 lo, hi;        // table entries 0..7 and 8..15 (zero past the table)
  __m256 offset;        // 8-bit: level = code + offset
  int64_t high_slice;   // 3-bit: byte offset of the 1-bit slice (D / 4)

  Codes(const float* table, float level_offset, int D) {
    alignas(32) float t[16] = {};
    if (BITS < 8)
      for (int e = 0; e < (1 << BITS); ++e) t[e] = table[e];
    lo = _mm256_load_ps(t);
    hi = _mm256_load_ps(t + 8);
    offset = _mm256_set1_ps(level_offset);
    high_slice = D / 4;
  }

  FC_DECODE __m256 operator()(const uint8_t* row, int j) const {
    if constexpr (BITS == 8) {
      return _mm256_add_ps(_mm256_cvtepi32_ps(slice_codes<8>(row, j)), offset);
    } else if constexpr (BITS == 4) {
      const __m256i c = slice_codes<4>(row, j);
      const __m256 low = _mm256_permutevar8x32_ps(lo, c), high = _mm256_permutevar8x32_ps(hi, c);
      return _mm256_blendv_ps(low, high, _mm256_castsi256_ps(_mm256_slli_epi32(c, 28)));  // bit 3 selects
    } else if constexpr (BITS == 3) {
      const __m256i c = _mm256_or_si256(slice_codes<2>(row, j), _mm256_slli_epi32(slice_codes<1>(row + high_slice, j), 2));
      return _mm256_permutevar8x32_ps(lo, c);
    } else if constexpr (BITS == 2) {
      return _mm256_permutevar8x32_ps(lo, slice_codes<2>(row, j));
    } else {
      static_assert(BITS == 1, "SIMD code widths: 1, 2, 3, 4, 8");
      return _mm256_permutevar8x32_ps(lo, slice_codes<1>(row, j));
    }
  }
};

// Unscaled values of BITS-bit trellis codes (levels="tcq", 1..4 bits: trellis.h): the alphabet index of channel t is
// ((c[t] >> 1) << 2) | l[t-2] | (l[t] ^ l[t-1] ^ l[t-3]) << 1 (l: the codes' low bits, 0 before the row), read from
// the 2**(BITS+1) alphabet with cross-lane permutes, as Codes<4> reads its table (at most 16 values: two registers).
// The 4-bit alphabet (32 values) is symmetric (codecs/trellis.py: entry 31 - a is -entry a, exactly; the constructor
// checks it), so it is read from its lower half at the index's low bits flipped where bit 4 is set, and bit 4 flips the
// sign: two permutes, a blend and an xor where the whole alphabet took four permutes and three blends (4bit-tcq at 16k
// tokens 1.40-1.43x -> 1.36-1.38x the scalar codes' time, results/trellis_speed_avx2_ab/; the same read for 3 bits,
// one permute and a sign flip instead of two permutes and a blend, measured no faster and was dropped).
// The low bits of the 8 channels before the chunk come from that chunk's codes (no state carried between calls).
// The subsets of 8 channels t = 8j .. 8j + 7 from the low bits of channels 8j - 3 .. 8j + 7 (11 bits, bit k: channel
// 8j - 3 + k): l[t-2] | (l[t] ^ l[t-1] ^ l[t-3]) << 1, one byte per channel (2048 x 8 bytes, built once).
struct TcqSubsets {
  alignas(64) uint8_t table[2048][8];
  TcqSubsets() {
    for (int x = 0; x < 2048; ++x)
      for (int i = 0; i < 8; ++i) {
        const int l3 = (x >> i) & 1, l2 = (x >> (i + 1)) & 1, l1 = (x >> (i + 2)) & 1, l0 = (x >> (i + 3)) & 1;
        table[x][i] = static_cast<uint8_t>(l2 | ((l0 ^ l1 ^ l3) << 1));
      }
  }
  static const TcqSubsets& get() {
    static const TcqSubsets instance;
    return instance;
  }
};

template <int BITS>
struct TcqCodes {
  __m256 t[2];  // alphabet entries 0..7 and 8..15 (zero past the alphabet; 4 bits: its lower half)
  int64_t high_slice;
  const uint8_t (*subsets)[8];

  TcqCodes(const float* alphabet, float, int D) : subsets(TcqSubsets::get().table) {
    constexpr int n = 2 << BITS;
    alignas(32) float a[32] = {};
    for (int e = 0; e < n; ++e) a[e] = alphabet[e];
    if constexpr (BITS == 4)
      for (int e = 0; e < n / 2; ++e)
        TORCH_CHECK(a[n - 1 - e] == -a[e], "trellis codes: the ", BITS, "-bit alphabet is not symmetric (entry ",
                    n - 1 - e, " must be -entry ", e, "): the SIMD decode reads its lower half");
    for (int i = 0; i < 2; ++i) t[i] = _mm256_load_ps(a + 8 * i);
    high_slice = D / 4;
  }

  __m256i codes(const uint8_t* row, int j) const {
    if constexpr (BITS == 3)
      return _mm256_or_si256(slice_codes<2>(row, j), _mm256_slli_epi32(slice_codes<1>(row + high_slice, j), 2));
    else
      return slice_codes<BITS>(row, j);
  }

  // Bit k: the low bit of the code of channel 8j - 8 + k (0 before the row), k < 16.
  FC_DECODE static int window(const uint8_t* row, int j) {
    if constexpr (BITS == 1) {  // the 1-bit slice: one byte per chunk
      return (j > 0 ? row[j - 1] : 0) | (row[j] << 8);
    } else {
#ifdef __BMI2__
      // 4-bit slice: 4 bytes per chunk, the low bit at bit 0 of each nibble; 2-bit slice (2 and 3 bits): 2 bytes per
      // chunk, the low bit at the even bits
      constexpr int per = BITS == 4 ? 4 : 2;
      constexpr uint64_t mask = BITS == 4 ? 0x1111111111111111ULL : 0x55555555ULL;
      uint64_t word = 0;  // constant-size copies: single loads
      if (j > 0) {
        std::memcpy(&word, row + per * (j - 1), 2 * per);
        return static_cast<int>(_pext_u64(word, mask));
      }
      std::memcpy(&word, row, per);
      return static_cast<int>(_pext_u64(word, mask)) << 8;
#else
      return low_bits(row, j - 1) | (low_bits(row, j) << 8);
#endif
    }
  }

  // The low bit of every code of chunk j (lane i: bit i), 0 for j < 0.
  FC_DECODE static int low_bits(const uint8_t* row, int j) {
    if (j < 0) return 0;
    const __m256i c = slice_codes<BITS == 4 ? 4 : 2>(row, j);  // the widest slice holds the low bit
    return _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_slli_epi32(c, 31)));
  }

  FC_DECODE __m256 operator()(const uint8_t* row, int j) const {
    const __m256i c = codes(row, j);
    // The window's bits 5..15 are the low bits of channels 8j - 3 .. 8j + 7: the 8 subsets, one table row.
    const __m256i sub = _mm256_cvtepu8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(subsets[window(row, j) >> 5])));
    const __m256i a = _mm256_or_si256(_mm256_slli_epi32(_mm256_srli_epi32(c, 1), 2), sub);
    if constexpr (BITS <= 2) return _mm256_permutevar8x32_ps(t[0], a);
    if constexpr (BITS == 3)  // 16 values: bit 3 of the index (shifted to the sign bit) picks the register
      return _mm256_blendv_ps(_mm256_permutevar8x32_ps(t[0], a), _mm256_permutevar8x32_ps(t[1], a),
                              _mm256_castsi256_ps(_mm256_slli_epi32(a, 28)));
    // 4 bits: bit 4 of the index as all ones; the lower half's index is a's low bits flipped there, and the sign flips
    const __m256i top = _mm256_srai_epi32(_mm256_slli_epi32(a, 27), 31);
    const __m256i m = _mm256_xor_si256(a, top);
    const __m256 sign = _mm256_castsi256_ps(_mm256_slli_epi32(top, 31));
    const __m256 bit3 = _mm256_castsi256_ps(_mm256_slli_epi32(m, 28));  // sign bit = bit 3 of the index
    return _mm256_xor_ps(_mm256_blendv_ps(_mm256_permutevar8x32_ps(t[0], m), _mm256_permutevar8x32_ps(t[1], m), bit3),
                         sign);
  }
};

// [sum(v[0]), ..., sum(v[7])]: eight horizontal sums in one register.
inline __m256 hsum8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(v[0], v[1]), b = _mm256_hadd_ps(v[2], v[3]);
  const __m256 c = _mm256_hadd_ps(v[4], v[5]), d = _mm256_hadd_ps(v[6], v[7]);
  const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

// Dot products of one token's levels with the M query rows, added into acc[u][m] for u < U tokens.
template <int M, int U, class Dec>
inline void token_dots(const float* q, int D, const uint8_t* row, int64_t stride, const Dec& dec, __m256 (&acc)[U][M]) {
  for (int u = 0; u < U; ++u)
    for (int m = 0; m < M; ++m) acc[u][m] = _mm256_setzero_ps();
  const int chunks = D / kLanes;
#pragma GCC unroll 8
  for (int j = 0; j < chunks; ++j) {
    __m256 lev[U];
    for (int u = 0; u < U; ++u) lev[u] = dec(row + u * stride, j);
    for (int m = 0; m < M; ++m) {
      const __m256 qv = _mm256_loadu_ps(q + m * D + kLanes * j);
      for (int u = 0; u < U; ++u) acc[u][m] = _mm256_fmadd_ps(qv, lev[u], acc[u][m]);
    }
  }
}

// out[m * out_stride + i] for i < n, 8 rows at a time: dots(U, row, acc) leaves each of U <= 2 rows' M dot products
// as 8-lane partial sums in acc[u][m], reduced here by one transposing horizontal sum per 8 rows (rows `stride` bytes
// apart from `first`).
template <int M, class Dots>
void reduce_dots(const uint8_t* first, int64_t stride, int64_t n, Dots&& dots, float* out, int64_t out_stride) {
  for (int64_t i0 = 0; i0 < n; i0 += kLanes) {
    const int count = static_cast<int>(std::min<int64_t>(kLanes, n - i0));
    __m256 parts[M][kLanes];
    const uint8_t* row = first + i0 * stride;
    int t = 0;
    for (; t + 2 <= count; t += 2) {
      prefetch_row(row + t * stride);
      prefetch_row(row + (t + 1) * stride);
      __m256 acc[2][M];
      dots(std::integral_constant<int, 2>(), row + t * stride, acc);
      for (int m = 0; m < M; ++m) { parts[m][t] = acc[0][m]; parts[m][t + 1] = acc[1][m]; }
    }
    if (t < count) {
      __m256 acc[1][M];
      dots(std::integral_constant<int, 1>(), row + t * stride, acc);
      for (int m = 0; m < M; ++m) parts[m][t] = acc[0][m];
      ++t;
    }
    for (; t < kLanes; ++t)
      for (int m = 0; m < M; ++m) parts[m][t] = _mm256_setzero_ps();
    for (int m = 0; m < M; ++m) {
      const __m256 sums = hsum8(parts[m]);
      if (count == kLanes) {
        _mm256_storeu_ps(out + m * out_stride + i0, sums);
      } else {
        alignas(32) float s[kLanes];
        _mm256_store_ps(s, sums);
        for (int k = 0; k < count; ++k) out[m * out_stride + i0 + k] = s[k];
      }
    }
  }
}

// out[m * out_stride + i] = q[m] . levels(row i) for i < n: M query rows (q: M x D), rows `stride` bytes apart.
template <int M, class Dec>
void code_dots(const float* q, int D, const uint8_t* first, int64_t stride, int64_t n, const Dec& dec, float* out,
               int64_t out_stride) {
  reduce_dots<M>(first, stride, n, [&](auto u, const uint8_t* row, auto& acc) {
    token_dots<M, decltype(u)::value>(q, D, row, stride, dec, acc);
  }, out, out_stride);
}

// acc[m * D + d] += sum_i w[m * w_stride + i] * levels(row i)[d] over channels of chunks j0 .. j0 + C - 1.
template <int M, int C, class Dec>
inline void code_axpys_chunks(const float* w, int64_t w_stride, int D, const uint8_t* first, int64_t stride, int64_t n,
                              const Dec& dec, float* acc, int j0) {
  __m256 a[C][M];
  for (int c = 0; c < C; ++c)
    for (int m = 0; m < M; ++m) a[c][m] = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* row = first + i * stride;
    if (j0 == 0) prefetch_row(row);
    __m256 wm[M];
    for (int m = 0; m < M; ++m) wm[m] = _mm256_broadcast_ss(w + m * w_stride + i);
    for (int c = 0; c < C; ++c) {
      const __m256 lev = dec(row, j0 + c);
      for (int m = 0; m < M; ++m) a[c][m] = _mm256_fmadd_ps(wm[m], lev, a[c][m]);
    }
  }
  for (int c = 0; c < C; ++c)
    for (int m = 0; m < M; ++m) {
      float* dst = acc + m * D + kLanes * (j0 + c);
      _mm256_storeu_ps(dst, _mm256_add_ps(_mm256_loadu_ps(dst), a[c][m]));
    }
}

constexpr int kValueChunks = 2;  // channel chunks per pass of the value loop: M x 2 accumulators (M <= 4)

template <int M, class Dec>
void code_axpys(const float* w, int64_t w_stride, int D, const uint8_t* first, int64_t stride, int64_t n,
                const Dec& dec, float* acc) {
  const int chunks = D / kLanes;
  int j = 0;
  for (; j + kValueChunks <= chunks; j += kValueChunks)
    code_axpys_chunks<M, kValueChunks>(w, w_stride, D, first, stride, n, dec, acc, j);
  for (; j < chunks; ++j) code_axpys_chunks<M, 1>(w, w_stride, D, first, stride, n, dec, acc, j);
}

// --- softmax and scales ------------------------------------------------------------------------------------------

// exp(x) lane by lane: common.h's exp_row (Cephes expf, 0 below -87.3 and for -inf) with the same operations, so
// the same results.
inline __m256 exp8(__m256 x) {
  const __m256 low = _mm256_set1_ps(-87.33654f);
  __m256 v = _mm256_min_ps(_mm256_max_ps(x, low), _mm256_set1_ps(88.3762626647949f));
  const __m256 t = _mm256_mul_ps(v, _mm256_set1_ps(1.44269504088896341f));
  const __m256 round = _mm256_set1_ps(12582912.0f);
  const __m256 fx = _mm256_sub_ps(_mm256_add_ps(t, round), round);
  __m256 r = _mm256_fmadd_ps(fx, _mm256_set1_ps(-0.693359375f), v);
  r = _mm256_fmadd_ps(fx, _mm256_set1_ps(2.12194440e-4f), r);
  const __m256 z = _mm256_mul_ps(r, r);
  __m256 p = _mm256_set1_ps(1.9875691500E-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
  p = _mm256_fmadd_ps(p, z, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  const __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
  return _mm256_andnot_ps(_mm256_cmp_ps(x, low, _CMP_LT_OQ), y);
}

inline float hmax(__m256 v) {
  __m128 a = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_max_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_max_ss(a, _mm_movehdup_ps(a)));
}

inline float hadd(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(a, _mm_movehdup_ps(a)));
}

// max(init, s[0..n))
inline float row_max(const float* s, int64_t n, float init) {
  __m256 m = _mm256_set1_ps(init);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) m = _mm256_max_ps(m, _mm256_loadu_ps(s + i));
  float out = hmax(m);
  for (; i < n; ++i) out = std::max(out, s[i]);
  return out;
}

// s[i] = exp(s[i] - shift) for i < n; returns their sum.
inline float exp_sum(float* s, int64_t n, float shift) {
  const __m256 sh = _mm256_set1_ps(shift);
  __m256 total = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), sh));
    _mm256_storeu_ps(s + i, e);
    total = _mm256_add_ps(total, e);
  }
  if (i < n) {
    alignas(32) float rest[kLanes];
    for (int k = 0; k < kLanes; ++k) rest[k] = i + k < n ? s[i + k] : kNegInf;
    const __m256 e = exp8(_mm256_sub_ps(_mm256_load_ps(rest), sh));
    _mm256_store_ps(rest, e);
    for (int k = 0; i + k < n; ++k) s[i + k] = rest[k];
    total = _mm256_add_ps(total, e);
  }
  return hadd(total);
}

// out[i] = half[i] as fp32, i < n (contiguous halves).
inline void halves(const at::Half* half, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(half + i))));
  for (; i < n; ++i) out[i] = static_cast<float>(half[i]);
}

}  // namespace avx2
#endif  // FC_TOKEN_AVX2

#if defined(FC_TOKEN_AVX2) && defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__AVX512BW__)
#define FC_TOKEN_AVX512 1

// The same loops 16 channels at a time (AVX-512, head_dim % 16 == 0; other head dims keep the AVX2 loops): a 4-bit
// table (16 levels) and a 3-bit trellis alphabet fit one register, so one `vpermps` reads a level where AVX2 needs
// two and a blend; a 4-bit trellis alphabet (32 values) is one two-register permute; 1-bit codes are a mask choosing
// between two broadcast levels. A token's dot products are folded to 8 lanes and reduced as in AVX2 (hsum8); the
// value loop keeps up to kValueChunks x M accumulators (64 channels x 4 rows), so a row of 64 codes is expanded once.
namespace avx512 {

constexpr int kLanes = 16;       // fp32 lanes of a register: one chunk of 16 channels
constexpr int kValueChunks = 4;  // channel chunks per pass of the value loop: M x 4 accumulators (M <= 4)

// The codes of channels 16j .. 16j + 15 of one W-bit slice as dwords.
template <int W>
inline __m512i slice_codes(const uint8_t* slice, int j);

template <>
inline __m512i slice_codes<8>(const uint8_t* slice, int j) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(slice + 16 * j)));
}

template <>
inline __m512i slice_codes<4>(const uint8_t* slice, int j) {
  uint64_t word;
  std::memcpy(&word, slice + 8 * j, sizeof(word));
  const __m512i halves = _mm512_permutexvar_epi32(  // lanes 0..7: the low dword, 8..15: the high one
      _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
      _mm512_castsi128_si512(_mm_cvtsi64_si128(static_cast<int64_t>(word))));
  const __m512i shifts = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
  return _mm512_and_si512(_mm512_srlv_epi32(halves, shifts), _mm512_set1_epi32(15));
}

template <>
inline __m512i slice_codes<2>(const uint8_t* slice, int j) {
  uint32_t word;
  std::memcpy(&word, slice + 4 * j, sizeof(word));
  const __m512i shifts = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  return _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(word)), shifts), _mm512_set1_epi32(3));
}

// The 16 bits of channels 16j .. 16j + 15 of a 1-bit slice (bit i: channel 16j + i).
inline __mmask16 slice_bits(const uint8_t* slice, int j) {
  uint16_t word;
  std::memcpy(&word, slice + 2 * j, sizeof(word));
  return static_cast<__mmask16>(word);
}

template <>
inline __m512i slice_codes<1>(const uint8_t* slice, int j) {
  return _mm512_maskz_mov_epi32(slice_bits(slice, j), _mm512_set1_epi32(1));
}

// Unscaled levels of BITS-bit codes (as avx2::Codes) for 16 channels.
template <int BITS>
struct Codes {
  __m512 table;         // the level table (zero past it)
  __m512 offset;        // 8-bit: level = code + offset
  __m512 one;           // 1-bit: level of a set bit (table holds the other)
  int64_t high_slice;   // 3-bit: byte offset of the 1-bit slice (D / 4)

  Codes(const float* levels, float level_offset, int D) {
    alignas(64) float t[16] = {};
    if (BITS < 8)
      for (int e = 0; e < (1 << BITS); ++e) t[e] = levels[e];
    table = BITS == 1 ? _mm512_set1_ps(t[0]) : _mm512_load_ps(t);
    one = _mm512_set1_ps(t[1]);
    offset = _mm512_set1_ps(level_offset);
    high_slice = D / 4;
  }

  FC_DECODE __m512 operator()(const uint8_t* row, int j) const {
    if constexpr (BITS == 8) {
      return _mm512_add_ps(_mm512_cvtepi32_ps(slice_codes<8>(row, j)), offset);
    } else if constexpr (BITS == 3) {
      const __m512i hi = _mm512_maskz_mov_epi32(slice_bits(row + high_slice, j), _mm512_set1_epi32(4));
      return _mm512_permutexvar_ps(_mm512_or_si512(slice_codes<2>(row, j), hi), table);
    } else if constexpr (BITS == 1) {
      return _mm512_mask_blend_ps(slice_bits(row, j), table, one);
    } else {
      static_assert(BITS == 2 || BITS == 4, "SIMD code widths: 1, 2, 3, 4, 8");
      return _mm512_permutexvar_ps(slice_codes<BITS>(row, j), table);
    }
  }
};

// Unscaled values of BITS-bit trellis codes (as avx2::TcqCodes) for 16 channels. Lane i (channel t = 16j + i) shifts
// a window of the row's low bits right so that four of its bits are l[t-3] .. l[t]. BITS <= 3: those four bits and
// the code's bits above its low bit index the alphabet reordered by that index (`kLaneIndex`): bit 0 the code's bit 1
// (BITS >= 2), then l[t-3] .. l[t], and (BITS == 3) the code's bit 2 choosing between two 32-value tables: one
// permute per chunk (BITS == 3: two and a blend), no subset computed. BITS == 4 (a 7-bit index) reads the 32-value
// alphabet at ((c >> 1) << 2) | subset, the 16 subsets computed from the window in scalar (two bits per channel,
// interleaved by pdep) and shifted into the lanes.
template <int BITS>
struct TcqCodes {
  static constexpr bool kLaneIndex = BITS <= 3;
  static constexpr int kCodeBit = BITS >= 2 && kLaneIndex ? 1 : 0;  // lane index bits below the window's
  __m512 t[4];          // the alphabet, 16 values a register (kLaneIndex: by lane index; else entries 0..31)
  __m512i shifts;       // lane i: the window shift that puts l[t-3] at bit kCodeBit
  __m512i pair_shifts;  // lane i: 2i + 1 (BITS == 4: 2i), the shift that puts bit 1 of its code in a 2-bit slice
                        // (BITS == 4: its subset in the interleaved word) at bit 0
  int64_t high_slice;

  TcqCodes(const float* alphabet, float, int D) {
    alignas(64) float a[64] = {};
    if constexpr (kLaneIndex) {
      for (int x = 0; x < (16 << kCodeBit) << (BITS == 3); ++x) {
        const int w = (x >> kCodeBit) & 15;  // l[t-3], l[t-2], l[t-1], l[t] at bits 0..3
        const int high = (x & kCodeBit) | (BITS == 3 ? (x >> 5) << 1 : 0);  // the code's bits above its low bit
        a[x] = alphabet[tcq_index((high << 1) | (w >> 3), (w >> 2) & 1, (w >> 1) & 1, w & 1)];
      }
    } else {
      for (int e = 0; e < (2 << BITS); ++e) a[e] = alphabet[e];
    }
    for (int i = 0; i < 4; ++i) t[i] = _mm512_load_ps(a + 16 * i);
    alignas(64) int32_t sh[16], pairs[16];
    for (int i = 0; i < 16; ++i) {
      sh[i] = i + 5 - kCodeBit;  // bit 8 + i of the window is l[16j + i]
      pairs[i] = 2 * i + (BITS == 4 ? 0 : 1);
    }
    shifts = _mm512_load_si512(sh);
    pair_shifts = _mm512_load_si512(pairs);
    high_slice = D / 4;
  }

  // Bit k: the low bit of the code of channel 16j - 8 + k (0 before the row), k < 24.
  FC_DECODE static uint32_t window(const uint8_t* row, int j) {
    if constexpr (BITS == 1) {  // the 1-bit slice: one byte per 8 channels
      uint16_t pair;
      std::memcpy(&pair, row + (j > 0 ? 2 * j - 1 : 0), sizeof(pair));
      return j > 0 ? pair | (static_cast<uint32_t>(row[2 * j + 1]) << 16) : static_cast<uint32_t>(pair) << 8;
    } else {
#ifdef __BMI2__
      // 4-bit slice: 4 bytes per 8 channels, the low bit at bit 0 of each nibble; 2-bit slice (2 and 3 bits): 2
      // bytes per 8 channels, the low bit at the even bits. Constant-size copies: single loads.
      constexpr int per = BITS == 4 ? 4 : 2;
      constexpr uint64_t mask = BITS == 4 ? 0x1111111111111111ULL : 0x55555555ULL;
      constexpr uint64_t mask8 = BITS == 4 ? 0x11111111ULL : 0x5555ULL;
      uint64_t two = 0, one = 0;
      if (j == 0) {
        std::memcpy(&two, row, 2 * per);
        return static_cast<uint32_t>(_pext_u64(two, mask)) << 8;
      }
      std::memcpy(&two, row + per * (2 * j - 1), 2 * per);
      std::memcpy(&one, row + per * (2 * j + 1), per);
      return static_cast<uint32_t>(_pext_u64(two, mask) | (_pext_u64(one, mask8) << 16));
#else
      using Half = avx2::TcqCodes<BITS>;
      return static_cast<uint32_t>(Half::window(row, 2 * j)) |
             (static_cast<uint32_t>(Half::low_bits(row, 2 * j + 1)) << 16);
#endif
    }
  }

  FC_DECODE __m512 operator()(const uint8_t* row, int j) const {
    constexpr int kSelect = 0xCA;  // vpternlog: a ? b : c, bitwise
    const uint32_t w = window(row, j);
    if constexpr (BITS == 4) {
#ifdef __BMI2__
      // lane i's subset: bit 0 l[t-2] = w[i + 6], bit 1 l[t] ^ l[t-1] ^ l[t-3] = w[i + 8] ^ w[i + 7] ^ w[i + 5]
      const uint32_t x = w ^ (w >> 2) ^ (w >> 3);  // bit i + 5: w[i + 5] ^ w[i + 7] ^ w[i + 8]
      const uint32_t pairs = _pdep_u32(w >> 6, 0x55555555u) | _pdep_u32(x >> 5, 0xAAAAAAAAu);
#else
      uint32_t pairs = 0;
      for (int i = 0; i < 16; ++i)
        pairs |= (((w >> (i + 6)) & 1) | ((((w >> (i + 5)) ^ (w >> (i + 7)) ^ (w >> (i + 8))) & 1) << 1)) << (2 * i);
#endif
      const __m512i sub = _mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(pairs)), pair_shifts);
      const __m512i index = _mm512_ternarylogic_epi32(_mm512_set1_epi32(3), sub,
                                                      _mm512_slli_epi32(slice_codes<4>(row, j), 1), kSelect);
      return _mm512_permutex2var_ps(t[0], index, t[1]);  // the permute reads bits 0..4: (c >> 1) << 2 | subset
    }
    const __m512i win = _mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(w)), shifts);
    if constexpr (BITS == 1) {
      return _mm512_permutexvar_ps(win, t[0]);  // the permute reads bits 0..3
    } else {
      uint32_t word;  // the 2-bit slice: the codes' bits 0 and 1
      std::memcpy(&word, row + 4 * j, sizeof(word));
      const __m512i bit1 = _mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(word)), pair_shifts);
      const __m512i index = _mm512_ternarylogic_epi32(_mm512_set1_epi32(0x1E), win, bit1, kSelect);
      const __m512 low = _mm512_permutex2var_ps(t[0], index, t[1]);  // the permutes read bits 0..4
      if constexpr (BITS == 2) return low;
      return _mm512_mask_blend_ps(slice_bits(row + high_slice, j), low, _mm512_permutex2var_ps(t[2], index, t[3]));
    }
  }
};

// 16 lanes folded to 8 (lane i + lane i + 8): a token's dot product then reduced as avx2's.
inline __m256 fold(__m512 v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
}

// Dot products of U tokens' levels with the M query rows, folded to 8 lanes into acc[u][m].
template <int M, int U, class Dec>
inline void token_dots(const float* q, int D, const uint8_t* row, int64_t stride, const Dec& dec, __m256 (&acc)[U][M]) {
  __m512 a[U][M];
  for (int u = 0; u < U; ++u)
    for (int m = 0; m < M; ++m) a[u][m] = _mm512_setzero_ps();
  const int chunks = D / kLanes;
#pragma GCC unroll 8
  for (int j = 0; j < chunks; ++j) {
    __m512 lev[U];
    for (int u = 0; u < U; ++u) lev[u] = dec(row + u * stride, j);
    for (int m = 0; m < M; ++m) {
      const __m512 qv = _mm512_loadu_ps(q + m * D + kLanes * j);
      for (int u = 0; u < U; ++u) a[u][m] = _mm512_fmadd_ps(qv, lev[u], a[u][m]);
    }
  }
  for (int u = 0; u < U; ++u)
    for (int m = 0; m < M; ++m) acc[u][m] = fold(a[u][m]);
}

// out[m * out_stride + i] = q[m] . levels(row i) for i < n (as avx2::code_dots).
template <int M, class Dec>
void code_dots(const float* q, int D, const uint8_t* first, int64_t stride, int64_t n, const Dec& dec, float* out,
               int64_t out_stride) {
  avx2::reduce_dots<M>(first, stride, n, [&](auto u, const uint8_t* row, auto& acc) {
    token_dots<M, decltype(u)::value>(q, D, row, stride, dec, acc);
  }, out, out_stride);
}

// acc[m * D + d] += sum_i w[m * w_stride + i] * levels(row i)[d] over channels of chunks j0 .. j0 + C - 1.
template <int M, int C, class Dec>
inline void code_axpys_chunks(const float* w, int64_t w_stride, int D, const uint8_t* first, int64_t stride, int64_t n,
                              const Dec& dec, float* acc, int j0) {
  __m512 a[C][M];
  for (int c = 0; c < C; ++c)
    for (int m = 0; m < M; ++m) a[c][m] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* row = first + i * stride;
    if (j0 == 0) prefetch_row(row);
    __m512 wm[M];
    for (int m = 0; m < M; ++m) wm[m] = _mm512_set1_ps(w[m * w_stride + i]);
    for (int c = 0; c < C; ++c) {
      const __m512 lev = dec(row, j0 + c);
      for (int m = 0; m < M; ++m) a[c][m] = _mm512_fmadd_ps(wm[m], lev, a[c][m]);
    }
  }
  for (int c = 0; c < C; ++c)
    for (int m = 0; m < M; ++m) {
      float* dst = acc + m * D + kLanes * (j0 + c);
      _mm512_storeu_ps(dst, _mm512_add_ps(_mm512_loadu_ps(dst), a[c][m]));
    }
}

template <int M, class Dec>
void code_axpys(const float* w, int64_t w_stride, int D, const uint8_t* first, int64_t stride, int64_t n,
                const Dec& dec, float* acc) {
  const int chunks = D / kLanes;
  int j = 0;
  for (; j + kValueChunks <= chunks; j += kValueChunks)
    code_axpys_chunks<M, kValueChunks>(w, w_stride, D, first, stride, n, dec, acc, j);
  switch (chunks - j) {
    case 3: code_axpys_chunks<M, 3>(w, w_stride, D, first, stride, n, dec, acc, j); break;
    case 2: code_axpys_chunks<M, 2>(w, w_stride, D, first, stride, n, dec, acc, j); break;
    case 1: code_axpys_chunks<M, 1>(w, w_stride, D, first, stride, n, dec, acc, j); break;
    default: break;
  }
}

}  // namespace avx512
#endif  // FC_TOKEN_AVX512

// How a per-token archive's rows are read: stream-dtype rows, the portable path, or a SIMD code width.
enum class RowCodes { kRaw, kPortable, kBits1, kBits2, kBits3, kBits4, kBits8, kTcq1, kTcq2, kTcq3, kTcq4 };

inline RowCodes row_codes(const Codec& c, bool simd) {
  if (c.quant == kNone) return RowCodes::kRaw;
#ifdef FC_TOKEN_AVX2
  if (simd && c.tcq[0]) {
    switch (c.bits[0]) {
      case 1: return RowCodes::kTcq1;
      case 2: return RowCodes::kTcq2;
      case 3: return RowCodes::kTcq3;
      case 4: return RowCodes::kTcq4;
      default: return RowCodes::kPortable;
    }
  }
  if (simd) {
    switch (c.bits[0]) {
      case 1: return RowCodes::kBits1;
      case 2: return RowCodes::kBits2;
      case 3: return RowCodes::kBits3;
      case 4: return RowCodes::kBits4;
      case 8: return c.affine[0] ? RowCodes::kBits8 : RowCodes::kPortable;
      default: return RowCodes::kPortable;
    }
  }
#else
  (void)simd;
#endif
  return RowCodes::kPortable;
}

#ifdef FC_TOKEN_AVX2
// fn(std::integral_constant<int, M>) for a tile of M rows.
template <typename Fn>
inline void with_rows(int M, Fn&& fn) {
  switch (M) {
    case 1: fn(std::integral_constant<int, 1>()); break;
    case 2: fn(std::integral_constant<int, 2>()); break;
    case 3: fn(std::integral_constant<int, 3>()); break;
    default: fn(std::integral_constant<int, 4>()); break;
  }
}

// fn(decoder) with the decoder of `kind` (a code width) for codec c from namespace ISA (avx2 or avx512).
#define FC_WITH_DECODER(ISA)                                                    \
  template <typename Fn>                                                        \
  inline void with_decoder(RowCodes kind, const Codec& c, Fn&& fn) {            \
    const float* table = c.levels;                                              \
    const float off = c.level_off[0];                                           \
    const int D = c.head_dim;                                                   \
    switch (kind) {                                                             \
      case RowCodes::kBits1: fn(ISA::Codes<1>(table, off, D)); break;           \
      case RowCodes::kBits2: fn(ISA::Codes<2>(table, off, D)); break;           \
      case RowCodes::kBits3: fn(ISA::Codes<3>(table, off, D)); break;           \
      case RowCodes::kBits4: fn(ISA::Codes<4>(table, off, D)); break;           \
      case RowCodes::kTcq1: fn(ISA::TcqCodes<1>(table, off, D)); break;         \
      case RowCodes::kTcq2: fn(ISA::TcqCodes<2>(table, off, D)); break;         \
      case RowCodes::kTcq3: fn(ISA::TcqCodes<3>(table, off, D)); break;         \
      case RowCodes::kTcq4: fn(ISA::TcqCodes<4>(table, off, D)); break;         \
      default: fn(ISA::Codes<8>(table, off, D)); break;                         \
    }                                                                           \
  }
namespace avx2 { FC_WITH_DECODER(avx2) }
#ifdef FC_TOKEN_AVX512
namespace avx512 { FC_WITH_DECODER(avx512) }
#endif
#undef FC_WITH_DECODER

// out[m * os + i] = q[m] . levels(code row i) for m < M query rows (q: M x D, M <= 4) and i < n code rows `stride`
// bytes apart (first: row 0's codes) of a SIMD code kind (row_codes): the AVX-512 loops where compiled and D % 16 == 0,
// else the AVX2 ones.
inline void code_scores(RowCodes kind, const Codec& c, int M, const float* q, int D, const uint8_t* first,
                        int64_t stride, int64_t n, float* out, int64_t os) {
  with_rows(M, [&](auto rows) {
    constexpr int R = decltype(rows)::value;
#ifdef FC_TOKEN_AVX512
    if (D % avx512::kLanes == 0) {
      avx512::with_decoder(kind, c, [&](const auto& dec) { avx512::code_dots<R>(q, D, first, stride, n, dec, out, os); });
      return;
    }
#endif
    avx2::with_decoder(kind, c, [&](const auto& dec) { avx2::code_dots<R>(q, D, first, stride, n, dec, out, os); });
  });
}

// acc[m * D + d] += sum_i w[m * ws + i] * levels(code row i)[d] for m < M rows (as code_scores).
inline void code_values(RowCodes kind, const Codec& c, int M, const float* w, int64_t ws, int D, const uint8_t* first,
                        int64_t stride, int64_t n, float* acc) {
  with_rows(M, [&](auto rows) {
    constexpr int R = decltype(rows)::value;
#ifdef FC_TOKEN_AVX512
    if (D % avx512::kLanes == 0) {
      avx512::with_decoder(kind, c, [&](const auto& dec) { avx512::code_axpys<R>(w, ws, D, first, stride, n, dec, acc); });
      return;
    }
#endif
    avx2::with_decoder(kind, c, [&](const auto& dec) { avx2::code_axpys<R>(w, ws, D, first, stride, n, dec, acc); });
  });
}
#else
// Without the SIMD loops row_codes never names a SIMD code kind, so nothing calls these.
inline void code_scores(RowCodes, const Codec&, int, const float*, int, const uint8_t*, int64_t, int64_t, float*,
                        int64_t) {
  TORCH_CHECK(false, "code_scores: built without the SIMD code loops");
}
inline void code_values(RowCodes, const Codec&, int, const float*, int64_t, int, const uint8_t*, int64_t, int64_t,
                        float*) {
  TORCH_CHECK(false, "code_values: built without the SIMD code loops");
}
#endif

}  // namespace fc
