// Trellis-coded quantization (levels="tcq", codecs/trellis.py) in C++: the windowed decode (a value from its code and
// the low bits of the three codes before it in its row) and the Viterbi encoder, bitwise the reference's (every sum
// sequential along the row, one rounding per operation: the build's -ffp-contract=off keeps a * b + c unfused; the
// same tie rules). Concatenated after common.h; the encoder uses quantize.h's fp16_toward (declared here).

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace fc {

constexpr int kTcqStates = 8;
constexpr int kTcqMaxBits = 4;
constexpr int kTcqSlots = 8;  // trellis.FACTOR_SLOTS: candidate scales per class in the plan's factor table

inline float fp16_toward(float x, bool up);

// Alphabet index of code c[t] given the low bits l1 = c[t-1] & 1, l2 = c[t-2] & 1, l3 = c[t-3] & 1.
inline int tcq_index(int code, int l1, int l2, int l3) {
  return ((code >> 1) << 2) | l2 | (((code ^ l1 ^ l3) & 1) << 1);
}

// One row of D trellis codes -> their alphabet indices, in place (common.h's row_levels then reads the alphabet).
inline void tcq_indices(int32_t* codes, int D) {
  int l1 = 0, l2 = 0, l3 = 0;
  for (int t = 0; t < D; ++t) {
    const int code = codes[t];
    codes[t] = tcq_index(code, l1, l2, l3);
    l3 = l2;
    l2 = l1;
    l1 = code & 1;
  }
}

// Per-thread scratch of the encoder (tcq_encode_row's `work`).
inline uint8_t* tcq_work(size_t bytes) {
  thread_local std::vector<uint8_t> buffer;
  if (buffer.size() < bytes) buffer.resize(bytes);
  return buffer.data();
}

// The subset (0..3) branch `branch` leaves state `s` on.
inline int tcq_subset(int s, int branch) { return ((s >> 1) & 1) | (((branch ^ s ^ (s >> 2)) & 1) << 1); }

#if defined(__AVX2__)
// The forward pass of tcq_viterbi with the 8 states in the 8 lanes of a register, the alphabet (at most 8 * R values:
// R = 2 up to 3 bits, 4 at 4 bits) in R registers: the same operations in the same order per state (x - v, its
// square, strict < for the nearest level of each subset in increasing level order, cost + error, the odd predecessor
// where strictly cheaper), so the same costs and back pointers. cost: the 8 end costs.
template <int R>
inline void tcq_forward_avx2(const float* x, int D, int per, const float* values, float* cost, uint8_t* back) {
  alignas(32) float v[8 * R];
  for (int a = 0; a < 8 * R; ++a) v[a] = a < 4 * per ? values[a] : 0.0f;
  __m256 vr[R];
  for (int r = 0; r < R; ++r) vr[r] = _mm256_load_ps(v + 8 * r);
  // per new state n: its predecessors 2(n&3), 2(n&3)+1 and the subsets their branch n >> 2 leaves them on
  alignas(32) int32_t pe[8], po[8], se[8], so[8];
  for (int n = 0; n < kTcqStates; ++n) {
    pe[n] = 2 * (n & 3);
    po[n] = pe[n] + 1;
    se[n] = tcq_subset(pe[n], n >> 2);
    so[n] = tcq_subset(po[n], n >> 2);
  }
  const __m256i ipe = _mm256_load_si256(reinterpret_cast<const __m256i*>(pe));
  const __m256i ipo = _mm256_load_si256(reinterpret_cast<const __m256i*>(po));
  const __m256i ise = _mm256_load_si256(reinterpret_cast<const __m256i*>(se));
  const __m256i iso = _mm256_load_si256(reinterpret_cast<const __m256i*>(so));
  __m256 c = _mm256_loadu_ps(cost);
  alignas(32) int32_t lane[8];
  for (int t = 0; t < D; ++t) {
    const __m256 xt = _mm256_set1_ps(x[t]);
    // level i of subset j is alphabet[j + 4i]: lanes j of the 4-lane quarter i
    __m128 quarter[2 * R];
    for (int r = 0; r < R; ++r) {
      const __m256 d = _mm256_sub_ps(xt, vr[r]);
      const __m256 e = _mm256_mul_ps(d, d);
      quarter[2 * r] = _mm256_castps256_ps128(e);
      quarter[2 * r + 1] = _mm256_extractf128_ps(e, 1);
    }
    __m128 best = quarter[0];
    __m128i idx = _mm_setzero_si128();
    for (int i = 1; i < per; ++i) {
      const __m128 closer = _mm_cmplt_ps(quarter[i], best);
      best = _mm_blendv_ps(best, quarter[i], closer);
      idx = _mm_blendv_epi8(idx, _mm_set1_epi32(i), _mm_castps_si128(closer));
    }
    const __m256 best8 = _mm256_set_m128(best, best);
    const __m256i idx8 = _mm256_set_m128i(idx, idx);
    const __m256 ce = _mm256_add_ps(_mm256_permutevar8x32_ps(c, ipe), _mm256_permutevar8x32_ps(best8, ise));
    const __m256 co = _mm256_add_ps(_mm256_permutevar8x32_ps(c, ipo), _mm256_permutevar8x32_ps(best8, iso));
    const __m256 odd = _mm256_cmp_ps(co, ce, _CMP_LT_OQ);
    c = _mm256_blendv_ps(ce, co, odd);
    const __m256i level = _mm256_castps_si256(_mm256_blendv_ps(
        _mm256_castsi256_ps(_mm256_permutevar8x32_epi32(idx8, ise)),
        _mm256_castsi256_ps(_mm256_permutevar8x32_epi32(idx8, iso)), odd));
    const __m256i code = _mm256_or_si256(level, _mm256_and_si256(_mm256_castps_si256(odd), _mm256_set1_epi32(0x80)));
    _mm256_store_si256(reinterpret_cast<__m256i*>(lane), code);
    for (int n = 0; n < kTcqStates; ++n) back[t * kTcqStates + n] = static_cast<uint8_t>(lane[n]);
  }
  _mm256_storeu_ps(cost, c);
}
#endif

// Least squared error path of x (D values) from state 0 at scale `scale`: codes and its cost (trellis.viterbi).
// back: D * kTcqStates bytes (bit 7: the odd predecessor; low bits: the level in the subset).
inline float tcq_viterbi(const float* x, int D, int bits, const float* alphabet, float scale, int32_t* codes,
                         uint8_t* back) {
  const int per = 1 << (bits - 1), n_alpha = 2 << bits;
  float values[2 << kTcqMaxBits];
  for (int a = 0; a < n_alpha; ++a) values[a] = alphabet[a] * scale;
  const float inf = std::numeric_limits<float>::infinity();
  float cost[kTcqStates], next[kTcqStates];
  for (int s = 0; s < kTcqStates; ++s) cost[s] = s == 0 ? 0.0f : inf;
#if defined(__AVX2__)
  if (bits <= 3) tcq_forward_avx2<2>(x, D, per, values, cost, back);
  else tcq_forward_avx2<4>(x, D, per, values, cost, back);
  const int t0 = D;  // the first step of the portable forward pass (D: done by the SIMD one)
#else
  const int t0 = 0;
#endif
  for (int t = t0; t < D; ++t) {
    float best[4];
    int idx[4];
    for (int j = 0; j < 4; ++j) {
      const float d0 = x[t] - values[j];
      best[j] = d0 * d0;
      idx[j] = 0;
      for (int i = 1; i < per; ++i) {
        const float d = x[t] - values[j + 4 * i];
        const float e = d * d;
        if (e < best[j]) { best[j] = e; idx[j] = i; }
      }
    }
    for (int n = 0; n < kTcqStates; ++n) {
      const int pe = 2 * (n & 3), br = n >> 2;
      const int se = tcq_subset(pe, br), so = tcq_subset(pe + 1, br);
      const float ce = cost[pe] + best[se], co = cost[pe + 1] + best[so];
      const bool odd = co < ce;
      next[n] = odd ? co : ce;
      back[t * kTcqStates + n] = static_cast<uint8_t>((odd ? 0x80 : 0) | (odd ? idx[so] : idx[se]));
    }
    for (int s = 0; s < kTcqStates; ++s) cost[s] = next[s];
  }
  int state = 0;
  float final_cost = cost[0];
  for (int s = 1; s < kTcqStates; ++s)
    if (cost[s] < final_cost) { final_cost = cost[s]; state = s; }
  for (int t = D - 1; t >= 0; --t) {
    const uint8_t b = back[t * kTcqStates + state];
    codes[t] = ((b & 0x7F) << 1) | (state >> 2);
    state = 2 * (state & 3) + (b >> 7);
  }
  return final_cost;
}

// One row of D values -> trellis codes and the fp16 scale (trellis.encode): candidates fp16_up(rms * f) for the
// factors f of `factors` (kTcqSlots, zeros after the last: trellis.scale_factors), the cheapest path kept (ties: the
// first), then (search) the least-squares scale of its codes where it errs less.
// work: at least D * (kTcqStates + 4) bytes.
inline float tcq_encode_row(const float* x, int D, int bits, const float* alphabet, const float* factors, bool search,
                            int32_t* codes, uint8_t* work) {
  float ss = 0.0f;
  for (int t = 0; t < D; ++t) ss = ss + x[t] * x[t];
  const float rms = std::sqrt(ss / static_cast<float>(D));
  uint8_t* back = work;
  int32_t* cand = reinterpret_cast<int32_t*>(work + static_cast<size_t>(D) * kTcqStates);
  float best_cost = 0.0f, best_scale = 0.0f;
  for (int f = 0; f < kTcqSlots && factors[f] > 0.0f; ++f) {
    const float scale = fp16_toward(rms * factors[f], true);
    const float cost = tcq_viterbi(x, D, bits, alphabet, scale, f == 0 ? codes : cand, back);
    if (f == 0) {
      best_cost = cost;
      best_scale = scale;
    } else if (cost < best_cost) {
      best_cost = cost;
      best_scale = scale;
      std::memcpy(codes, cand, sizeof(int32_t) * D);
    }
  }
  if (!search) return best_scale;
  float num = 0.0f, den = 0.0f;
  int l1 = 0, l2 = 0, l3 = 0;
  float* lv = reinterpret_cast<float*>(cand);
  for (int t = 0; t < D; ++t) {
    lv[t] = alphabet[tcq_index(codes[t], l1, l2, l3)];
    l3 = l2;
    l2 = l1;
    l1 = codes[t] & 1;
  }
  for (int t = 0; t < D; ++t) num = num + lv[t] * x[t];
  for (int t = 0; t < D; ++t) den = den + lv[t] * lv[t];
  if (!(den > 0.0f && num > 0.0f)) return best_scale;
  const float ls = static_cast<float>(at::Half(std::min(num / den, kFp16Max)));
  float err = 0.0f;
  for (int t = 0; t < D; ++t) {
    const float d = lv[t] * ls - x[t];
    err = err + d * d;
  }
  return err < best_cost ? ls : best_scale;
}

}  // namespace fc
