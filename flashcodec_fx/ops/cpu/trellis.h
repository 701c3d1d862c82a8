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

// The portable forward pass of one scale (the reference's operations in its order): the nearest level of each
// subset (strict <, increasing level order), per new state the cheaper predecessor (the odd one where strictly
// cheaper). values: the scaled alphabet; cost: the 8 start costs in, the 8 end costs out.
inline void tcq_forward_scalar(const float* x, int D, int per, const float* values, float* cost, uint8_t* back) {
  float next[kTcqStates];
  for (int t = 0; t < D; ++t) {
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
}

#if defined(__AVX2__)
// tcq_forward_scalar for NC scales at once, each with the 8 states in the 8 lanes of a register and its scaled
// alphabet (at most 8 * R values: R = 2 up to 3 bits, 4 at 4 bits) in R registers: the same operations in the same
// order per state, so the same costs and back pointers. The NC passes are independent chains of one loop (the core
// overlaps them: a step's cost update is a chain of dependent permutes, adds and compares).
template <int R, int NC>
inline void tcq_forward_avx2(const float* x, int D, int per, const float (*values)[2 << kTcqMaxBits],
                             float (*cost)[kTcqStates], uint8_t* const* back) {
  __m256 vr[NC][R];
  for (int k = 0; k < NC; ++k) {
    alignas(32) float v[8 * R];
    for (int a = 0; a < 8 * R; ++a) v[a] = a < 4 * per ? values[k][a] : 0.0f;
    for (int r = 0; r < R; ++r) vr[k][r] = _mm256_load_ps(v + 8 * r);
  }
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
  __m256 c[NC];
  for (int k = 0; k < NC; ++k) c[k] = _mm256_loadu_ps(cost[k]);
  for (int t = 0; t < D; ++t) {
    const __m256 xt = _mm256_set1_ps(x[t]);
    for (int k = 0; k < NC; ++k) {
      // level i of subset j is alphabet[j + 4i]: lanes j of the 4-lane quarter i
      __m128 quarter[2 * R];
      for (int r = 0; r < R; ++r) {
        const __m256 d = _mm256_sub_ps(xt, vr[k][r]);
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
      const __m256 ce = _mm256_add_ps(_mm256_permutevar8x32_ps(c[k], ipe), _mm256_permutevar8x32_ps(best8, ise));
      const __m256 co = _mm256_add_ps(_mm256_permutevar8x32_ps(c[k], ipo), _mm256_permutevar8x32_ps(best8, iso));
      const __m256 odd = _mm256_cmp_ps(co, ce, _CMP_LT_OQ);
      c[k] = _mm256_blendv_ps(ce, co, odd);
      const __m256i level = _mm256_castps_si256(_mm256_blendv_ps(
          _mm256_castsi256_ps(_mm256_permutevar8x32_epi32(idx8, ise)),
          _mm256_castsi256_ps(_mm256_permutevar8x32_epi32(idx8, iso)), odd));
      const __m256i code =
          _mm256_or_si256(level, _mm256_and_si256(_mm256_castps_si256(odd), _mm256_set1_epi32(0x80)));
      // the 8 lanes (0..0x87) narrowed to bytes in lane order: unsigned saturation leaves them as they are
      const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(back[k] + t * kTcqStates), _mm_packus_epi16(words, words));
    }
  }
  for (int k = 0; k < NC; ++k) _mm256_storeu_ps(cost[k], c[k]);
}
#endif

// The forward passes of x (D values) from state 0 at NC scales (trellis.viterbi): per scale its back pointers
// (D * kTcqStates bytes; bit 7: the odd predecessor, low bits: the level in the subset) and 8 end costs.
template <int NC>
inline void tcq_forward(const float* x, int D, int bits, const float* alphabet, const float* scale,
                        float (*cost)[kTcqStates], uint8_t* const* back) {
  const int per = 1 << (bits - 1), n_alpha = 2 << bits;
  float values[NC][2 << kTcqMaxBits];
  for (int k = 0; k < NC; ++k) {
    for (int a = 0; a < n_alpha; ++a) values[k][a] = alphabet[a] * scale[k];
    for (int s = 0; s < kTcqStates; ++s) cost[k][s] = s == 0 ? 0.0f : std::numeric_limits<float>::infinity();
  }
#if defined(__AVX2__)
  if (bits <= 3) tcq_forward_avx2<2, NC>(x, D, per, values, cost, back);
  else tcq_forward_avx2<4, NC>(x, D, per, values, cost, back);
#else
  for (int k = 0; k < NC; ++k) tcq_forward_scalar(x, D, per, values[k], cost[k], back[k]);
#endif
}

// The least squared error path of a forward pass (its 8 end costs, back pointers): its codes and its cost (the
// cheapest end state, ties: the lowest).
inline float tcq_traceback(const float* cost, int D, const uint8_t* back, int32_t* codes) {
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
// factors f of `factors` (kTcqSlots, zeros after the last: trellis.scale_factors), two forward passes at a time,
// the cheapest path kept (ties: the first), then (search) the least-squares scale of its codes where it errs less.
// work: at least kTcqWorkPerValue * D bytes.
constexpr int kTcqWorkPerValue = 2 * kTcqStates + 2 * sizeof(int32_t);
inline float tcq_encode_row(const float* x, int D, int bits, const float* alphabet, const float* factors, bool search,
                            int32_t* codes, uint8_t* work) {
  float ss = 0.0f;
  for (int t = 0; t < D; ++t) ss = ss + x[t] * x[t];
  const float rms = std::sqrt(ss / static_cast<float>(D));
  int nf = 0;
  while (nf < kTcqSlots && factors[nf] > 0.0f) ++nf;
  uint8_t* back[2] = {work, work + static_cast<size_t>(D) * kTcqStates};
  int32_t* cand[2] = {reinterpret_cast<int32_t*>(work + 2 * static_cast<size_t>(D) * kTcqStates),
                      reinterpret_cast<int32_t*>(work + 2 * static_cast<size_t>(D) * kTcqStates) + D};
  float best_cost = 0.0f, best_scale = 0.0f;
  for (int f = 0; f < nf; f += 2) {
    const int n = std::min(2, nf - f);
    float scale[2], cost[2][kTcqStates];
    for (int k = 0; k < n; ++k) scale[k] = fp16_toward(rms * factors[f + k], true);
    if (n == 2) tcq_forward<2>(x, D, bits, alphabet, scale, cost, back);
    else tcq_forward<1>(x, D, bits, alphabet, scale, cost, back);
    for (int k = 0; k < n; ++k) {
      const float c = tcq_traceback(cost[k], D, back[k], f + k == 0 ? codes : cand[k]);
      if (f + k == 0) {
        best_cost = c;
        best_scale = scale[k];
      } else if (c < best_cost) {
        best_cost = c;
        best_scale = scale[k];
        std::memcpy(codes, cand[k], sizeof(int32_t) * D);
      }
    }
  }
  if (!search) return best_scale;
  float num = 0.0f, den = 0.0f;
  int l1 = 0, l2 = 0, l3 = 0;
  float* lv = reinterpret_cast<float*>(cand[0]);
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
