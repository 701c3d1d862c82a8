// The quantizer of codecs/quant.py in C++ (scale search, every level set and axis; torch's summation order, so
// bitwise the reference's) and the probe of torch's sum width: shared by the cache's append (append.cpp) and the
// vLLM plugin's store (vllm/cpu/paged_store.cpp). Concatenated after common.h.

namespace fc {

constexpr int kMaxFactors = 16;

// Mutable pointers of one archive slot (a group) of one (b, h).
struct Slot {
  char* data;
  at::Half* scale;
  at::Half* zero;
  uint8_t* index;
};

// The nearest fp16 value >= x (up) or <= x, in fp32, clamped to the fp16 range (quant.fp16_toward): scales round up
// and zero points down, so the stored grid still covers every value the unrounded one covered.
inline float fp16_toward(float x, bool up) {
  const at::Half half(std::min(std::max(x, -kFp16Max), kFp16Max));
  const float near = static_cast<float>(half);
  const bool off = (up ? near < x : near > x) && std::fabs(x) <= kFp16Max;
  if (!off) return near;
  bool negative = (half.x & 0x8000) != 0;
  int magnitude = half.x & 0x7FFF;
  magnitude += negative != up ? 1 : -1;  // away from zero: up from a positive value, down from a negative one
  if (magnitude < 0) {  // from a zero of the other sign: the smallest subnormal of the direction's sign
    negative = !up;
    magnitude = 1;
  }
  return static_cast<float>(at::Half(static_cast<uint16_t>((negative ? 0x8000 : 0) | magnitude), at::Half::from_bits()));
}

// --- sums in torch's order --------------------------------------------------------------------------------------
//
// The quantizer's RMS scales and search errors are float sums; the reference computes them with torch's CPU sum
// kernel (aten/src/ATen/native/cpu/SumKernel.cpp, cascade_sum), whose order depends on its vector width W. These
// functions add in that same order, so the sums, hence the scales and codes, are bitwise the reference's.

inline int ceil_log2(int64_t x) {
  if (x <= 2) return 1;
  int r = 0;
  while ((int64_t(1) << r) < x) ++r;
  return r;
}

// multi_row_sum: `size` steps of `lanes` parallel sums, flushed through four cascade levels.
template <typename F>
inline void cascade_sum(int64_t size, int lanes, F elem, float* out) {
  constexpr int kLevels = 4;
  const int power = std::max(4, ceil_log2(size) / kLevels);
  const int64_t step = int64_t(1) << power, mask = step - 1;
  float acc[kLevels][64];
  for (int l = 0; l < kLevels; ++l)
    for (int k = 0; k < lanes; ++k) acc[l][k] = 0.0f;
  int64_t i = 0;
  while (i + step <= size) {
    for (int64_t j = 0; j < step; ++j, ++i)
      for (int k = 0; k < lanes; ++k) acc[0][k] += elem(i, k);
    for (int l = 1; l < kLevels; ++l) {
      for (int k = 0; k < lanes; ++k) {
        acc[l][k] += acc[l - 1][k];
        acc[l - 1][k] = 0.0f;
      }
      if ((i & (mask << (l * power))) != 0) break;
    }
  }
  for (; i < size; ++i)
    for (int k = 0; k < lanes; ++k) acc[0][k] += elem(i, k);
  for (int l = 1; l < kLevels; ++l)
    for (int k = 0; k < lanes; ++k) acc[0][k] += acc[l][k];
  for (int k = 0; k < lanes; ++k) out[k] = acc[0][k];
}

// row_sum: `size` elements of `width` lanes each (width 1: scalars), read four at a time as one cascade row.
template <typename F>
inline void row_sum(int64_t size, int width, F elem, float* out) {
  constexpr int kIlp = 4;
  const int64_t rows = size / kIlp;
  float part[kIlp * 16];
  cascade_sum(rows, kIlp * width, [&](int64_t i, int k) { return elem(i * kIlp + k / width, k % width); }, part);
  for (int64_t i = rows * kIlp; i < size; ++i)
    for (int k = 0; k < width; ++k) part[k] += elem(i, k);
  for (int p = 1; p < kIlp; ++p)
    for (int k = 0; k < width; ++k) part[k] += part[p * width + k];
  for (int k = 0; k < width; ++k) out[k] = part[k];
}

// torch_inner_sum of a row of fewer than 64 vectors (row_sum's cascade never flushes: one level of sequential sums
// per lane) as loops that vectorize: the same additions in the same order. W: the width when known at compile time
// (the common ones: the loops unroll), 0: `width` at run time.
template <int W>
inline float short_inner_sum(const float* x, int64_t n, int width) {
  if constexpr (W > 0) width = W;
  const int64_t vecs = n / width, rows = vecs / 4;
  float part[4 * 16];
  for (int k = 0; k < 4 * width; ++k) part[k] = 0.0f;
  for (int64_t i = 0; i < rows; ++i)
#pragma omp simd
    for (int k = 0; k < 4 * width; ++k) part[k] += x[i * 4 * width + k];
  for (int64_t i = rows * 4; i < vecs; ++i)
    for (int k = 0; k < width; ++k) part[k] += x[i * width + k];
  for (int p = 1; p < 4; ++p)
    for (int k = 0; k < width; ++k) part[k] += part[p * width + k];
  float total = 0.0f;
  for (int64_t k = vecs * width; k < n; ++k) total += x[k];
  for (int k = 0; k < width; ++k) total += part[k];
  return total;
}

#if defined(__AVX2__)
// short_inner_sum<8> in registers (the four partial vectors, then their lanes in order): the same additions in the
// same order, without the round trip through a stack array; inlined, so that a slice's independent sums overlap.
inline __attribute__((always_inline)) float short_inner_sum8(const float* x, int64_t n) {
  const int64_t vecs = n / 8, rows = vecs / 4;
  __m256 p0 = _mm256_setzero_ps(), p1 = p0, p2 = p0, p3 = p0;
  for (int64_t i = 0; i < rows; ++i) {
    p0 = _mm256_add_ps(p0, _mm256_loadu_ps(x + 32 * i));
    p1 = _mm256_add_ps(p1, _mm256_loadu_ps(x + 32 * i + 8));
    p2 = _mm256_add_ps(p2, _mm256_loadu_ps(x + 32 * i + 16));
    p3 = _mm256_add_ps(p3, _mm256_loadu_ps(x + 32 * i + 24));
  }
  for (int64_t i = rows * 4; i < vecs; ++i) p0 = _mm256_add_ps(p0, _mm256_loadu_ps(x + 8 * i));
  p0 = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(p0, p1), p2), p3);
  float total = 0.0f;
  for (int64_t k = vecs * 8; k < n; ++k) total += x[k];
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, p0);
  for (int k = 0; k < 8; ++k) total += lanes[k];
  return total;
}
#endif

inline float short_inner_sum(const float* x, int64_t n, int width) {
  switch (width) {
    case 16: return short_inner_sum<16>(x, n, width);
    case 8: return short_inner_sum<8>(x, n, width);
    default: return short_inner_sum<0>(x, n, width);
  }
}

// Sum of a contiguous row of n floats, reduced along the row (vectorized_inner_sum / scalar_inner_sum).
inline float torch_inner_sum(const float* x, int64_t n, int width) {
  if (n >= width && width <= 16 && n / width / 4 < 16) return short_inner_sum(x, n, width);
  if (n < width) {
    float s;
    row_sum(n, 1, [&](int64_t i, int) { return x[i]; }, &s);
    return s;
  }
  const int64_t vecs = n / width;
  float lanes[16];
  row_sum(vecs, width, [&](int64_t i, int k) { return x[i * width + k]; }, lanes);
  float total = 0.0f;
  for (int64_t k = vecs * width; k < n; ++k) total += x[k];
  for (int k = 0; k < width; ++k) total += lanes[k];
  return total;
}

// Sum of n values (x, in reduction order) of output channel d of D contiguous outputs: the first channels in blocks
// of four vectors (vectorized_outer_sum; D < W: four scalars, scalar_outer_sum) add sequentially through the
// cascade, the others four reduced elements at a time (row_sum).
inline float torch_outer_sum(const float* x, int64_t n, int d, int D, int width) {
  float s;
  const int block = D >= width ? 4 * width : 4;
  if (d < D / block * block) {
    cascade_sum(n, 1, [&](int64_t i, int) { return x[i]; }, &s);
  } else {
    row_sum(n, 1, [&](int64_t i, int) { return x[i]; }, &s);
  }
  return s;
}

// --- the quantizer (codecs/quant.py) -------------------------------------------------------------------------------

// Values of one scale slice: token axis = one row over D channels; channel axis = one channel over the class rows of
// every block of the group. `row[i]` is the stored row of value i (its bit width and level table).
struct Slice {
  const float* x;
  const int* row;
  int n;
  int channel;  // -1: a token-axis row (summed along D); else the channel of a channel-axis slice

  float sum(const Codec& c, const float* v) const {
#if defined(__AVX2__)
    if (channel < 0 && c.sum_width == 8 && n >= 8 && n / 8 / 4 < 16) return short_inner_sum8(v, n);
#endif
    return channel < 0 ? torch_inner_sum(v, n, c.sum_width) : torch_outer_sum(v, n, channel, c.head_dim, c.sum_width);
  }
};

inline int qmax_of(int bits) { return (1 << (bits - 1)) - 1; }

inline int nearest_code(const Codec& c, int j, int kind, float x, float scale, float zero) {
  const float safe = scale > 0.0f ? scale : 1.0f;
  const float y = (x - zero) / safe;
  const int bits = c.bits[j];
  const int lo = kind == kInt ? 1 : 0, hi = (1 << bits) - 1;
  const float* table = c.levels + j * kLevelWidth;
  int code;
  if (kind == kLloyd) {  // bucketize(right=False): the number of midpoints strictly below y (ties go down)
    code = 0;
    for (int e = 0; e + 1 < (1 << bits); ++e) code += (table[e + 1] + table[e]) / 2.0f < y;
  } else {
    const float u = y - table[0];
    const float rounded = std::nearbyint(u);
    code = rounded < lo ? lo : rounded > hi ? hi : static_cast<int>(rounded);
  }
  return std::min(std::max(code, lo), hi);
}

// A token-axis slice of Lloyd row j (every value on the same N = 2**bits levels, in increasing order): the codes
// nearest_code gives and the squared errors of level * scale + zero against x (`out`); for scale_search="fit" (Fit:
// fit_slice) instead each level's products with x (`out`) and with itself (`ll`), and the level (`lv`). A loop over
// the row that vectorizes: one compare per midpoint, counted for the code and selecting the level (the midpoints
// increase, so the ones below y are a prefix and the last one selected is the code's level); the same float
// operations as nearest_code, so bitwise its results.
template <int N, bool Fit>
inline void lloyd_row(const float* table, const float* x, int n, float scale, float zero, int32_t* codes, float* out,
                      float* ll, float* lv) {
  float t[N], mid[N];
  for (int e = 0; e < N; ++e) t[e] = table[e];
  for (int e = 0; e + 1 < N; ++e) mid[e] = (table[e + 1] + table[e]) / 2.0f;
  const float safe = scale > 0.0f ? scale : 1.0f;
  int i0 = 0;
#if defined(__AVX512F__)
  // 16 values at a time: each midpoint's compare counted into the code by a masked add, the level then read from
  // the table by one permute (the same compares; the code's level is the one the blends select)
  alignas(64) float tab[16] = {};
  for (int e = 0; e < N; ++e) tab[e] = t[e];
  const __m512 levels = _mm512_load_ps(tab), vzero = _mm512_set1_ps(zero), vsafe = _mm512_set1_ps(safe);
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512i one = _mm512_set1_epi32(1);
  for (; i0 + 16 <= n; i0 += 16) {
    const __m512 xv = _mm512_loadu_ps(x + i0);
    const __m512 y = _mm512_div_ps(_mm512_sub_ps(xv, vzero), vsafe);
    __m512i code = _mm512_setzero_si512();
#pragma GCC unroll 16
    for (int e = 0; e + 1 < N; ++e)
      code = _mm512_mask_add_epi32(code, _mm512_cmp_ps_mask(_mm512_set1_ps(mid[e]), y, _CMP_LT_OQ), code, one);
    const __m512 level = _mm512_permutexvar_ps(code, levels);
    _mm512_storeu_si512(codes + i0, code);
    if constexpr (Fit) {
      _mm512_storeu_ps(out + i0, _mm512_mul_ps(xv, level));
      _mm512_storeu_ps(ll + i0, _mm512_mul_ps(level, level));
      _mm512_storeu_ps(lv + i0, level);
    } else {
      const __m512 diff = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(level, vscale), vzero), xv);
      _mm512_storeu_ps(out + i0, _mm512_mul_ps(diff, diff));
    }
  }
#endif
#pragma omp simd
  for (int i = i0; i < n; ++i) {
    const float y = (x[i] - zero) / safe;
    int code = 0;
    float level = t[0];
#pragma GCC unroll 16
    for (int e = 0; e + 1 < N; ++e) {
      const bool below = mid[e] < y;
      code += below ? 1 : 0;
      level = below ? t[e + 1] : level;
    }
    codes[i] = code;
    if constexpr (Fit) {
      out[i] = x[i] * level;
      ll[i] = level * level;
      lv[i] = level;
    } else {
      const float diff = level * scale + zero - x[i];
      out[i] = diff * diff;
    }
  }
}

// lloyd_row for a row of 1..4 bits whose levels increase (Lloyd-Max tables do); false otherwise (nearest_code then).
template <bool Fit = false>
inline bool lloyd_row_any(int bits, const float* table, const float* x, int n, float scale, float zero, int32_t* codes,
                          float* out, float* ll = nullptr, float* lv = nullptr) {
  if (bits > 4) return false;
  for (int e = 0; e + 1 < (1 << bits); ++e)
    if (!(table[e] < table[e + 1])) return false;
  switch (bits) {
    case 1: lloyd_row<2, Fit>(table, x, n, scale, zero, codes, out, ll, lv); break;
    case 2: lloyd_row<4, Fit>(table, x, n, scale, zero, codes, out, ll, lv); break;
    case 3: lloyd_row<8, Fit>(table, x, n, scale, zero, codes, out, ll, lv); break;
    default: lloyd_row<16, Fit>(table, x, n, scale, zero, codes, out, ll, lv); break;
  }
  return true;
}

// A token-axis slice of an int / midrise / uniform row j: nearest_code's codes (rounded by the 1.5 * 2**23 trick,
// round-half-even as nearbyint: exact below 2**22, and larger values clamp to lo / hi either way; finite x) and,
// where `sq` is set, the squared errors; where `xl` is set (fit_slice), the products of each level with x and with
// itself and the level, `level == code + table[0]` (exact: the affine tables hold small integers or half-integers).
// Loops over the row that vectorize; bitwise nearest_code's results.
inline void rounded_row(const float* table, int lo, int hi, const float* x, int n, float scale, float zero,
                        int32_t* codes, float* sq, float* xl = nullptr, float* ll = nullptr, float* lv = nullptr) {
  const float safe = scale > 0.0f ? scale : 1.0f, t0 = table[0];
  const float flo = static_cast<float>(lo), fhi = static_cast<float>(hi);
#pragma omp simd
  for (int i = 0; i < n; ++i) {
    const float u = (x[i] - zero) / safe - t0;
    const float r = (u + 12582912.0f) - 12582912.0f;
    const float below = r > fhi ? fhi : r;
    codes[i] = static_cast<int32_t>(below >= flo ? below : flo);
  }
  for (int i = 0; sq != nullptr && i < n; ++i) {
    const float diff = table[codes[i]] * scale + zero - x[i];
    sq[i] = diff * diff;
  }
  if (xl == nullptr) return;
#pragma omp simd
  for (int i = 0; i < n; ++i) {
    const float level = static_cast<float>(codes[i]) + t0;
    xl[i] = x[i] * level;
    ll[i] = level * level;
    lv[i] = level;
  }
}

// The largest |x[i]| of n values (0 when n is 0). A max is exact in any order, so 16 lanes each keep their own
// (an elementwise max the compiler vectorizes; a reduction pragma left it one serial chain), then across the lanes
// by halves; a NaN is skipped as std::max skips it.
inline float abs_max(const float* x, int n) {
  constexpr int kLanes = 16;
  float lane[kLanes] = {};
  int i = 0;
  for (; i + kLanes <= n; i += kLanes) {
#pragma omp simd
    for (int l = 0; l < kLanes; ++l) lane[l] = std::max(lane[l], std::fabs(x[i + l]));
  }
  for (int width = kLanes / 2; width > 0; width /= 2) {  // across the lanes by halves: log2(16) steps, not 16
#pragma omp simd
    for (int l = 0; l < width; ++l) lane[l] = std::max(lane[l], lane[l + width]);
  }
  float amax = lane[0];
  for (; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  return amax;
}

// The base (no-clipping) scale and zero of a slice of class k (levels.base_scale and the shared-step rule).
inline void base_scale(const Codec& c, int k, const Slice& s, bool shared_step, int blocks, float* sq, float& base,
                       float& zero) {
  const int kind = c.class_levels[k], bits = c.bits[c.class_first[k]];
  zero = 0.0f;
  if (shared_step) {  // int / midrise over several rows: amax per row over the blocks, / per-row divisor, max
    base = 0.0f;
    const int first = c.class_first[k], nrows = c.class_last[k] - first + 1;
    for (int jr = 0; jr < nrows; ++jr) {
      float amax = 0.0f;
      for (int blk = 0; blk < blocks; ++blk) amax = std::max(amax, std::fabs(s.x[blk * nrows + jr]));
      const int bj = c.bits[first + jr];
      const float div = kind == kInt ? static_cast<float>(qmax_of(bj)) : static_cast<float>(1 << (bj - 1));
      base = std::max(base, amax / div);
    }
    return;
  }
  if (kind == kUniform) {
    float low = s.x[0], high = s.x[0];
    for (int i = 1; i < s.n; ++i) { low = std::min(low, s.x[i]); high = std::max(high, s.x[i]); }
    base = (high - low) / static_cast<float>((1 << bits) - 1);
    zero = low;
  } else if (kind == kLloyd) {
    for (int i = 0; i < s.n; ++i) sq[i] = s.x[i] * s.x[i];
    base = std::sqrt(s.sum(c, sq) / static_cast<float>(s.n));
  } else {
    base = abs_max(s.x, s.n) / (kind == kInt ? static_cast<float>(qmax_of(bits)) : static_cast<float>(1 << (bits - 1)));
  }
}

// The fp16-rounded candidate scale and zero point of factor f over the no-clipping (base, zero0) (quant._candidates).
inline void candidate(int kind, int bits, float base, float zero0, float f, float& scale, float& zero) {
  const float sf = base * f;
  if (kind != kUniform) {
    scale = fp16_toward(sf, true);
    zero = 0.0f;
    return;
  }
  const float span = static_cast<float>((1 << bits) - 1);
  const float mid = zero0 + base * span / 2.0f;
  const float low = fp16_toward(mid - sf * span / 2.0f, false);
  scale = fp16_toward((mid + sf * span / 2.0f - low) / span, true);
  zero = low;
}

// The nearest fp16 value of x (ties to even), clamped to the fp16 range (quant.fp16_nearest).
inline float fp16_nearest(float x) { return static_cast<float>(at::Half(std::min(std::max(x, -kFp16Max), kFp16Max))); }

constexpr int kFitRounds = 2;  // quant.FIT_ROUNDS
constexpr float kFitLo = 0.5f, kFitHi = 1.6f;  // quant.FIT_RANGE

// scale_search="fit" (quant.Quantizer._fit): the start factor clamp(a * amax / base + c) of the class's line, then
// kFitRounds times nearest codes and their least-squares scale (uniform: scale and zero point), rounded to the
// nearest fp16, kept only where positive and finite. Sums in torch's order (Slice::sum), so bitwise the reference.
// `sq` holds 4 * s.n floats.
inline void fit_slice(const Codec& c, int k, const Slice& s, bool shared_step, int blocks, float* sq, float& scale,
                      float& zero, int32_t* codes) {
  const int kind = c.class_levels[k], bits = c.bits[c.class_first[k]];
  float base, zero0;
  base_scale(c, k, s, shared_step, blocks, sq, base, zero0);
  const float* line = c.factors + c.n_shrink + c.n_lloyd + 2 * k;
  const float amax = abs_max(s.x, s.n);
  const float ratio = amax / (base > 0.0f ? base : 1.0f);
  const float f = std::min(std::max(ratio * line[0] + line[1], kFitLo), kFitHi);
  candidate(kind, bits, base, zero0, f, scale, zero);
  float* xl = sq;
  float* ll = sq + s.n;
  float* lv = sq + 2 * s.n;
  const int j0 = s.row[0], lo = kind == kInt ? 1 : 0, hi = (1 << c.bits[j0]) - 1;
  const float* table = c.levels + j0 * kLevelWidth;
  const bool token = s.channel < 0;
  for (int round = 0; round < kFitRounds; ++round) {
    if (token && kind == kLloyd && lloyd_row_any<true>(c.bits[j0], table, s.x, s.n, scale, zero, codes, xl, ll, lv)) {
    } else if (token && kind != kLloyd) {
      rounded_row(table, lo, hi, s.x, s.n, scale, zero, codes, nullptr, xl, ll, lv);
    } else {
      for (int i = 0; i < s.n; ++i) {
        codes[i] = nearest_code(c, s.row[i], kind, s.x[i], scale, zero);
        lv[i] = c.levels[s.row[i] * kLevelWidth + codes[i]];
        xl[i] = s.x[i] * lv[i];
        ll[i] = lv[i] * lv[i];
      }
    }
    const float sxl = s.sum(c, xl), sll = s.sum(c, ll);
    if (kind != kUniform) {
      const float fit = sxl / (sll > 0.0f ? sll : 1.0f);
      if (sll > 0.0f && fit > 0.0f && fit <= kFp16Max) scale = fp16_nearest(fit);
      continue;
    }
    const float n = static_cast<float>(s.n);
    const float sx = s.sum(c, s.x), sl = s.sum(c, lv);
    const float det = n * sll - sl * sl;
    const float fit = (n * sxl - sx * sl) / (det > 0.0f ? det : 1.0f);
    if (det > 0.0f && fit > 0.0f && fit <= kFp16Max) {
      scale = fp16_nearest(fit);
      zero = fp16_nearest((sx - scale * sl) / n);
    }
  }
}

// Scale and zero of one slice (with the clipping search) and its codes.
inline void quantize_slice(const Codec& c, int k, const Slice& s, bool shared_step, int blocks, float* sq,
                           float& scale, float& zero, int32_t* codes) {
  if (c.search == kSearchFit) {
    fit_slice(c, k, s, shared_step, blocks, sq, scale, zero, codes);
    return;
  }
  const int kind = c.class_levels[k], bits = c.bits[c.class_first[k]];
  float base, zero0;
  base_scale(c, k, s, shared_step, blocks, sq, base, zero0);
  const bool trials = c.search == kSearchTrials;
  const float* factors = kind == kLloyd ? c.factors + c.n_shrink : c.factors;
  const int nf = trials ? (kind == kLloyd ? c.n_lloyd : c.n_shrink) : 1;
  const float one = 1.0f;
  if (!trials) factors = &one;
  float cand_s[kMaxFactors], cand_z[kMaxFactors];
  for (int f = 0; f < nf; ++f) candidate(kind, bits, base, zero0, factors[f], cand_s[f], cand_z[f]);
  // A token row (one level table): vectorized passes. The search's codes land in `codes`; the final pass (the best
  // candidate's codes) overwrites them unless the last candidate was the best.
  const int j0 = s.row[0], lo = kind == kInt ? 1 : 0, hi = (1 << c.bits[j0]) - 1;
  const float* table = c.levels + j0 * kLevelWidth;
  const bool lloyd = kind == kLloyd && s.channel < 0 && lloyd_row_any(c.bits[j0], table, s.x, s.n, cand_s[0],
                                                                      cand_z[0], codes, sq);
  if (lloyd || (kind != kLloyd && s.channel < 0)) {
    const auto pass = [&](int f) {
      if (lloyd) lloyd_row_any(c.bits[j0], table, s.x, s.n, cand_s[f], cand_z[f], codes, sq);
      else rounded_row(table, lo, hi, s.x, s.n, cand_s[f], cand_z[f], codes, nf > 1 ? sq : nullptr);
    };
    if (!lloyd) pass(0);
    int best = 0;
    float best_err = nf > 1 ? s.sum(c, sq) : 0.0f;
    for (int f = 1; f < nf; ++f) {
      pass(f);
      const float e = s.sum(c, sq);
      if (e < best_err) { best_err = e; best = f; }
    }
    if (best != nf - 1) pass(best);
    scale = cand_s[best];
    zero = cand_z[best];
    return;
  }
  int best = 0;
  if (nf > 1) {
    float best_err = 0.0f;
    for (int f = 0; f < nf; ++f) {
      for (int i = 0; i < s.n; ++i) {
        const int j = s.row[i];
        const float lv = c.levels[j * kLevelWidth + nearest_code(c, j, kind, s.x[i], cand_s[f], cand_z[f])];
        const float diff = lv * cand_s[f] + cand_z[f] - s.x[i];
        sq[i] = diff * diff;
      }
      const float e = s.sum(c, sq);
      if (f == 0 || e < best_err) { best_err = e; best = f; }
    }
  }
  scale = cand_s[best];
  zero = cand_z[best];
  for (int i = 0; i < s.n; ++i) codes[i] = nearest_code(c, s.row[i], kind, s.x[i], scale, zero);
}

// Bits shift .. shift + W - 1 of every code, 8 / W codes per byte (the widths known at compile time: unrolled).
template <int W>
inline void pack_slice(const int32_t* codes, int shift, int D, uint8_t* out) {
  constexpr int per = 8 / W;
  constexpr uint32_t mask = (1u << W) - 1;
  for (int i = 0; i < D / per; ++i) {
    uint32_t byte = 0;
#pragma GCC unroll 8
    for (int k = 0; k < per; ++k) byte |= ((static_cast<uint32_t>(codes[i * per + k]) >> shift) & mask) << (k * W);
    out[i] = static_cast<uint8_t>(byte);
  }
}

inline void pack_row(const int32_t* codes, int bits, int D, uint8_t* out) {
  int shift = 0;
  const int widths[4] = {8, 4, 2, 1};
  for (int w : widths) {
    if (bits - shift < w) continue;
    switch (w) {
      case 8: pack_slice<8>(codes, shift, D, out); break;
      case 4: pack_slice<4>(codes, shift, D, out); break;
      case 2: pack_slice<2>(codes, shift, D, out); break;
      default: pack_slice<1>(codes, shift, D, out); break;
    }
    out += D * w / 8;
    shift += w;
  }
}

// coefs (g x K x D) of one scale group -> packed codes, fp16 scales and zero points at `slot`.
void quantize_group(const Codec& c, const float* coefs, const Slot& slot, std::vector<float>& xbuf,
                    std::vector<int>& rbuf, std::vector<int32_t>& cbuf, std::vector<int32_t>& codes,
                    std::vector<float>& sq) {
  const int D = c.head_dim, K = c.rows, g = c.blocks;
  codes.assign(static_cast<size_t>(g) * K * D, 0);
  sq.resize(4 * static_cast<size_t>(std::max(D, g * K)));  // fit_slice: 4 slices' worth
  for (int k = 0; k < c.classes; ++k) {
    const int first = c.class_first[k], nrows = c.class_last[k] - first + 1;
    const int zslot = c.class_zero[k];
    const bool shared = (c.class_levels[k] == kInt || c.class_levels[k] == kMidrise) && nrows > 1;
    if (c.quant == kToken) {
      rbuf.assign(D, first);
      for (int blk = 0; blk < g; ++blk) {
        if (c.class_levels[k] == kTcq) {  // trellis codes: the row's Viterbi search and scale (trellis.h)
          slot.scale[blk * c.classes + k] = at::Half(tcq_encode_row(
              coefs + (blk * K + first) * D, D, c.bits[first], c.levels + first * kLevelWidth,
              c.factors + c.n_shrink + c.n_lloyd + 2 * c.classes + k * kTcqSlots, c.search != kSearchNone,
              codes.data() + (blk * K + first) * D, tcq_work(static_cast<size_t>(D) * kTcqWorkPerValue)));
          continue;
        }
        Slice s{coefs + (blk * K + first) * D, rbuf.data(), D, -1};
        float sc, zr;
        quantize_slice(c, k, s, false, 1, sq.data(), sc, zr, codes.data() + (blk * K + first) * D);
        slot.scale[blk * c.classes + k] = at::Half(sc);
        if (zslot >= 0) slot.zero[blk * c.zero_classes + zslot] = at::Half(zr);
      }
    } else {
      const int n = g * nrows;
      xbuf.resize(n);
      rbuf.resize(n);
      cbuf.resize(n);
      for (int d = 0; d < D; ++d) {
        for (int blk = 0; blk < g; ++blk)
          for (int jr = 0; jr < nrows; ++jr) {
            xbuf[blk * nrows + jr] = coefs[(blk * K + first + jr) * D + d];
            rbuf[blk * nrows + jr] = first + jr;
          }
        Slice s{xbuf.data(), rbuf.data(), n, d};
        float sc, zr;
        quantize_slice(c, k, s, shared, g, sq.data(), sc, zr, cbuf.data());
        for (int blk = 0; blk < g; ++blk)
          for (int jr = 0; jr < nrows; ++jr) codes[(blk * K + first + jr) * D + d] = cbuf[blk * nrows + jr];
        slot.scale[k * D + d] = at::Half(sc);
        if (zslot >= 0) slot.zero[zslot * D + d] = at::Half(zr);
      }
    }
  }
  uint8_t* data = reinterpret_cast<uint8_t*>(slot.data);
  for (int blk = 0; blk < g; ++blk)
    for (int j = 0; j < K; ++j)
      pack_row(codes.data() + (blk * K + j) * D, c.bits[j], D, data + blk * c.row_bytes + c.byte_offset[j]);
}

// Sums of x (N, M) fp32 along its rows and along its columns in torch's order for vector width `width`: the
// launcher compares them with torch's own sums to learn the width torch's sum kernel uses on this machine.
std::vector<at::Tensor> sum_probe(const at::Tensor& x_in, int64_t width) {
  const at::Tensor x = x_in.contiguous();
  const int64_t n = x.size(0), m = x.size(1);
  const float* p = x.data_ptr<float>();
  at::Tensor rows = at::empty({n}, x.options()), cols = at::empty({m}, x.options());
  for (int64_t i = 0; i < n; ++i) rows.data_ptr<float>()[i] = torch_inner_sum(p + i * m, m, static_cast<int>(width));
  std::vector<float> column(n);
  for (int64_t d = 0; d < m; ++d) {
    for (int64_t i = 0; i < n; ++i) column[i] = p[i * m + d];
    cols.data_ptr<float>()[d] =
        torch_outer_sum(column.data(), n, static_cast<int>(d), static_cast<int>(m), static_cast<int>(width));
  }
  return {rows, cols};
}

}  // namespace fc
