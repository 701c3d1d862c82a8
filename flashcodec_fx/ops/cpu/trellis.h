// Trellis-coded quantization (levels="tcq", codecs/trellis.py) in C++: the windowed decode (a value from its code and
// the low bits of the three codes before it in its row) and the Viterbi encoder, bitwise the reference's (every sum
// sequential along the row, one rounding per operation: the build's -ffp-contract=off keeps a * b + c unfused; the
// same tie rules). Concatenated after common.h; the encoder uses quantize.h's fp16_toward (declared here).

namespace fc {

constexpr int kTcqStates = 8;
constexpr int kTcqMaxBits = 4;

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

// One row of D values -> trellis codes and the fp16 scale (trellis.encode): candidates fp16_up(rms * f), the cheapest
// path kept (ties: the first), then (search) the least-squares scale of its codes where it errs less.
// work: at least D * (kTcqStates + 4) bytes.
inline float tcq_encode_row(const float* x, int D, int bits, const float* alphabet, bool search, int32_t* codes,
                            uint8_t* work) {
  static const float kFactors[2] = {0.9f, 1.05f};  // trellis.FACTORS
  static const float kOne[1] = {1.0f};
  float ss = 0.0f;
  for (int t = 0; t < D; ++t) ss = ss + x[t] * x[t];
  const float rms = std::sqrt(ss / static_cast<float>(D));
  const float* factors = search ? kFactors : kOne;
  const int nf = search ? 2 : 1;
  uint8_t* back = work;
  int32_t* cand = reinterpret_cast<int32_t*>(work + static_cast<size_t>(D) * kTcqStates);
  float best_cost = 0.0f, best_scale = 0.0f;
  for (int f = 0; f < nf; ++f) {
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
