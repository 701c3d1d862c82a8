// Attention of long prefill chunks on vLLM pages on the CPU (the spec: vllm/reference.py attention_reference): the
// requests of a call with more than `min_tokens` tokens in it (paged_attention.cpp, the per-token kernel, serves the
// others). A chunk's own tokens and its history are different work, done apart and merged by their softmax states:
//
// - own tokens (raw K / V of this call, causal): GEMM-shaped tiles of kOwnTokens query tokens x kOwnKeys keys.
// - history (codes): each page of a (request, KV head) is decoded once per call into a scratch of kGroupKeys keys
//   (keys transposed, values as rows, in the codes' rotated domain: level * scale + zero (row_levels: trellis codes
//   too), plus the page's key mean rotated for centered keys; the raw rows holding history tokens, PageLayout::read,
//   rotated into it), and every
//   query row of the call is attended against it in blocks of kRowBlock rows (the queries rotated
//   once, R_k q). A long history is split into chunks of pages, each with a softmax state of its own, so that threads
//   share a request's history without decoding a page twice.
// - merge, per query row: the own state, the history chunks' states and the sink logit (s_aux) by their maxima; the
//   history's value sum rotated back once (R_v), the sum normalized, the row written in the output's dtype.
//
// Rows of a (request, KV head): token-major, the GQA heads side by side (row t * G + g is query head h * G + g of
// token t). Everything is fp32 (`scale` folded into q, exp by exp2_16 and exp_one); per-thread scratch is bounded
// by the tile sizes, the call's buffers by its tokens (never by the history) and kept between calls (a workspace: a
// fresh buffer past the allocator's mmap threshold page-faulted on every call, ~6,000 faults for a 4k-token step).
// Needs head_dim % 16 == 0 (the launcher sends other head dims to the per-token kernel).

namespace fc {

namespace {

constexpr int kMR = 6;            // query rows per register tile
constexpr int kOwnTokens = 32;    // query tokens per own-token item (fewer where G * 32 > kMaxTileRows)
constexpr int kOwnKeys = 128;     // keys per own-token tile (a multiple of kOwnTokens: every tile row sees a key)
constexpr int kGroupKeys = 512;   // history keys decoded at a time (whole pages)
constexpr int kRowBlock = 48;     // query rows per history / merge tile
constexpr int kMaxTileRows = 256; // query rows of a tile at most

inline int64_t round16(int64_t n) { return (n + 15) / 16 * 16; }
// A row stride of at least n floats, a multiple of 16 and an odd number of 64-byte lines: rows read together (a
// transposed key tile's D rows, a score tile's rows) then fall into different L1 sets, not all into one.
inline int64_t padded(int64_t n) { return 16 * ((n + 15) / 16 | 1); }

// s[i][0:16 NV] = sum_d a[i][d] * bt[d][0:16 NV] for i < MR.
template <int MR, int NV>
inline void qk_tile(const float* a, int64_t lda, const float* bt, int64_t ldb, int D, float* s, int64_t lds) {
  float acc[MR][16 * NV];
  for (int i = 0; i < MR; ++i)
#pragma omp simd
    for (int l = 0; l < 16 * NV; ++l) acc[i][l] = a[i * lda] * bt[l];
  for (int d = 1; d < D; ++d) {
    const float* b = bt + d * ldb;
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const float x = a[i * lda + d];
#pragma omp simd
      for (int l = 0; l < 16 * NV; ++l) acc[i][l] = std::fma(x, b[l], acc[i][l]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int l = 0; l < 16 * NV; ++l) s[i * lds + l] = acc[i][l];
}

template <int MR>
inline void qk_rows(const float* a, int64_t lda, const float* bt, int64_t ldb, int D, int64_t cols, float* s,
                    int64_t lds) {
  int64_t j = 0;
  for (; j + 64 <= cols; j += 64) qk_tile<MR, 4>(a, lda, bt + j, ldb, D, s + j, lds);
  for (; j + 32 <= cols; j += 32) qk_tile<MR, 2>(a, lda, bt + j, ldb, D, s + j, lds);
  if (j < cols) qk_tile<MR, 1>(a, lda, bt + j, ldb, D, s + j, lds);
}

// fn(std::integral_constant<int, MR>, first row) over m rows: tiles of kMR rows, then one of the rest.
template <typename F>
inline void row_tiles(int64_t m, F&& fn) {
  int64_t i = 0;
  for (; i + kMR <= m; i += kMR) fn(std::integral_constant<int, kMR>{}, i);
  switch (m - i) {
    case 5: fn(std::integral_constant<int, 5>{}, i); break;
    case 4: fn(std::integral_constant<int, 4>{}, i); break;
    case 3: fn(std::integral_constant<int, 3>{}, i); break;
    case 2: fn(std::integral_constant<int, 2>{}, i); break;
    case 1: fn(std::integral_constant<int, 1>{}, i); break;
    default: break;
  }
}

// s (m x cols) = a (m x D) @ bt (D x cols), cols a multiple of 16. (Not inlined: compiled on its own, GCC keeps the
// tiles' accumulators in registers.)
__attribute__((noinline)) void gemm_qk(const float* a, int64_t lda, const float* bt, int64_t ldb, int D, int64_t m,
                                       int64_t cols, float* s, int64_t lds) {
  row_tiles(m, [&](auto mr, int64_t i) {
    qk_rows<decltype(mr)::value>(a + i * lda, lda, bt, ldb, D, cols, s + i * lds, lds);
  });
}

// o[i][0:W] += sum_j p[i][j] * v[j][0:W] for i < MR, j < n.
template <int MR, int W>
inline void pv_tile(const float* p, int64_t ldp, const float* v, int64_t ldv, int64_t n, float* o, int64_t ldo) {
  float acc[MR][W];
  for (int i = 0; i < MR; ++i)
    for (int l = 0; l < W; ++l) acc[i][l] = o[i * ldo + l];
  for (int64_t j = 0; j < n; ++j) {
    const float* vj = v + j * ldv;
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const float x = p[i * ldp + j];
#pragma omp simd
      for (int l = 0; l < W; ++l) acc[i][l] = std::fma(x, vj[l], acc[i][l]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int l = 0; l < W; ++l) o[i * ldo + l] = acc[i][l];
}

template <int MR>
inline void pv_rows(const float* p, int64_t ldp, const float* v, int64_t ldv, int64_t n, int D, float* o, int64_t ldo) {
  int d = 0;
  for (; d + 64 <= D; d += 64) pv_tile<MR, 64>(p, ldp, v + d, ldv, n, o + d, ldo);
  for (; d < D; d += 16) pv_tile<MR, 16>(p, ldp, v + d, ldv, n, o + d, ldo);
}

// o (m x D) += p (m x n) @ v (n x D), D a multiple of 16 (not inlined, as gemm_qk).
__attribute__((noinline)) void gemm_pv(const float* p, int64_t ldp, const float* v, int64_t ldv, int64_t n, int D,
                                       int64_t m, float* o, int64_t ldo) {
  row_tiles(m, [&](auto mr, int64_t i) {
    pv_rows<decltype(mr)::value>(p + i * ldp, ldp, v, ldv, n, D, o + i * ldo, ldo);
  });
}

// A softmax state of m rows: running max, sum, value accumulator (m x D).
struct State {
  float *mx, *sum, *acc;
  void reset(int64_t m, int D) const {
    std::fill(mx, mx + m, kNegInf);
    std::fill(sum, sum + m, 0.0f);
    std::fill(acc, acc + m * D, 0.0f);
  }
  State rows(int64_t first, int D) const { return {mx + first, sum + first, acc + first * D}; }
};

// 16 fp32 lanes as a GCC / clang vector (lowered to whatever the target has: one AVX-512 register, two AVX ones, ...).
typedef float vf16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));
inline vf16 load16(const float* p) {
  vf16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store16(float* p, vf16 v) { std::memcpy(p, &v, sizeof(v)); }
// The 16 lanes folded in halves in registers (lane l with lane l + w, w = 8, 4, 2, 1); through a stack array the
// stores and reloads cost as much as a row's exp work at 128 keys.
#define FC_HALVES(v, w) __builtin_shufflevector(v, v, (w) + 0, (w) + 1, (w) + 2, (w) + 3, (w) + 4, (w) + 5, (w) + 6, \
    (w) + 7, (w) + 8 & 15, (w) + 9 & 15, (w) + 10 & 15, (w) + 11 & 15, (w) + 12 & 15, (w) + 13 & 15, (w) + 14 & 15, \
    (w) + 15 & 15)
inline float lanes_max(vf16 v) {
  v = FC_HALVES(v, 8) > v ? FC_HALVES(v, 8) : v;
  v = FC_HALVES(v, 4) > v ? FC_HALVES(v, 4) : v;
  v = FC_HALVES(v, 2) > v ? FC_HALVES(v, 2) : v;
  v = FC_HALVES(v, 1) > v ? FC_HALVES(v, 1) : v;
  return v[0];
}
inline float lanes_sum(vf16 v) {
  v += FC_HALVES(v, 8);
  v += FC_HALVES(v, 4);
  v += FC_HALVES(v, 2);
  v += FC_HALVES(v, 1);
  return v[0];
}

// Contracted to FMAs here (the build turns contraction off for the store's bitwise sums; nothing here is bitwise).
#if defined(__clang__)
#define FC_CONTRACT_FN
#define FC_CONTRACT _Pragma("clang fp contract(fast)")
#else
#define FC_CONTRACT_FN __attribute__((optimize("fp-contract=fast")))
#define FC_CONTRACT
#endif

constexpr float kLog2e = 1.44269504088896341f;

// 2**t on 16 lanes for t <= 127: t = n + f with n = round(t) (the 1.5 * 2**23 trick, n read back from the sum's
// bits), 2**f for |f| <= 1/2 by Cephes exp2f's polynomial (relative error 1.7e-7), 2**n built in the exponent bits.
// t is clamped at -127, where those bits are 0: 2**t is exactly 0 there, and for -inf (masked keys). 13 vector
// operations; exp(x) as 2**(x log2 e) (one FMA from the scores) took 20.
FC_CONTRACT_FN inline vf16 exp2_16(vf16 t) {
  FC_CONTRACT
  t = t > -127.0f ? t : vf16{} - 127.0f;
  const vf16 y = t + 12582912.0f;  // 1.5 * 2**23: y's low mantissa bits hold n
  const vf16 f = t - (y - 12582912.0f);
  vf16 p = vf16{} + 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  vi16 bits;
  std::memcpy(&bits, &y, sizeof(bits));
  bits = (bits - (0x4B400000 - 127)) << 23;  // (n + 127) << 23: y's bits minus 12582912's are n
  vf16 pow2;
  std::memcpy(&pow2, &bits, sizeof(pow2));
  return p * pow2;
}

// The running max is moved only when a tile's max exceeds it by more than this (natural log units; FA4's rule):
// probabilities then stay below e**8 and most tiles skip rescaling the accumulator.
constexpr float kLazyRescale = 8.0f;

// One online-softmax step of m rows over n scores each (s, row stride lds >= round16(n); the columns up to round16(n)
// are overwritten): scores -> probabilities (relative to the state's max) in place, the state's max and sum updated
// and its accumulator rescaled when the max moves (the caller then adds p @ v). A row whose scores are all -inf gets
// zero probabilities.
FC_CONTRACT_FN inline void softmax_step(float* s, int64_t lds, int64_t m, int64_t n, const State& st, int D) {
  const int64_t cols = round16(n);
  for (int64_t i = 0; i < m; ++i) {
    float* row = s + i * lds;
    std::fill(row + n, row + cols, kNegInf);
    vf16 top = load16(row);
    for (int64_t j = 16; j < cols; j += 16) {
      const vf16 x = load16(row + j);
      top = x > top ? x : top;
    }
    const float mx = lanes_max(top), old = st.mx[i];
    if (mx == kNegInf) {
      std::fill(row, row + cols, 0.0f);
      continue;
    }
    float alpha = 1.0f;
    if (old == kNegInf || mx > old + kLazyRescale) {
      alpha = old == kNegInf ? 0.0f : exp_one(old - mx);
      if (old != kNegInf) scale_row(st.acc + i * D, alpha, D);
      st.mx[i] = mx;
    }
    const float shift = -st.mx[i] * kLog2e;  // exp(x - max) = 2**(x log2 e - max log2 e)
    vf16 total = {};
    for (int64_t j = 0; j < cols; j += 16) {
      const vf16 y = exp2_16(load16(row + j) * kLog2e + shift);
      store16(row + j, y);
      total += y;
    }
    st.sum[i] = st.sum[i] * alpha + lanes_sum(total);
  }
}

// A long request's share of one KV head: its rows and the call's buffers for them.
struct Part {
  int64_t req, head, qs, T, ctx, rows;
  float *q, *q_rot, *k_own_t, *v_own;  // rows x D (scaled), rows x D (rotated), D x padded(T), T x D
  State own;
  int64_t first_chunk, chunks;
};

// A history chunk: pages [first, first + count) of a part's history, and its state (the part's rows).
struct Chunk {
  int64_t part, first, count;
  State st;
};

// y (D) = x (D) @ mt (D x D, row-major): sum_d x[d] * mt[d][:].
inline void row_times(const float* x, const float* mt, int D, float* y) {
  std::fill(y, y + D, 0.0f);
  for (int d = 0; d < D; ++d) axpy(y, x[d], mt + d * D, D);
}

}  // namespace

void paged_prefill(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& cache,
                   const at::Tensor& block_table, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                   const at::Tensor& page_meta, const std::vector<at::Tensor>& kplan,
                   const std::vector<at::Tensor>& vplan,
                   double softmax_scale, const c10::optional<at::Tensor>& s_aux, int64_t min_tokens,
                   const at::Tensor& out) {
  const TokenRows q(query), k(key), v(value), o(out);
  const int D = static_cast<int>(query.size(2));
  TORCH_CHECK(D % 16 == 0, "paged_prefill: head_dim must be a multiple of 16");
  const int64_t Hq = query.size(1);
  const PageLayout p = PageLayout::parse(page_meta, cache, key.scalar_type(), D);
  const int64_t H = p.heads, G = Hq / H;
  TORCH_CHECK(G <= kMaxTileRows, "paged_prefill: at most ", kMaxTileRows, " query heads per KV head");
  const int64_t own_tokens = std::min<int64_t>(kOwnTokens, kMaxTileRows / G);  // query tokens per own-token tile
  const Requests req(block_table, seq_lens, query_start_loc);
  const float* sink = s_aux.has_value() ? s_aux->data_ptr<float>() : nullptr;
  const float scale = static_cast<float>(softmax_scale);
  const SlotCodecs codecs(p, kplan, vplan);
  const Codec &ck = codecs.k, &cv = codecs.v;
  const bool rotate_k = codecs.rot_k != nullptr, rotate_v = codecs.rot_v != nullptr;
  // R_k^T and R_v^T (D x D): rows of the rotations' transposes (q_rot = q @ R_k^T; anchors likewise)
  std::vector<float> rkt(rotate_k ? D * D : 0), rvt(rotate_v ? D * D : 0);
  for (int e = 0; e < D; ++e)
    for (int d = 0; d < D; ++d) {
      if (rotate_k) rkt[d * D + e] = codecs.rot_k[e * D + d];
      if (rotate_v) rvt[d * D + e] = codecs.rot_v[e * D + d];
    }
  const int64_t bs = p.bs, group_pages = std::max<int64_t>(1, kGroupKeys / bs), group_cols = padded(group_pages * bs);

  // The long requests' parts and the call's buffers (sizes from this call's tokens only).
  std::vector<Part> parts;
  int64_t floats = 0, total_work = 0;
  for (int64_t r = 0; r < req.count; ++r) {
    const int64_t T = req.tokens(r);
    if (T <= min_tokens) continue;
    for (int64_t h = 0; h < H; ++h) {
      Part part{r, h, req.starts[r], T, req.history(r), T * G};
      parts.push_back(part);
      floats += part.rows * (3 * D + 2) + D * padded(T) + T * D;
      total_work += part.rows * (part.T / 2 + part.ctx);
    }
  }
  if (parts.empty()) return;
  const int threads = at::get_num_threads();
  const int64_t per_item = std::max<int64_t>(1, total_work / (3 * threads));
  std::vector<Chunk> chunks;
  for (size_t i = 0; i < parts.size(); ++i) {
    Part& part = parts[i];
    const int64_t pages = (part.ctx + bs - 1) / bs, groups = (pages + group_pages - 1) / group_pages;
    const int64_t want = threads == 1 ? 1 : (part.rows * part.ctx + per_item - 1) / per_item;
    part.first_chunk = static_cast<int64_t>(chunks.size());
    part.chunks = groups == 0 ? 0 : std::clamp<int64_t>(want, 1, groups);
    for (int64_t c = 0; c < part.chunks; ++c) {  // whole groups of pages per chunk
      const int64_t g0 = groups * c / part.chunks, g1 = groups * (c + 1) / part.chunks;
      chunks.push_back({static_cast<int64_t>(i), g0 * group_pages, std::min(g1 * group_pages, pages) - g0 * group_pages,
                        {}});
      floats += part.rows * (D + 2);
    }
  }
  float* next = workspace(kWorkAttention, floats);  // kept between calls: a fresh buffer of this size page-faults
  const auto take = [&](int64_t n) { float* at = next; next += n; return at; };
  for (Part& part : parts) {
    part.q = take(part.rows * D);
    part.q_rot = rotate_k && part.ctx > 0 ? take(part.rows * D) : part.q;
    part.k_own_t = take(D * padded(part.T));
    part.v_own = take(part.T * D);
    part.own = {take(part.rows), take(part.rows), take(part.rows * D)};
  }
  for (Chunk& c : chunks) {
    const int64_t rows = parts[c.part].rows;
    c.st = {take(rows), take(rows), take(rows * D)};
  }

  const auto run = [&](int64_t n, const auto& fn) {  // fn(item, thread); items listed largest first
    for_claimed(n, threads, [&](Claims& claims, int thread) {
      for (int64_t i; claims.take(i);) fn(i, thread);
    });
  };

  // 1. Per part: queries scaled (and rotated for the history), own keys transposed, own values as rows.
  run(static_cast<int64_t>(parts.size()), [&](int64_t i, int) {
    const Part& part = parts[i];
    for (int64_t t = 0; t < part.T; ++t) {
      for (int64_t g = 0; g < G; ++g) {
        float* row = part.q + (t * G + g) * D;
        to_float(q.at(part.qs + t, part.head * G + g), q.dtype, row, D);
        scale_row(row, scale, D);
      }
      to_float(v.at(part.qs + t, part.head), v.dtype, part.v_own + t * D, D);
    }
    const int64_t cols = padded(part.T);
    std::vector<float> row(D);
    for (int64_t t = 0; t < cols; ++t) {
      if (t < part.T) to_float(k.at(part.qs + t, part.head), k.dtype, row.data(), D);
      else std::fill(row.begin(), row.end(), 0.0f);
      for (int d = 0; d < D; ++d) part.k_own_t[d * cols + t] = row[d];
    }
    if (part.q_rot != part.q) gemm_qk(part.q, D, rkt.data(), D, D, part.rows, D, part.q_rot, D);
  });

  // 2. History chunks (largest first) and own-token tiles, claimed by threads: part by part (a part's own keys and
  // values stay in cache while its tiles run; interleaving parts re-read them from memory: 1.3x the time for three
  // requests in a call), latest first within a part (they see the most keys).
  struct Item { int64_t kind, index, first; };  // kind 0: a history chunk; 1: own tokens of parts[index] from `first`
  std::vector<Item> items;
  for (size_t c = 0; c < chunks.size(); ++c) items.push_back({0, static_cast<int64_t>(c), 0});
  const auto chunk_work = [&](const Item& item) {
    return parts[chunks[item.index].part].rows * chunks[item.index].count;
  };
  std::sort(items.begin(), items.end(), [&](const Item& a, const Item& b) { return chunk_work(a) > chunk_work(b); });
  std::vector<Item> own;
  for (size_t i = 0; i < parts.size(); ++i)
    for (int64_t t0 = 0; t0 < parts[i].T; t0 += own_tokens) own.push_back({1, static_cast<int64_t>(i), t0});
  std::sort(own.begin(), own.end(), [](const Item& a, const Item& b) {
    return a.index != b.index ? a.index < b.index : a.first > b.first;
  });
  items.insert(items.end(), own.begin(), own.end());
  uint8_t* base = cache.data_ptr<uint8_t>();
  const int64_t half = p.row_bytes();
  std::vector<std::vector<float>> scratch(threads);
  run(static_cast<int64_t>(items.size()), [&](int64_t it, int thread) {
    const Item& item = items[it];
    std::vector<float>& buf = scratch[thread];
    if (item.kind == 1) {  // own tokens [t0, t1) of a part against keys [0, t1), causal
      const Part& part = parts[item.index];
      const int64_t t0 = item.first, t1 = std::min(part.T, t0 + own_tokens), m = (t1 - t0) * G;
      const int64_t cols = padded(part.T), lds = padded(kOwnKeys);
      buf.resize(own_tokens * G * lds);
      const State st = part.own.rows(t0 * G, D);
      st.reset(m, D);
      for (int64_t k0 = 0; k0 < t1; k0 += kOwnKeys) {
        const int64_t n = std::min<int64_t>(kOwnKeys, t1 - k0);
        gemm_qk(part.q + t0 * G * D, D, part.k_own_t + k0, cols, D, m, round16(n), buf.data(), lds);
        if (k0 + n - 1 > t0)  // keys after some row's token: masked
          for (int64_t i = 0; i < m; ++i)
            for (int64_t j = std::max<int64_t>(0, t0 + i / G + 1 - k0); j < n; ++j) buf[i * lds + j] = kNegInf;
        softmax_step(buf.data(), lds, m, n, st, D);
        gemm_pv(buf.data(), lds, part.v_own + k0 * D, D, n, D, m, st.acc, D);
      }
      return;
    }
    // a history chunk: groups of pages decoded once, every row of the part against each group
    const Chunk& chunk = chunks[item.index];
    const Part& part = parts[chunk.part];
    buf.resize(D * group_cols + group_cols * D + kRowBlock * group_cols + 5 * D);
    float *kt = buf.data(), *vg = kt + D * group_cols, *sc = vg + group_cols * D, *lev = sc + kRowBlock * group_cols;
    float *raw = lev + D, *mean = raw + D, *mean_rot = mean + D;
    std::vector<int32_t> codes(D);
    std::fill(kt, kt + D * group_cols, 0.0f);  // columns past a group's keys stay finite (their scores are unused)
    chunk.st.reset(part.rows, D);
    for (int64_t g0 = chunk.first; g0 < chunk.first + chunk.count; g0 += group_pages) {
      int64_t n = 0;  // keys of this group
      for (int64_t pg = g0; pg < std::min(g0 + group_pages, chunk.first + chunk.count); ++pg) {
        const int64_t start = pg * bs, len = std::min(bs, part.ctx - start);
        const uint8_t* page = p.page(base, req.block(part.req, pg), part.head);
        bool centered = false;  // coded keys + m (rotated: R m), m the page before's raw key rows' mean
        for (int64_t j = 0; j < len; ++j, ++n) {
          float* vrow = vg + n * D;
          const int64_t at = p.read(pg, j, len, req.lens[part.req]);
          if (at >= 0) {
            to_float(page + p.raw_at(at), p.dtype, raw, D);
            if (rotate_k) row_times(raw, rkt.data(), D, lev);
            for (int d = 0; d < D; ++d) kt[d * group_cols + n] = rotate_k ? lev[d] : raw[d];
            to_float(page + p.raw_at(at) + half, p.dtype, raw, D);
            if (rotate_v) row_times(raw, rvt.data(), D, vrow);
            else std::memcpy(vrow, raw, sizeof(float) * D);
            continue;
          }
          if (p.center && !centered) {
            p.key_mean(p.page(base, req.block(part.req, std::max<int64_t>(pg - 1, 0)), part.head), mean, raw);
            if (rotate_k) row_times(mean, rkt.data(), D, mean_rot);
            else std::memcpy(mean_rot, mean, sizeof(float) * D);
            centered = true;
          }
          const uint8_t* slot = page + p.code_at(-1 - at);
          row_levels(ck, slot + p.k_code, 0, codes.data(), lev);
          const float ks = half_at(slot + p.k_scale), kz = ck.zero_classes ? half_at(slot + p.k_zero) : 0.0f;
          for (int d = 0; d < D; ++d) kt[d * group_cols + n] = lev[d] * ks + kz + (centered ? mean_rot[d] : 0.0f);
          row_levels(cv, slot + p.v_code, 0, codes.data(), vrow);
          const float vs = half_at(slot + p.v_scale), vz = cv.zero_classes ? half_at(slot + p.v_zero) : 0.0f;
          for (int d = 0; d < D; ++d) vrow[d] = vrow[d] * vs + vz;
        }
      }
      for (int64_t i0 = 0; i0 < part.rows; i0 += kRowBlock) {
        const int64_t m = std::min<int64_t>(kRowBlock, part.rows - i0);
        const State st = chunk.st.rows(i0, D);
        gemm_qk(part.q_rot + i0 * D, D, kt, group_cols, D, m, round16(n), sc, group_cols);
        softmax_step(sc, group_cols, m, n, st, D);
        gemm_pv(sc, group_cols, vg, D, n, D, m, st.acc, D);
      }
    }
  });

  // 3. Merge per row block: own + history chunks + sink, the history rotated back (R_v), normalized, written.
  std::vector<std::pair<int64_t, int64_t>> blocks;
  for (size_t i = 0; i < parts.size(); ++i)
    for (int64_t i0 = 0; i0 < parts[i].rows; i0 += kRowBlock) blocks.push_back({static_cast<int64_t>(i), i0});
  run(static_cast<int64_t>(blocks.size()), [&](int64_t b, int thread) {
    const Part& part = parts[blocks[b].first];
    const int64_t i0 = blocks[b].second, m = std::min<int64_t>(kRowBlock, part.rows - i0);
    std::vector<float>& buf = scratch[thread];
    buf.resize(2 * kRowBlock * D + kRowBlock);
    float *acc = buf.data(), *hist = acc + kRowBlock * D, *total = hist + kRowBlock * D;
    for (int64_t i = 0; i < m; ++i) {
      const int64_t row = i0 + i;
      float mx = part.own.mx[row];
      for (int64_t c = 0; c < part.chunks; ++c) mx = std::max(mx, chunks[part.first_chunk + c].st.mx[row]);
      if (sink != nullptr) mx = std::max(mx, sink[part.head * G + row % G]);
      const float w = exp_one(part.own.mx[row] - mx);
      total[i] = w * part.own.sum[row] + (sink != nullptr ? exp_one(sink[part.head * G + row % G] - mx) : 0.0f);
      for (int d = 0; d < D; ++d) acc[i * D + d] = w * part.own.acc[row * D + d];
      std::fill(hist + i * D, hist + (i + 1) * D, 0.0f);
      for (int64_t c = 0; c < part.chunks; ++c) {
        const State& st = chunks[part.first_chunk + c].st;
        const float wc = exp_one(st.mx[row] - mx);
        total[i] += wc * st.sum[row];
        axpy(hist + i * D, wc, st.acc + row * D, D);
      }
    }
    if (part.chunks > 0 && rotate_v) gemm_pv(hist, D, codecs.rot_v, D, D, D, m, acc, D);
    else if (part.chunks > 0)
      for (int64_t i = 0; i < m * D; ++i) acc[i] += hist[i];
    for (int64_t i = 0; i < m; ++i) {
      const int64_t row = i0 + i;
      scale_row(acc + i * D, 1.0f / total[i], D);
      from_float(acc + i * D, o.dtype, o.at(part.qs + row / G, part.head * G + row % G), D);
    }
  });
}

}  // namespace fc
