// flashcodec::codec_attention on the CPU when both streams store one row per token (block_size 1, one stored row:
// every lossy preset), flash-decoding on the packed codes (see ops/reference/attention.py for the spec).
//
// With the rotation applied to q once per call, an archived token's score is `scale_t * (q_rot . L[c_t])` (plus
// `zero_t * sum(q_rot)` for uniform levels and `q . mean` for centered keys) and its value contribution is
// `p_t * scale_t * L[c_t]` in the rotated space, rotated back once at the end. Work items are (batch, kv head, query
// tile, split): a tile holds up to kTileRows query rows (the GQA heads x query tokens of one kv head), which share
// every load of a code: the SIMD loops (token_simd.h) expand 8 codes at a time into levels held in a register and
// feed all of the tile's rows, so no per-token fp32 row is ever written. Scores are kept [row][position], so the
// online softmax runs along positions. A split walks its chunks of positions in order: key scores of a chunk from the
// key stream's own layout (sinks, archive, tail, the call's new tokens), one softmax step, then the value stream's
// positions with the same weights from its own layout. Splits are combined at the end (log-sum-exp).
//
// Threads: one parallel region per call at most (pool.h: the caller works too and never waits for a helper that has
// not started), and only when the call's work (stored positions x tiles) gives every thread at least
// kMinTokenWorkPerThread of it. Without AVX2 + FMA (or with simd=false) the archive's rows go through
// the portable path: codes unpacked and levels looked up into a row of D floats, then plain dot products.
//
// Variants (common.h's Variants) as in attention.cpp: the softcap and the ALiBi bias on a chunk's scores before the
// mask, the sink logits in the combine; a call without them runs none of that code.

namespace fc {

constexpr int kTileRows = 4;                  // query rows of a tile (the SIMD loops' accumulator registers)
constexpr int kTokenChunk = 256;              // positions per online-softmax step
constexpr int kTokenItemsPerThread = 4;       // work items per thread used
constexpr int64_t kMinTokenWorkPerThread = 16384;  // stored positions x tiles (~0.3 ms of 4-bit codes) per extra thread

// One call's queries and own tokens as the kernels read them: views with any strides along (B, H, N), rows
// contiguous. `out_factors`: (B, Hkv, D) fp32 channel factors the output is multiplied by as ATen would (a normalized
// value stream read in its stored domain, ops/reference/normalize.py), or null.
struct AttentionInput {
  Rows q, knew, vnew;
  int64_t B = 0, Hq = 0, Tq = 0, Hkv = 0, tn = 0;  // tn: the call's own tokens (0: none)
  int D = 0;
  const c10::optional<at::Tensor>* mask = nullptr;
  double scale = 1.0;
  bool simd = true;
  const float* out_factors = nullptr;
};

// A codec whose archive holds one row per token: block_size 1, one stored row, token-axis scales or unquantized.
inline bool per_token(const Codec& c) {
  return c.jpeg && c.r == 1 && c.rows == 1 && c.blocks == 1 && (c.quant == kNone || c.quant == kToken);
}

inline const char* row_codes_name(RowCodes k, int D) {
  switch (k) {
    case RowCodes::kRaw: return "raw";
    case RowCodes::kPortable: return "portable";
    default: return simd_loops(D);
  }
}

// Query rows of tile `tile` out of GT rows split into `tiles` balanced tiles.
struct Tiles {
  int64_t count, base, extra;
  Tiles(int64_t rows, int64_t n) : count(n), base(rows / n), extra(rows % n) {}
  int64_t first(int64_t tile) const { return tile * base + std::min(tile, extra); }
  int rows(int64_t tile) const { return static_cast<int>(base + (tile < extra ? 1 : 0)); }
};

// Partial state of one work item: running max, sum, archive mass (value center), zero-point mass (uniform values),
// value accumulators: raw rows (the model's space) and archive rows (the value codec's rotated space).
struct TokenPartial {
  float *mx, *l, *mass, *zmass, *acc, *accr;
  TokenPartial(float* base, int D) {
    mx = base; l = mx + kTileRows; mass = l + kTileRows; zmass = mass + kTileRows; acc = zmass + kTileRows;
    accr = acc + kTileRows * D;
  }
  static int64_t floats(int D) { return 4LL * kTileRows + 2LL * kTileRows * D; }
  void reset(int D) {
    std::fill(mx, mx + kTileRows, kNegInf);
    std::fill(l, l + 3 * kTileRows + 2 * kTileRows * D, 0.0f);
  }
};

// Per-thread scratch: scores / weights [row][position], scaled weights, the chunk's scales and zero points, the tile's
// queries (scaled; rotated into the key codec's space; their sums; their products with the key center), one row.
struct TokenScratch {
  float *scores, *weights, *sc, *zc, *qp, *qr, *qsum, *qmean, *row;
  int32_t* codes;
  TokenScratch(float* base, int D, bool rotated) {
    scores = base; weights = scores + kTileRows * kTokenChunk; sc = weights + kTileRows * kTokenChunk;
    zc = sc + kTokenChunk; qp = zc + kTokenChunk; qr = rotated ? qp + kTileRows * D : qp;
    qsum = qp + 2 * kTileRows * D; qmean = qsum + kTileRows; row = qmean + kTileRows;
    codes = reinterpret_cast<int32_t*>(row + D);
  }
  static int64_t floats(int D) {
    return 2LL * kTileRows * kTokenChunk + 2LL * kTokenChunk + 2LL * kTileRows * D + 2LL * kTileRows + 2LL * D;
  }
};

struct TokenAttention {
  int64_t B, Hq, Hkv, Tq, GT, tn;
  int D;
  const Stream* ks;
  const Stream* vs;
  RowCodes kcodes, vcodes;
  bool simd;  // the SIMD loops (softmax, scales) when compiled in and asked for
  Rows q, knew, vnew;
  bool has_mask;
  MaskView mask;
  float scale;
  Variants var;
  Tiles tiles{1, 1};
  int splits;
  int64_t n_chunks;
  float* part;  // items x TokenPartial::floats
  const float* out_factors;  // (B, Hkv, D) or null (AttentionInput)
};

// --- rows --------------------------------------------------------------------------------------------------------

// out[m * os + i] = q[m] . row_i for M query rows and n raw rows (stride bytes apart, dtype dt): up to 64 rows at a
// time, fp32 rows read in place, others converted into the executing thread's buffer.
inline void raw_dots(const float* q, int M, int D, const char* first, int64_t stride, at::ScalarType dt, int64_t n,
                     float* out, int64_t os, float*) {
  constexpr int64_t kBatch = 64;
  float* buf = dt == at::kFloat && stride % static_cast<int64_t>(sizeof(float)) == 0
                   ? nullptr : workspace(kWorkRawRows, kBatch * D);
  for (int64_t i0 = 0; i0 < n; i0 += kBatch) {
    const int nb = static_cast<int>(std::min(kBatch, n - i0));
    const float* rows;
    int64_t rs;
    if (buf == nullptr) {
      rows = reinterpret_cast<const float*>(first + i0 * stride);
      rs = stride / static_cast<int64_t>(sizeof(float));
    } else {
      for (int i = 0; i < nb; ++i) to_float(first + (i0 + i) * stride, dt, buf + i * D, D);
      rows = buf;
      rs = D;
    }
    for (int m = 0; m < M; ++m) dots(rows, rs, q + m * D, D, nb, out + m * os + i0, 1);
  }
}

// acc[m] += w[m * ws + i] * row_i for M query rows and n raw rows.
inline void raw_axpys(const float* w, int64_t ws, int M, int D, const char* first, int64_t stride, at::ScalarType dt,
                      int64_t n, float* acc, float* buf) {
  for (int64_t i = 0; i < n; ++i) {
    const float* row = float_row(first + i * stride, dt, buf, D);
    for (int m = 0; m < M; ++m) axpy(acc + m * D, w[m * ws + i], row, D);
  }
}

// The unscaled row of archived token g of (b, h): its levels (portable path) or its stream-dtype values.
inline const float* archive_row(const Stream& s, int64_t b, int64_t h, int64_t g, TokenScratch& w) {
  const Codec& c = *s.c;
  const char* src = s.data.at(b, h, g);
  if (c.quant == kNone) return float_row(src, s.data_dtype, w.row, c.head_dim);
  row_levels(c, reinterpret_cast<const uint8_t*>(src), 0, w.codes, w.row);
  return w.row;
}

// The token scales and zero points of archived tokens g0 .. g0 + n - 1 into w.sc / w.zc (1 and 0 when unquantized).
inline void archive_scales(const Stream& s, int64_t b, int64_t h, int64_t g0, int64_t n, bool simd, TokenScratch& w) {
  const Codec& c = *s.c;
  if (c.quant == kNone) {
    std::fill(w.sc, w.sc + n, 1.0f);
    std::fill(w.zc, w.zc + n, 0.0f);
    return;
  }
  const at::Half* sc = s.scale.at(b, h, g0);
  const at::Half* zr = s.zero.at(b, h, g0);
#ifdef FC_TOKEN_AVX2
  if (simd && s.scale.sn == 1) {
    avx2::halves(sc, n, w.sc);
  } else {
    for (int64_t i = 0; i < n; ++i) w.sc[i] = static_cast<float>(sc[i * s.scale.sn]);
  }
#else
  (void)simd;
  for (int64_t i = 0; i < n; ++i) w.sc[i] = static_cast<float>(sc[i * s.scale.sn]);
#endif
  if (c.zero_classes) {
    for (int64_t i = 0; i < n; ++i) w.zc[i] = static_cast<float>(zr[i * s.zero.sn]);
  } else {
    std::fill(w.zc, w.zc + n, 0.0f);
  }
}

// --- keys --------------------------------------------------------------------------------------------------------

// Scores of archived positions [a0, a1) into out[m * kTokenChunk + (p - a0)]: scale * (q_rot . levels) +
// zero * sum(q_rot) + q . mean.
void token_key_archive(const TokenAttention& A, int64_t b, int64_t h, int M, int64_t a0, int64_t a1, float* out,
                       TokenScratch& w) {
  const Stream& s = *A.ks;
  const Codec& c = *s.c;
  const int D = A.D;
  const int64_t g0 = a0 - c.sinks, n = a1 - a0;
  if (A.kcodes == RowCodes::kRaw || A.kcodes == RowCodes::kPortable) {
    for (int64_t i = 0; i < n; ++i) {
      const float* row = archive_row(s, b, h, g0 + i, w);
      for (int m = 0; m < M; ++m) out[m * kTokenChunk + i] = dot(w.qr + m * D, row, D);
    }
  } else {
#ifdef FC_TOKEN_AVX2
    code_scores(A.kcodes, c, M, w.qr, D, reinterpret_cast<const uint8_t*>(s.data.at(b, h, g0)), s.data.sn, n, out,
                kTokenChunk);
#endif
  }
  archive_scales(s, b, h, g0, n, A.simd, w);
  for (int m = 0; m < M; ++m) {
    float* o = out + m * kTokenChunk;
    const float zq = w.qsum[m], base = w.qmean[m];
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) o[i] = std::fma(o[i], w.sc[i], std::fma(w.zc[i], zq, base));
  }
}

// The softcap, then the ALiBi bias of positions [p0, p1) on the scores [row][position] of the M rows from row0.
void token_logit_variants(const TokenAttention& A, int64_t h, int64_t row0, int M, int64_t p0, int64_t p1,
                          float* scores) {
  const int n = static_cast<int>(p1 - p0);
  const int64_t gq = A.Hq / A.Hkv;
  for (int m = 0; m < M; ++m) {
    float* s = scores + m * kTokenChunk;
    if (A.var.softcap > 0.0f) softcap_row(s, n, A.var.softcap);
    if (A.var.alibi != nullptr) {
      const float slope = A.var.alibi[h * gq + (row0 + m) / A.Tq];
#pragma omp simd
      for (int i = 0; i < n; ++i) s[i] += slope * static_cast<float>(p0 + i);
    }
  }
}

// Key scores of positions [p0, p1) into w.scores[m][p - p0]: the variants, then the mask bias; -inf where no slot
// holds a position.
void token_keys(const TokenAttention& A, int64_t b, int64_t h, int64_t row0, int M, int64_t p0, int64_t p1,
                TokenScratch& w) {
  const Stream& s = *A.ks;
  const Codec& c = *s.c;
  const int D = A.D;
  const int64_t L = s.length, se = L - A.tn, start = s.start, cap = c.sinks + s.groups;
  for (int m = 0; m < M; ++m) std::fill(w.scores + m * kTokenChunk, w.scores + m * kTokenChunk + (p1 - p0), kNegInf);
  const int64_t s1 = std::min<int64_t>(p1, std::min<int64_t>(c.sinks, se));
  if (p0 < s1) raw_dots(w.qp, M, D, s.sink.at(b, h, p0), s.sink.sn, s.dtype, s1 - p0, w.scores, kTokenChunk, w.row);
  const int64_t a0 = std::max<int64_t>(p0, c.sinks), a1 = std::min({p1, start, se, cap});
  if (a0 < a1) token_key_archive(A, b, h, M, a0, a1, w.scores + (a0 - p0), w);
  const int64_t t0 = std::max(p0, start), t1 = std::min({p1, se, start + c.tail_cap});
  if (t0 < t1)
    raw_dots(w.qp, M, D, s.tail.at(b, h, t0 - start), s.tail.sn, s.dtype, t1 - t0, w.scores + (t0 - p0), kTokenChunk,
             w.row);
  const int64_t n0 = std::max(p0, se), n1 = std::min(p1, L);
  if (n0 < n1)
    raw_dots(w.qp, M, D, A.knew.at(b, h, n0 - se), A.knew.sn, A.knew.dtype, n1 - n0, w.scores + (n0 - p0),
             kTokenChunk, w.row);
  if (A.var.logits()) token_logit_variants(A, h, row0, M, p0, p1, w.scores);
  if (A.has_mask) {
    const int64_t gq = A.Hq / A.Hkv;
    for (int m = 0; m < M; ++m) {
      const int64_t row = row0 + m;
      A.mask.apply(b, h * gq + row / A.Tq, row % A.Tq, p0, static_cast<int>(p1 - p0), w.scores + m * kTokenChunk, 1);
    }
  }
}

// --- softmax -----------------------------------------------------------------------------------------------------

// One online-softmax step over n positions: scores -> exp(scores - new max) in place; the running state rescaled.
inline void token_softmax(float* scores, int64_t n, int M, int D, bool simd, const TokenPartial& p) {
  for (int m = 0; m < M; ++m) {
    float* s = scores + m * kTokenChunk;
    float mx = p.mx[m], total = 0.0f;
#ifdef FC_TOKEN_AVX2
    if (simd) mx = avx2::row_max(s, n, mx);
#else
    (void)simd;
#endif
    if (!simd)
      for (int64_t i = 0; i < n; ++i) mx = std::max(mx, s[i]);
    const float shift = mx == kNegInf ? 0.0f : mx;  // a row that has seen nothing keeps zero weights
    const float alpha = p.mx[m] == kNegInf ? 0.0f : exp_one(p.mx[m] - shift);
#ifdef FC_TOKEN_AVX2
    if (simd) total = avx2::exp_sum(s, n, shift);
#endif
    if (!simd) {
      for (int64_t i = 0; i < n; ++i) s[i] -= shift;
      exp_row(s, s, static_cast<int>(n));
      for (int64_t i = 0; i < n; ++i) total += s[i];
    }
    if (alpha != 1.0f) {
      scale_row(p.acc + m * D, alpha, D);
      scale_row(p.accr + m * D, alpha, D);
      p.mass[m] *= alpha;
      p.zmass[m] *= alpha;
    }
    p.l[m] = p.l[m] * alpha + total;
    p.mx[m] = mx;
  }
}

// --- values ------------------------------------------------------------------------------------------------------

// Archived positions [a0, a1) of the value stream with weights e[m * kTokenChunk + (p - a0)]: accr += (e * scale) *
// levels, mass += e (centered values), zmass += e * zero (uniform levels).
void token_value_archive(const TokenAttention& A, int64_t b, int64_t h, int M, int64_t a0, int64_t a1, const float* e,
                         const TokenPartial& p, TokenScratch& w) {
  const Stream& s = *A.vs;
  const Codec& c = *s.c;
  const int D = A.D;
  const int64_t g0 = a0 - c.sinks, n = a1 - a0;
  archive_scales(s, b, h, g0, n, A.simd, w);
  for (int m = 0; m < M; ++m) {
    const float* em = e + m * kTokenChunk;
    float* wm = w.weights + m * kTokenChunk;
    float mass = 0.0f, zmass = 0.0f;
#pragma omp simd reduction(+ : mass, zmass)
    for (int64_t i = 0; i < n; ++i) {
      wm[i] = em[i] * w.sc[i];
      mass += em[i];
      zmass += em[i] * w.zc[i];
    }
    if (c.center) p.mass[m] += mass;
    if (c.quant == kToken && c.zero_classes) p.zmass[m] += zmass;
  }
  if (A.vcodes == RowCodes::kRaw || A.vcodes == RowCodes::kPortable) {
    for (int64_t i = 0; i < n; ++i) {
      const float* row = archive_row(s, b, h, g0 + i, w);
      for (int m = 0; m < M; ++m) axpy(p.accr + m * D, w.weights[m * kTokenChunk + i], row, D);
    }
    return;
  }
#ifdef FC_TOKEN_AVX2
  code_values(A.vcodes, c, M, w.weights, kTokenChunk, D, reinterpret_cast<const uint8_t*>(s.data.at(b, h, g0)),
              s.data.sn, n, p.accr);
#endif
}

// Values of positions [p0, p1) with the weights in w.scores.
void token_values(const TokenAttention& A, int64_t b, int64_t h, int M, int64_t p0, int64_t p1, const TokenPartial& p,
                  TokenScratch& w) {
  const Stream& s = *A.vs;
  const Codec& c = *s.c;
  const int D = A.D;
  const int64_t L = s.length, se = L - A.tn, start = s.start, cap = c.sinks + s.groups;
  p1 = std::min(p1, L);
  const float* e = w.scores;
  const int64_t s1 = std::min<int64_t>(p1, std::min<int64_t>(c.sinks, se));
  if (p0 < s1) raw_axpys(e, kTokenChunk, M, D, s.sink.at(b, h, p0), s.sink.sn, s.dtype, s1 - p0, p.acc, w.row);
  const int64_t a0 = std::max<int64_t>(p0, c.sinks), a1 = std::min({p1, start, se, cap});
  if (a0 < a1) token_value_archive(A, b, h, M, a0, a1, e + (a0 - p0), p, w);
  const int64_t t0 = std::max(p0, start), t1 = std::min({p1, se, start + c.tail_cap});
  if (t0 < t1)
    raw_axpys(e + (t0 - p0), kTokenChunk, M, D, s.tail.at(b, h, t0 - start), s.tail.sn, s.dtype, t1 - t0, p.acc, w.row);
  const int64_t n0 = std::max(p0, se), n1 = p1;
  if (n0 < n1)
    raw_axpys(e + (n0 - p0), kTokenChunk, M, D, A.vnew.at(b, h, n0 - se), A.vnew.sn, A.vnew.dtype, n1 - n0, p.acc,
              w.row);
}

// --- driver ------------------------------------------------------------------------------------------------------

// The M query rows from row0 of kv head (b, h) into w: scaled, rotated into the key codec's space, their sums (key
// zero points) and their products with the key center.
void token_queries(const TokenAttention& A, int64_t b, int64_t h, int64_t row0, int M, TokenScratch& w) {
  const Codec& c = *A.ks->c;
  const int D = A.D;
  const int64_t gq = A.Hq / A.Hkv;
  for (int m = 0; m < M; ++m) {
    const int64_t row = row0 + m;
    float* qp = w.qp + m * D;
    to_float(A.q.at(b, h * gq + row / A.Tq, row % A.Tq), A.q.dtype, qp, D);
    scale_row(qp, A.scale, D);
    if (c.rotate) rotate_query(c, qp, D, w.qr + m * D);  // q_rot = R @ q
    float qsum = 0.0f;
    for (int d = 0; d < D; ++d) qsum += w.qr[m * D + d];
    w.qsum[m] = c.quant == kToken && c.zero_classes ? qsum : 0.0f;
    w.qmean[m] = c.center ? dot(qp, A.ks->mean.at(b, h), D) : 0.0f;
  }
}

void token_item(const TokenAttention& A, int64_t item, TokenScratch& w, int64_t& prepared) {
  const int64_t split = item % A.splits, it = item / A.splits;
  const int64_t bh = it / A.tiles.count, tile = it % A.tiles.count, b = bh / A.Hkv, h = bh % A.Hkv;
  const int64_t row0 = A.tiles.first(tile);
  const int M = A.tiles.rows(tile);
  if (it != prepared) {
    token_queries(A, b, h, row0, M, w);
    prepared = it;
  }
  TokenPartial p(A.part + item * TokenPartial::floats(A.D), A.D);
  p.reset(A.D);
  const int64_t c0 = A.n_chunks * split / A.splits, c1 = A.n_chunks * (split + 1) / A.splits;
  for (int64_t ch = c0; ch < c1; ++ch) {
    const int64_t p0 = ch * kTokenChunk, p1 = std::min<int64_t>(A.ks->length, p0 + kTokenChunk);
    token_keys(A, b, h, row0, M, p0, p1, w);
    token_softmax(w.scores, p1 - p0, M, A.D, A.simd, p);
    token_values(A, b, h, M, p0, p1, p, w);
  }
}

void token_combine(const TokenAttention& A, at::Tensor& out) {
  const Codec& c = *A.vs->c;
  const int D = A.D;
  char* optr = static_cast<char*>(out.data_ptr());
  const int64_t osb = out.stride(0) * out.element_size(), osh = out.stride(1) * out.element_size(),
                ost = out.stride(2) * out.element_size();
  const int64_t gq = A.Hq / A.Hkv;
  float* rows = workspace(kWorkRows, 3LL * D);
  float *acc = rows, *accr = rows + D, *o = rows + 2 * D;
  for (int64_t it = 0; it < A.B * A.Hkv * A.tiles.count; ++it) {
    const int64_t bh = it / A.tiles.count, tile = it % A.tiles.count, b = bh / A.Hkv, h = bh % A.Hkv;
    for (int m = 0; m < A.tiles.rows(tile); ++m) {
      const int64_t row = A.tiles.first(tile) + m;
      float top = kNegInf;
      for (int s = 0; s < A.splits; ++s)
        top = std::max(top, TokenPartial(A.part + (it * A.splits + s) * TokenPartial::floats(D), D).mx[m]);
      const float sink = A.var.sinks == nullptr ? kNegInf : A.var.sinks[h * gq + row / A.Tq];
      const float peak = std::max(top, sink);  // the sink logit joins the row's max and its denominator
      std::fill(acc, acc + D, 0.0f);
      std::fill(accr, accr + D, 0.0f);
      float l = 0.0f, mass = 0.0f, zmass = 0.0f;
      if (top != kNegInf)
        for (int s = 0; s < A.splits; ++s) {
          TokenPartial p(A.part + (it * A.splits + s) * TokenPartial::floats(D), D);
          if (p.mx[m] == kNegInf) continue;
          const float wgt = exp_one(p.mx[m] - peak);
          l += wgt * p.l[m];
          mass += wgt * p.mass[m];
          zmass += wgt * p.zmass[m];
          axpy(acc, wgt, p.acc + m * D, D);
          axpy(accr, wgt, p.accr + m * D, D);
        }
      if (sink != kNegInf) l += exp_one(sink - peak);
      if (!(l > 0.0f)) {
        std::fill(o, o + D, 0.0f);
      } else {
        for (int e = 0; e < D; ++e) accr[e] += zmass;
        std::copy(acc, acc + D, o);
        if (c.rotate) {  // out += acc_rot @ R (back from the rotated space)
          rotate_back(o, accr, c.rot, D);
        } else {
          axpy(o, 1.0f, accr, D);
        }
        if (c.center) axpy(o, mass, A.vs->mean.at(b, h), D);
        scale_row(o, 1.0f / l, D);
      }
      store_output(o, out.scalar_type(), optr + b * osb + (h * gq + row / A.Tq) * osh + (row % A.Tq) * ost, D,
                   A.out_factors == nullptr ? nullptr : A.out_factors + (b * A.Hkv + h) * D);
    }
  }
}

// Work layout from the shapes and the thread count only (the workspace never depends on the length).
struct TokenLayout {
  int64_t tiles, max_splits, threads, part_floats, scratch_floats;
  int64_t total() const { return part_floats + scratch_floats * threads; }
};

TokenLayout token_layout(int64_t B, int64_t Hkv, int64_t GT, int D, int64_t threads) {
  TokenLayout lay;
  lay.tiles = (GT + kTileRows - 1) / kTileRows;
  const int64_t bht = B * Hkv * lay.tiles;
  lay.max_splits = std::max<int64_t>(1, (kTokenItemsPerThread * threads + bht - 1) / bht);
  lay.threads = threads;
  lay.part_floats = bht * lay.max_splits * TokenPartial::floats(D);
  lay.scratch_floats = TokenScratch::floats(D);
  return lay;
}

// The call's queries (B, Hq, T, D) over streams of Hkv heads, into out (B, Hq, T, D).
void token_codec_attention(const AttentionInput& in, const Stream& ks, const Stream& vs, const Variants& var,
                           at::Tensor& out) {
  TokenAttention A;
  A.B = in.B; A.Hq = in.Hq; A.Tq = in.Tq; A.D = in.D;
  A.Hkv = in.Hkv;
  A.GT = (A.Hq / A.Hkv) * A.Tq;
  A.tn = in.tn;
  A.ks = &ks; A.vs = &vs;
  A.kcodes = row_codes(*ks.c, in.simd); A.vcodes = row_codes(*vs.c, in.simd);
  A.simd = in.simd && std::strcmp(simd_isa(), "portable") != 0;
  A.q = in.q;
  A.knew = in.knew; A.vnew = in.vnew;
  A.has_mask = in.mask != nullptr && in.mask->has_value();
  if (A.has_mask) A.mask = MaskView(**in.mask);
  A.scale = static_cast<float>(in.scale);
  A.var = var;
  A.out_factors = in.out_factors;
  const int64_t threads = at::get_num_threads();
  const TokenLayout lay = token_layout(A.B, A.Hkv, A.GT, A.D, threads);
  A.tiles = Tiles(A.GT, lay.tiles);
  const int64_t bht = A.B * A.Hkv * lay.tiles, L = ks.length;
  A.n_chunks = (L + kTokenChunk - 1) / kTokenChunk;
  const int64_t use = threads_for(bht * L, kMinTokenWorkPerThread);
  A.splits = static_cast<int>(use == 1 ? 1
                                       : std::clamp<int64_t>((kTokenItemsPerThread * use + bht - 1) / bht, 1,
                                                             std::min(lay.max_splits, std::max<int64_t>(A.n_chunks, 1))));
  A.part = workspace(kWorkAttention, lay.total());
  float* scratch = A.part + lay.part_floats;
  const int64_t items = bht * A.splits;
  const bool rotated = ks.c->rotate;
  std::vector<int64_t>& prepared = prepared_tiles(use);  // per slot: the tile whose queries its scratch holds
  Pool::get().run(items, static_cast<int>(use - 1), [&](int64_t item, int slot) {
    TokenScratch w(scratch + slot * lay.scratch_floats, A.D, rotated);
    token_item(A, item, w, prepared[slot]);
  });
  token_combine(A, out);
}

}  // namespace fc
