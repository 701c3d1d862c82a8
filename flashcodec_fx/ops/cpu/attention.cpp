// flashcodec::codec_attention on the CPU: flash-decoding over the stored form (spec: ops/reference/attention.py).
//
// Work items are (batch, kv head, query tile, split), run by pool.h's fork-join (one region per call, only when the
// work gives each thread kMinWorkPerThread). A tile holds up to kLanes query rows (the GQA heads x tokens
// of one kv head) side by side in SIMD lanes, so every loaded block serves all of them and no dot product needs a
// horizontal reduction: scores are stored [position][lane]. A split walks its chunks of positions in order; for a
// chunk, key scores of every position come from the key stream's own layout (sinks, archive blocks, tail, the call's
// new tokens), then one online-softmax step updates the running max and sum, then the value stream adds its
// positions with the same weights from its own layout, so keys and values may archive at different positions.
// Archive blocks are never dequantized into a copy of the archive: a block's rows are unpacked into an L1 scratch of
// `dense x D` unscaled levels; token-axis scales multiply the (row, query) dot products, channel-axis scales are
// folded into the query once per scale group (keys) or into per-group accumulators (values). Scores go through the
// synthesis matrix (`coef @ A^T`), probabilities back (`p @ A`). The query is rotated once per call and the archive's
// value accumulator rotated back once at the end; the centers enter as q.mean and mass * mean. The splits' partial
// results are combined at the end (log-sum-exp). Everything is fp32.
//
// Variants (common.h's Variants, each off unless asked for): the softcap and the ALiBi bias change a chunk's scores
// once they are all written, before the mask (logit_variants); the sink logits join each row's max and denominator
// in the combine. A call without them runs none of that code.

namespace fc {

constexpr int kChunk = 256;      // positions per chunk (rounded up to a multiple of the key codec's group)
constexpr int kItemsPerThread = 8;
constexpr int64_t kMinWorkPerThread = 8192;  // stored positions x tiles per extra thread (~0.5 ms of int8 blocks)
constexpr int kRawBatch = 64;    // raw rows converted at a time (sinks, tail, new tokens)

// Per-thread scratch (floats), sized from the shapes only.
struct Scratch {
  float *scores, *kblk, *vblk, *coef, *pc, *qs, *zq, *cacc, *cz, *raw, *sf;
  int32_t* codes;

  static int64_t floats(int lds, int D) {
    return static_cast<int64_t>(lds) * kLanes + 2LL * kMaxRows * D + 2LL * kMaxRows * kLanes + 2LL * D * kLanes +
           2LL * kLanes + 2LL * kLanes * D + 2LL * kLanes + static_cast<int64_t>(kRawBatch) * D + 2LL * D + D;
  }
  Scratch(float* base, int lds, int D) {
    scores = base; base += lds * kLanes;
    kblk = base; base += kMaxRows * D;
    vblk = base; base += kMaxRows * D;
    coef = base; base += kMaxRows * kLanes;
    pc = base; base += kMaxRows * kLanes;
    qs = base; base += 2 * D * kLanes;
    zq = base; base += 2 * kLanes;
    cacc = base; base += 2 * kLanes * D;
    cz = base; base += 2 * kLanes;
    raw = base; base += kRawBatch * D;
    sf = base; base += 2 * D;
    codes = reinterpret_cast<int32_t*>(base);
  }
};

// The queries of one tile: transposed (D x kLanes), plain and rotated into the key codec's space.
struct TileQueries {
  float *qp, *qr, *qsum, *qmean;
  TileQueries(float* base, int D, bool rotated) {
    qp = base; qr = rotated ? base + D * kLanes : qp; qsum = base + 2 * D * kLanes; qmean = qsum + kLanes;
  }
  static int64_t floats(int D) { return 2LL * D * kLanes + 2LL * kLanes; }
};

// Partial state of one work item: running max, sum, archive mass, value accumulators (plain and rotated).
struct Partial {
  float *mx, *l, *mass, *acc, *accr;
  Partial(float* base, int D, bool separate_rot) {
    mx = base; l = base + kLanes; mass = base + 2 * kLanes; acc = base + 3 * kLanes;
    accr = separate_rot ? acc + kLanes * D : acc;
  }
  static int64_t floats(int D) { return 3LL * kLanes + 2LL * kLanes * D; }
};

struct Attention {
  int64_t B, Hq, Hkv, Tq, GT, tn;
  int D;
  const Stream* ks;
  const Stream* vs;
  Rows q, knew, vnew;
  bool has_mask;
  MaskView mask;
  float scale;
  Variants var;
  int tiles, splits, chunk, lds;
  int64_t n_chunks;
  float* part;     // items x Partial::floats
  at::ScalarType out_dtype;
  const float* out_factors;  // (B, Hkv, D) or null (AttentionInput)

  int64_t chunk_begin(int64_t c) const { return c == 0 ? 0 : ks->c->sinks + c * chunk; }
  int64_t chunk_end(int64_t c) const { return std::min<int64_t>(ks->length, ks->c->sinks + (c + 1) * chunk); }
};

// --- stored rows of one archive block ----------------------------------------------------------------------------

// Dense unscaled rows (dense x D) of block `nb` of stream s: levels of the codes, raw coefficients, or png rows.
inline const float* block_rows(const Stream& s, int64_t b, int64_t h, int64_t nb, float* out, int32_t* codes) {
  const Codec& c = *s.c;
  const int D = c.head_dim;
  const int64_t g = nb / c.blocks, blk = nb % c.blocks;
  if (c.quant != kNone) {
    const uint8_t* block = reinterpret_cast<const uint8_t*>(s.data.at(b, h, g)) + blk * c.row_bytes;
    if (c.bytes8) {
      for (int j = 0; j < c.rows; ++j) {
        const float off = c.level_off[j];
        const uint8_t* src = block + j * D;
        float* dst = out + j * D;
#pragma omp simd
        for (int d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]) + off;
      }
      return out;
    }
    for (int j = 0; j < c.rows; ++j) row_levels(c, block, j, codes, out + j * D);
    return out;
  }
  const char* rows = s.data.at(b, h, nb);
  if (c.jpeg) return float_row(rows, s.data_dtype, out, c.rows * D);
  const float* png = reinterpret_cast<const float*>(rows);
  if (!c.pruned) return png;
  std::memcpy(out, png, sizeof(float) * D);
  std::fill(out + D, out + c.r * D, 0.0f);
  const uint8_t* idx = s.index.at(b, h, nb);
  for (int i = 0; i < c.pruned; ++i)
    for (int d = 0; d < D; ++d) out[(1 + idx[i * D + d]) * D + d] = png[(1 + i) * D + d];
  return out;
}

// Dense rows of blocks first .. first + count - 1 side by side ((count * dense) x D): the stored rows themselves when
// they are fp32 and adjacent, else unpacked or converted into buf.
inline const float* batch_rows(const Stream& s, int64_t b, int64_t h, int64_t first, int count, float* buf,
                               int32_t* codes) {
  const int64_t rd = static_cast<int64_t>(s.c->dense) * s.c->head_dim;
  const float* one = block_rows(s, b, h, first, buf, codes);
  if (one != buf && (count == 1 || s.data.sn == rd * static_cast<int64_t>(sizeof(float)))) return one;
  if (one != buf) std::memcpy(buf, one, sizeof(float) * rd);
  for (int n = 1; n < count; ++n) {
    const float* src = block_rows(s, b, h, first + n, buf + n * rd, codes);
    if (src != buf + n * rd) std::memcpy(buf + n * rd, src, sizeof(float) * rd);
  }
  return buf;
}

inline float half_at(const at::Half* p, int64_t i) { return static_cast<float>(p[i]); }

// Raw rows as fp32 with their stride in floats: the rows themselves when fp32, else converted into buf.
inline const float* raw_batch(const char* first, int64_t stride, at::ScalarType dt, int64_t i0, int n, int D,
                              float* buf, int64_t& row_stride) {
  if (dt == at::kFloat && stride % static_cast<int64_t>(sizeof(float)) == 0) {
    row_stride = stride / static_cast<int64_t>(sizeof(float));
    return reinterpret_cast<const float*>(first + i0 * stride);
  }
  for (int i = 0; i < n; ++i) to_float(first + (i0 + i) * stride, dt, buf + i * D, D);
  row_stride = D;
  return buf;
}

// --- keys --------------------------------------------------------------------------------------------------------

// scores[p][:] = q . row_p for n raw rows starting at `first` (stride bytes).
inline void raw_scores(const float* qt, int D, const char* first, int64_t stride, at::ScalarType dt, int64_t n,
                       float* scores, float* buf) {
  for (int64_t i0 = 0; i0 < n; i0 += kRawBatch) {
    const int nb = static_cast<int>(std::min<int64_t>(kRawBatch, n - i0));
    int64_t rs;
    const float* rows = raw_batch(first, stride, dt, i0, nb, D, buf, rs);
    lane_dots_n(qt, rows, rs, nb, D, scores + i0 * kLanes);
  }
}

// Channel-axis keys: fold the per-channel scales of group g into the query (qs[class]), the zero points into zq.
inline void fold_key_group(const Stream& s, int64_t b, int64_t h, int64_t g, const float* qr, Scratch& w) {
  const Codec& c = *s.c;
  const int D = c.head_dim;
  const at::Half* sc = s.scale.at(b, h, g);
  const at::Half* zr = s.zero.at(b, h, g);
  for (int k = 0; k < c.classes; ++k) {
    float* qs = w.qs + k * D * kLanes;
    for (int d = 0; d < D; ++d) {
      const float sd = half_at(sc, k * D + d);
#pragma omp simd
      for (int l = 0; l < kLanes; ++l) qs[d * kLanes + l] = qr[d * kLanes + l] * sd;
    }
    float* zq = w.zq + k * kLanes;
    for (int l = 0; l < kLanes; ++l) zq[l] = 0.0f;
    const int slot = c.class_zero[k];
    if (slot >= 0)
      for (int d = 0; d < D; ++d) {
        const float zd = half_at(zr, slot * D + d);
#pragma omp simd
        for (int l = 0; l < kLanes; ++l) zq[l] += qr[d * kLanes + l] * zd;
      }
  }
}

constexpr int kBatchRows = 64;  // stored rows unpacked per batch (8 blocks of 8 rows: 16 KiB of fp32 at D=64)

// Blocks nb0..nb1 in batches of at most kBatchRows stored rows, never across a scale group (channel axis).
template <typename F>
inline void for_block_batches(const Codec& c, int64_t nb0, int64_t nb1, F&& fn) {
  const int64_t per = std::max<int64_t>(1, kBatchRows / c.dense);
  for (int64_t first = nb0; first <= nb1;) {
    int64_t last = std::min<int64_t>(nb1, first + per - 1);
    if (c.quant == kChannel) last = std::min<int64_t>(last, (first / c.blocks + 1) * c.blocks - 1);
    fn(first, static_cast<int>(last - first + 1));
    first = last + 1;
  }
}

// Scores of archive positions [a0, a1) (whole blocks of the key stream), written at scores[p - p0][:].
void key_archive(const Attention& A, const Stream& s, int64_t b, int64_t h, const TileQueries& tq, int64_t a0,
                 int64_t a1, int64_t p0, Scratch& w) {
  const Codec& c = *s.c;
  const int D = A.D, R = c.dense, r = c.r;
  const int64_t nb0 = (a0 - c.sinks) / r, nb1 = (a1 - 1 - c.sinks) / r;
  int64_t group = -1;
  float base[kLanes];
  for (int l = 0; l < kLanes; ++l) base[l] = c.center ? tq.qmean[l] : 0.0f;
  for_block_batches(c, nb0, nb1, [&](int64_t first, int count) {
    const int64_t g = first / c.blocks;
    if (c.quant == kChannel && g != group) {
      fold_key_group(s, b, h, g, tq.qr, w);
      group = g;
    }
    float* coef = w.coef;  // (count * R) x kLanes
    if (c.quant == kChannel) {
      for (int n = 0; n < count; ++n) {
        const float* rows = block_rows(s, b, h, first + n, w.kblk, w.codes);
        for (int k = 0; k < c.classes; ++k) {
          const int f = c.class_first[k], nr = c.class_last[k] - f + 1;
          float* cf = coef + (n * R + f) * kLanes;
          lane_dots_n(w.qs + k * D * kLanes, rows + f * D, D, nr, D, cf);
          const float* zq = w.zq + k * kLanes;
          for (int j = 0; j < nr; ++j)
#pragma omp simd
            for (int l = 0; l < kLanes; ++l) cf[j * kLanes + l] += zq[l];
        }
      }
    } else {
      const float* rows = batch_rows(s, b, h, first, count, w.kblk, w.codes);
      lane_dots_n(tq.qr, rows, D, count * R, D, coef);
      if (c.quant == kToken)
        for (int n = 0; n < count; ++n) {
          const int64_t nb = first + n, gn = nb / c.blocks, blk = nb % c.blocks;
          const at::Half* sc = s.scale.at(b, h, gn) + blk * c.classes;
          const at::Half* zr = s.zero.at(b, h, gn) + blk * c.zero_classes;
          for (int j = 0; j < R; ++j) {
            const int k = c.row_class[j], slot = c.class_zero[k];
            const float sj = half_at(sc, k), zj = slot >= 0 ? half_at(zr, slot) : 0.0f;
            float* cf = coef + (n * R + j) * kLanes;
#pragma omp simd
            for (int l = 0; l < kLanes; ++l) cf[l] = cf[l] * sj + zj * tq.qsum[l];
          }
        }
    }
    for (int n = 0; n < count; ++n) {
      const int64_t pb = c.sinks + (first + n) * r;
      const int i0 = static_cast<int>(std::max<int64_t>(a0 - pb, 0));
      const int i1 = static_cast<int>(std::min<int64_t>(a1 - pb, r));
      float* out = w.scores + (pb - p0) * kLanes;
      const float* cb = coef + n * R * kLanes;
      if (!c.jpeg) {
        float run[kLanes];
        for (int l = 0; l < kLanes; ++l) run[l] = base[l];
        for (int i = 0; i < i1; ++i) {
#pragma omp simd
          for (int l = 0; l < kLanes; ++l) run[l] += cb[i * kLanes + l];
          if (i >= i0)
            for (int l = 0; l < kLanes; ++l) out[i * kLanes + l] = run[l];
        }
      } else {
        lane_matmul(c.synth + i0 * R, R, 1, cb, i1 - i0, R, base, out + i0 * kLanes);
      }
    }
  });
}

// The softcap, then the ALiBi bias of positions [p0, p1) on their scores [position][lane] (tile `tile` of kv head h).
void logit_variants(const Attention& A, int64_t h, int64_t tile, int64_t p0, int64_t p1, float* scores) {
  const int n = static_cast<int>(p1 - p0);
  if (A.var.softcap > 0.0f) softcap_row(scores, n * kLanes, A.var.softcap);
  if (A.var.alibi != nullptr) {
    float slope[kLanes];
    for (int l = 0; l < kLanes; ++l) {
      const int64_t row = tile * kLanes + l;
      slope[l] = row < A.GT ? A.var.alibi[h * (A.Hq / A.Hkv) + row / A.Tq] : 0.0f;
    }
    for (int i = 0; i < n; ++i) {
      const float pos = static_cast<float>(p0 + i);
#pragma omp simd
      for (int l = 0; l < kLanes; ++l) scores[i * kLanes + l] += slope[l] * pos;
    }
  }
}

// Key scores of positions [p0, p1) into w.scores (tile `tile` of kv head (b, h)): the variants, then the mask bias.
void key_chunk(const Attention& A, int64_t b, int64_t h, int64_t tile, const TileQueries& tq, int mt, int64_t p0,
               int64_t p1, Scratch& w) {
  const Stream& s = *A.ks;
  const Codec& c = *s.c;
  const int D = A.D;
  const int64_t L = s.length, se = L - A.tn, start = s.start, cap = c.sinks + s.groups * c.group;
  // positions no slot holds (past the capacity after an overflow) get no weight
  std::fill(w.scores, w.scores + (p1 - p0) * kLanes, kNegInf);
  const int64_t s1 = std::min<int64_t>(p1, std::min<int64_t>(c.sinks, se));
  if (p0 < s1) raw_scores(tq.qp, D, s.sink.at(b, h, p0), s.sink.sn, s.dtype, s1 - p0, w.scores, w.raw);
  const int64_t a0 = std::max<int64_t>(p0, c.sinks), a1 = std::min({p1, start, se, cap});
  if (a0 < a1) key_archive(A, s, b, h, tq, a0, a1, p0, w);
  const int64_t t0 = std::max(p0, start), t1 = std::min({p1, se, start + c.tail_cap});
  if (t0 < t1)
    raw_scores(tq.qp, D, s.tail.at(b, h, t0 - start), s.tail.sn, s.dtype, t1 - t0, w.scores + (t0 - p0) * kLanes,
               w.raw);
  const int64_t n0 = std::max(p0, se), n1 = std::min(p1, L);
  if (n0 < n1)
    raw_scores(tq.qp, D, A.knew.at(b, h, n0 - se), A.knew.sn, A.knew.dtype, n1 - n0,
               w.scores + (n0 - p0) * kLanes, w.raw);
  if (A.var.logits()) logit_variants(A, h, tile, p0, p1, w.scores);
  if (A.has_mask) {
    for (int m = 0; m < mt; ++m) {
      const int64_t row = tile * kLanes + m, head = h * (A.Hq / A.Hkv) + row / A.Tq, t = row % A.Tq;
      A.mask.apply(b, head, t, p0, static_cast<int>(p1 - p0), w.scores + m, kLanes);
    }
  }
}

// --- values ------------------------------------------------------------------------------------------------------

// acc[m] += sum_p e[p][m] row_p over n raw rows (stride bytes).
inline void raw_values(const float* e, int mt, int D, const char* first, int64_t stride, at::ScalarType dt, int64_t n,
                       float* acc, float* buf) {
  for (int64_t i0 = 0; i0 < n; i0 += kRawBatch) {
    const int nb = static_cast<int>(std::min<int64_t>(kRawBatch, n - i0));
    int64_t rs;
    const float* rows = raw_batch(first, stride, dt, i0, nb, D, buf, rs);
    lane_axpys(e + i0 * kLanes, nb, rows, rs, D, acc, mt);
  }
}

// Channel-axis values: add the per-class accumulators of group g, scaled per channel, plus mass * zero point.
inline void flush_value_group(const Stream& s, int64_t b, int64_t h, int64_t g, int mt, float* accr, Scratch& w) {
  const Codec& c = *s.c;
  const int D = c.head_dim;
  const at::Half* sc = s.scale.at(b, h, g);
  const at::Half* zr = s.zero.at(b, h, g);
  float* sf = w.sf;
  float* zf = w.sf + D;
  for (int k = 0; k < c.classes; ++k) {
    for (int d = 0; d < D; ++d) sf[d] = half_at(sc, k * D + d);
    const int slot = c.class_zero[k];
    if (slot >= 0)
      for (int d = 0; d < D; ++d) zf[d] = half_at(zr, slot * D + d);
    for (int m = 0; m < mt; ++m) {
      float* dst = accr + m * D;
      const float* src = w.cacc + (k * kLanes + m) * D;
#pragma omp simd
      for (int d = 0; d < D; ++d) dst[d] += src[d] * sf[d];
      if (slot >= 0) axpy(dst, w.cz[k * kLanes + m], zf, D);
    }
  }
}

// Archive positions [a0, a1) of the value stream with weights e[p - p0][:]: accr (rotated domain), mass.
void value_archive(const Attention& A, const Stream& s, int64_t b, int64_t h, int mt, int64_t a0, int64_t a1,
                   int64_t p0, const float* e, float* accr, float* mass, Scratch& w) {
  const Codec& c = *s.c;
  const int D = A.D, R = c.dense, r = c.r;
  const int64_t nb0 = (a0 - c.sinks) / r, nb1 = (a1 - 1 - c.sinks) / r;
  for_block_batches(c, nb0, nb1, [&](int64_t first, int count) {
    const int64_t g = first / c.blocks;
    if (c.quant == kChannel) {
      std::fill(w.cacc, w.cacc + 2 * kLanes * D, 0.0f);
      std::fill(w.cz, w.cz + 2 * kLanes, 0.0f);
    }
    float* pc = w.pc;  // (count * R) x kLanes
    float zsum[kLanes];
    for (int l = 0; l < kLanes; ++l) zsum[l] = 0.0f;
    for (int n = 0; n < count; ++n) {
      const int64_t nb = first + n, pb = c.sinks + nb * r;
      const int i0 = static_cast<int>(std::max<int64_t>(a0 - pb, 0));
      const int i1 = static_cast<int>(std::min<int64_t>(a1 - pb, r));
      const float* wt = e + (pb - p0) * kLanes;  // the block's weights; rows outside [i0, i1) are not read
      if (c.center)
        for (int i = i0; i < i1; ++i)
#pragma omp simd
          for (int l = 0; l < kLanes; ++l) mass[l] += wt[i * kLanes + l];
      float* pn = pc + n * R * kLanes;
      if (!c.jpeg) {
        float run[kLanes];
        for (int l = 0; l < kLanes; ++l) run[l] = 0.0f;
        for (int j = r - 1; j >= 0; --j) {
          if (j >= i0 && j < i1)
#pragma omp simd
            for (int l = 0; l < kLanes; ++l) run[l] += wt[j * kLanes + l];
          for (int l = 0; l < kLanes; ++l) pn[j * kLanes + l] = run[l];
        }
      } else {
        lane_matmul(c.synth + i0 * R, 1, R, wt + i0 * kLanes, R, i1 - i0, nullptr, pn);
      }
      if (c.quant == kToken) {
        const int64_t gn = nb / c.blocks, blk = nb % c.blocks;
        const at::Half* sc = s.scale.at(b, h, gn) + blk * c.classes;
        const at::Half* zr = s.zero.at(b, h, gn) + blk * c.zero_classes;
        for (int j = 0; j < R; ++j) {
          const int k = c.row_class[j], slot = c.class_zero[k];
          const float sj = half_at(sc, k), zj = slot >= 0 ? half_at(zr, slot) : 0.0f;
#pragma omp simd
          for (int l = 0; l < kLanes; ++l) {
            zsum[l] += pn[j * kLanes + l] * zj;
            pn[j * kLanes + l] *= sj;
          }
        }
      }
    }
    if (c.quant == kChannel) {
      for (int n = 0; n < count; ++n) {
        const float* rows = block_rows(s, b, h, first + n, w.vblk, w.codes);
        const float* pn = pc + n * R * kLanes;
        for (int k = 0; k < c.classes; ++k) {
          const int f = c.class_first[k], nr = c.class_last[k] - f + 1;
          lane_axpys(pn + f * kLanes, nr, rows + f * D, D, D, w.cacc + k * kLanes * D, mt);
          float* cz = w.cz + k * kLanes;
          for (int j = f; j < f + nr; ++j)
#pragma omp simd
            for (int l = 0; l < kLanes; ++l) cz[l] += pn[j * kLanes + l];
        }
      }
      flush_value_group(s, b, h, g, mt, accr, w);
      return;
    }
    if (c.quant == kToken && c.zero_classes)
      for (int m = 0; m < mt; ++m) {
        float* dst = accr + m * D;
        for (int d = 0; d < D; ++d) dst[d] += zsum[m];
      }
    const float* rows = batch_rows(s, b, h, first, count, w.vblk, w.codes);
    lane_axpys(pc, count * R, rows, D, D, accr, mt);
  });
}

// Values of positions [p0, p1) with weights e (= w.scores after the softmax step).
void value_chunk(const Attention& A, int64_t b, int64_t h, int mt, int64_t p0, int64_t p1, const Partial& p,
                 Scratch& w) {
  const Stream& s = *A.vs;
  const Codec& c = *s.c;
  const int D = A.D;
  const int64_t L = s.length, se = L - A.tn, start = s.start, cap = c.sinks + s.groups * c.group;
  p1 = std::min(p1, L);
  const float* e = w.scores;
  const int64_t s1 = std::min<int64_t>(p1, std::min<int64_t>(c.sinks, se));
  if (p0 < s1) raw_values(e, mt, D, s.sink.at(b, h, p0), s.sink.sn, s.dtype, s1 - p0, p.acc, w.raw);
  const int64_t a0 = std::max<int64_t>(p0, c.sinks), a1 = std::min({p1, start, se, cap});
  if (a0 < a1) value_archive(A, s, b, h, mt, a0, a1, p0, e, p.accr, p.mass, w);
  const int64_t t0 = std::max(p0, start), t1 = std::min({p1, se, start + c.tail_cap});
  if (t0 < t1)
    raw_values(e + (t0 - p0) * kLanes, mt, D, s.tail.at(b, h, t0 - start), s.tail.sn, s.dtype, t1 - t0, p.acc, w.raw);
  const int64_t n0 = std::max(p0, se), n1 = p1;
  if (n0 < n1)
    raw_values(e + (n0 - p0) * kLanes, mt, D, A.vnew.at(b, h, n0 - se), A.vnew.sn, A.vnew.dtype, n1 - n0, p.acc,
               w.raw);
}

// --- driver ------------------------------------------------------------------------------------------------------

// Softmax step of one chunk (n positions): scores -> exp(scores - new max) in place; rescale the running state.
inline void softmax_step(float* scores, int n, int mt, int D, const Partial& p, bool rot, bool center) {
  float mx[kLanes], shift[kLanes], alpha[kLanes], total[kLanes];
  float part[4][kLanes];  // four partial maxima / sums: independent chains
  for (int k = 0; k < 4; ++k)
    for (int l = 0; l < kLanes; ++l) part[k][l] = p.mx[l];
  int i = 0;
  for (; i + 4 <= n; i += 4)
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k)
#pragma omp simd
      for (int l = 0; l < kLanes; ++l) part[k][l] = std::max(part[k][l], scores[(i + k) * kLanes + l]);
  for (; i < n; ++i)
    for (int l = 0; l < kLanes; ++l) part[0][l] = std::max(part[0][l], scores[i * kLanes + l]);
  for (int l = 0; l < kLanes; ++l) {
    mx[l] = std::max(std::max(part[0][l], part[1][l]), std::max(part[2][l], part[3][l]));
    shift[l] = mx[l] == kNegInf ? 0.0f : mx[l];  // a lane that has seen nothing keeps zero weights
    alpha[l] = p.mx[l] == kNegInf ? 0.0f : p.mx[l] - shift[l];
  }
  exp_row(alpha, alpha, kLanes);
  for (int l = 0; l < kLanes; ++l) alpha[l] = p.mx[l] == kNegInf ? 0.0f : alpha[l];
  for (int j = 0; j < n; ++j)
#pragma omp simd
    for (int l = 0; l < kLanes; ++l) scores[j * kLanes + l] -= shift[l];
  exp_row(scores, scores, n * kLanes);
  for (int k = 0; k < 4; ++k)
    for (int l = 0; l < kLanes; ++l) part[k][l] = 0.0f;
  for (i = 0; i + 4 <= n; i += 4)
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k)
#pragma omp simd
      for (int l = 0; l < kLanes; ++l) part[k][l] += scores[(i + k) * kLanes + l];
  for (; i < n; ++i)
    for (int l = 0; l < kLanes; ++l) part[0][l] += scores[i * kLanes + l];
  for (int l = 0; l < kLanes; ++l) total[l] = (part[0][l] + part[1][l]) + (part[2][l] + part[3][l]);
  for (int m = 0; m < mt; ++m) {
    if (alpha[m] != 1.0f) {
      scale_row(p.acc + m * D, alpha[m], D);
      if (rot) scale_row(p.accr + m * D, alpha[m], D);
      if (center) p.mass[m] *= alpha[m];
    }
  }
  for (int l = 0; l < kLanes; ++l) {
    p.l[l] = p.l[l] * alpha[l] + total[l];
    p.mx[l] = mx[l];
  }
}

// The queries of tile `tile` of kv head (b, h), transposed into tq: scaled, rotated into the key codec's space, their
// sums (token-axis zero points) and their products with the key center.
void prepare_queries(const Attention& A, const Stream& ks, int64_t b, int64_t h, int64_t tile, TileQueries& tq,
                     float* row) {
  const Codec& c = *ks.c;
  const int D = A.D;
  const int64_t gq = A.Hq / A.Hkv;
  std::fill(tq.qp, tq.qp + D * kLanes, 0.0f);
  for (int l = 0; l < kLanes; ++l) {
    const int64_t m = tile * kLanes + l;
    if (m >= A.GT) break;
    to_float(A.q.at(b, h * gq + m / A.Tq, m % A.Tq), A.q.dtype, row, D);
    for (int d = 0; d < D; ++d) tq.qp[d * kLanes + l] = row[d] * A.scale;
  }
  if (c.rotate) {  // q_rot = R @ q, per lane
    for (int d = 0; d < D; ++d) {
      float acc[kLanes];
      for (int l = 0; l < kLanes; ++l) acc[l] = 0.0f;
      for (int e = 0; e < D; ++e) {
        const float r = c.rot[d * D + e];
#pragma omp simd
        for (int l = 0; l < kLanes; ++l) acc[l] = std::fma(r, tq.qp[e * kLanes + l], acc[l]);
      }
      for (int l = 0; l < kLanes; ++l) tq.qr[d * kLanes + l] = acc[l];
    }
  }
  for (int l = 0; l < kLanes; ++l) { tq.qsum[l] = 0.0f; tq.qmean[l] = 0.0f; }
  if (c.quant == kToken && c.zero_classes > 0)
    for (int d = 0; d < D; ++d)
      for (int l = 0; l < kLanes; ++l) tq.qsum[l] += tq.qr[d * kLanes + l];
  if (c.center) {
    const float* mean = ks.mean.at(b, h);
    for (int d = 0; d < D; ++d)
      for (int l = 0; l < kLanes; ++l) tq.qmean[l] += tq.qp[d * kLanes + l] * mean[d];
  }
}

void combine(const Attention& A, const Stream& vs, at::Tensor& out) {
  const Codec& c = *vs.c;
  const int D = A.D;
  const bool rot = c.rotate;
  char* optr = static_cast<char*>(out.data_ptr());
  const int64_t osb = out.stride(0) * out.element_size(), osh = out.stride(1) * out.element_size(),
                ost = out.stride(2) * out.element_size();
  const int64_t gq = A.Hq / A.Hkv;
  {  // serial: a few vectors per query row, not worth a second parallel region (a barrier) per call
    float* rows = workspace(kWorkRows, 3LL * D);
    float *acc = rows, *accr = rows + D, *o = rows + 2 * D;
    for (int64_t it = 0; it < A.B * A.Hkv * A.tiles; ++it) {
      const int64_t bh = it / A.tiles, tile = it % A.tiles, b = bh / A.Hkv, h = bh % A.Hkv;
      const int mt = static_cast<int>(std::min<int64_t>(kLanes, A.GT - tile * kLanes));
      for (int m = 0; m < mt; ++m) {
        const int64_t row = tile * kLanes + m;
        float top = kNegInf;
        for (int s = 0; s < A.splits; ++s)
          top = std::max(top, Partial(A.part + (it * A.splits + s) * Partial::floats(D), D, rot).mx[m]);
        const float sink = A.var.sinks == nullptr ? kNegInf : A.var.sinks[h * gq + row / A.Tq];
        const float peak = std::max(top, sink);  // the sink logit joins the row's max and its denominator
        std::fill(acc, acc + D, 0.0f);
        std::fill(accr, accr + D, 0.0f);
        float l = 0.0f, mass = 0.0f;
        if (top != kNegInf) {
          for (int s = 0; s < A.splits; ++s) {
            Partial p(A.part + (it * A.splits + s) * Partial::floats(D), D, rot);
            if (p.mx[m] == kNegInf) continue;
            const float wgt = exp_one(p.mx[m] - peak);
            l += wgt * p.l[m];
            mass += wgt * p.mass[m];
            axpy(acc, wgt, p.acc + m * D, D);
            if (rot) axpy(accr, wgt, p.accr + m * D, D);
          }
        }
        if (sink != kNegInf) l += exp_one(sink - peak);
        if (!(l > 0.0f)) {
          std::fill(o, o + D, 0.0f);
        } else {
          for (int d = 0; d < D; ++d) o[d] = acc[d];
          if (rot) rotate_back(o, accr, c.rot, D);  // out += acc_rot @ R (back from the rotated space)
          if (c.center) axpy(o, mass, vs.mean.at(b, h), D);
          scale_row(o, 1.0f / l, D);
        }
        store_output(o, A.out_dtype, optr + b * osb + (h * gq + row / A.Tq) * osh + (row % A.Tq) * ost, D,
                     A.out_factors == nullptr ? nullptr : A.out_factors + (b * A.Hkv + h) * D);
      }
    }
  }
}

// Work-item layout from the shapes and the thread count only (the workspace never depends on the length).
struct Layout {
  int tiles, splits, chunk, lds;
  int64_t items, part_floats, scratch_floats, threads;
  int64_t total() const { return part_floats + scratch_floats * threads; }
};

Layout attention_layout(const Codec& kc, int64_t B, int64_t Hkv, int64_t GT, int D, int64_t threads) {
  Layout lay;
  lay.tiles = static_cast<int>((GT + kLanes - 1) / kLanes);
  lay.chunk = ((kChunk + kc.group - 1) / kc.group) * kc.group;
  lay.lds = lay.chunk + kc.sinks;
  const int64_t bht = B * Hkv * lay.tiles;
  lay.splits = static_cast<int>(std::max<int64_t>(1, (kItemsPerThread * threads + bht - 1) / bht));
  lay.items = bht * lay.splits;
  lay.threads = threads;
  lay.part_floats = lay.items * Partial::floats(D);
  lay.scratch_floats = Scratch::floats(lay.lds, D) + TileQueries::floats(D) + D;  // + the tile's queries, a row
  return lay;
}

// The call's variants; `sink_logits` / `slopes` hold the fp32 (Hq,) copies the pointers read.
Variants variants(int64_t Hq, double softcap, const c10::optional<at::Tensor>& sinks,
                  const c10::optional<at::Tensor>& alibi, at::Tensor& sink_logits, at::Tensor& slopes) {
  Variants var;
  TORCH_CHECK(softcap >= 0.0, "codec_attention: softcap must be > 0 (0: none)");
  var.softcap = static_cast<float>(softcap);
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == Hq && sinks->is_floating_point(),
                "codec_attention: sinks must be a float (Hq,) tensor");
    sink_logits = sinks->to(at::kFloat).contiguous();
    var.sinks = sink_logits.data_ptr<float>();
  }
  if (alibi.has_value()) {
    TORCH_CHECK(alibi->dim() == 1 && alibi->size(0) == Hq && alibi->scalar_type() == at::kFloat,
                "codec_attention: alibi must be a float32 (Hq,) tensor");
    slopes = alibi->contiguous();
    var.alibi = slopes.data_ptr<float>();
  }
  return var;
}

// Attention of the call's queries over two streams into out (B, Hq, T, D): the per-token kernel
// (token_attention.cpp) when both streams store one row per token, else the block kernel below.
void run_codec_attention(const AttentionInput& in, const Stream& ks, const Stream& vs, const Variants& var,
                         at::Tensor& out) {
  const Codec& kc = *ks.c;
  const Codec& vc = *vs.c;
  if (per_token(kc) && per_token(vc)) {
    token_codec_attention(in, ks, vs, var, out);
    return;
  }
  Attention A;
  A.B = in.B; A.Hq = in.Hq; A.Tq = in.Tq; A.D = in.D;
  A.Hkv = in.Hkv; A.GT = (A.Hq / A.Hkv) * A.Tq;
  A.tn = in.tn;
  A.ks = &ks; A.vs = &vs;
  A.q = in.q;
  A.knew = in.knew; A.vnew = in.vnew;
  A.has_mask = in.mask != nullptr && in.mask->has_value();
  if (A.has_mask) A.mask = MaskView(**in.mask);
  A.scale = static_cast<float>(in.scale);
  A.var = var;
  A.out_dtype = out.scalar_type();
  A.out_factors = in.out_factors;
  const int64_t threads = at::get_num_threads();
  const Layout lay = attention_layout(kc, A.B, A.Hkv, A.GT, A.D, threads);
  float* base = workspace(kWorkAttention, lay.total());
  A.part = base;
  float* scratch = base + lay.part_floats;
  const int64_t L = ks.length;
  const int64_t use = threads_for(A.B * A.Hkv * lay.tiles * L, kMinWorkPerThread);
  A.tiles = lay.tiles; A.splits = use == 1 ? 1 : lay.splits; A.chunk = lay.chunk; A.lds = lay.lds;
  A.n_chunks = L <= kc.sinks ? 1 : (L - kc.sinks + A.chunk - 1) / A.chunk;
  const bool rot = vc.rotate;
  const int D = A.D;
  std::vector<int64_t>& prepared = prepared_tiles(use);  // per slot: the tile whose queries its scratch holds
  Pool::get().run(A.B * A.Hkv * A.tiles * A.splits, static_cast<int>(use - 1), [&](int64_t item, int slot) {
    float* mine = scratch + slot * lay.scratch_floats;
    Scratch w(mine, A.lds, D);
    float* query_base = mine + Scratch::floats(A.lds, D);
    TileQueries tq(query_base, D, kc.rotate);
    const int64_t split = item % A.splits, it = item / A.splits;
    const int64_t bh = it / A.tiles, tile = it % A.tiles, b = bh / A.Hkv, h = bh % A.Hkv;
    if (it != prepared[slot]) {
      prepare_queries(A, ks, b, h, tile, tq, query_base + TileQueries::floats(D));
      prepared[slot] = it;
    }
    const int mt = static_cast<int>(std::min<int64_t>(kLanes, A.GT - tile * kLanes));
    Partial p(A.part + item * Partial::floats(D), D, rot);
    std::fill(p.mx, p.mx + kLanes, kNegInf);
    std::fill(p.l, p.l + 2 * kLanes + 2 * kLanes * D, 0.0f);
    const int64_t c0 = A.n_chunks * split / A.splits, c1 = A.n_chunks * (split + 1) / A.splits;
    for (int64_t ch = c0; ch < c1; ++ch) {
      const int64_t p0 = A.chunk_begin(ch), p1 = A.chunk_end(ch);
      if (p0 >= p1) continue;
      key_chunk(A, b, h, tile, tq, mt, p0, p1, w);
      softmax_step(w.scores, static_cast<int>(p1 - p0), mt, D, p, rot, vc.center);
      value_chunk(A, b, h, mt, p0, p1, p, w);
    }
  });
  combine(A, vs, out);
}

// flashcodec::codec_attention over streams of the codecs kc, vc (the launcher's inputs already in the stored domain).
at::Tensor codec_attention_codecs(const at::Tensor& q_in, const std::vector<at::Tensor>& k_in,
                                  const std::vector<at::Tensor>& v_in, const Codec& kc, const Codec& vc,
                                  const c10::optional<at::Tensor>& k_new, const c10::optional<at::Tensor>& v_new,
                                  const c10::optional<at::Tensor>& mask, double scale, bool simd, double softcap,
                                  const c10::optional<at::Tensor>& sinks, const c10::optional<at::Tensor>& alibi) {
  const std::vector<at::Tensor> k_state = readable_state(k_in), v_state = readable_state(v_in);
  const at::Tensor q = readable_rows(q_in);
  at::Tensor kn, vn;
  if (k_new.has_value()) { kn = readable_rows(*k_new); vn = readable_rows(*v_new); }
  const Stream ks(kc, k_state), vs(vc, v_state);
  at::Tensor sink_logits, slopes;  // held for the call
  const Variants var = variants(q.size(1), softcap, sinks, alibi, sink_logits, slopes);
  AttentionInput in;
  in.q = Rows(q);
  in.B = q.size(0); in.Hq = q.size(1); in.Tq = q.size(2); in.D = static_cast<int>(q.size(3));
  in.Hkv = k_state[kStateTail].size(1);
  if (k_new.has_value()) { in.knew = Rows(kn); in.vnew = Rows(vn); in.tn = kn.size(2); }
  in.mask = &mask;
  in.scale = scale;
  in.simd = simd;
  at::Tensor out = at::empty(q.sizes(), q.options());
  run_codec_attention(in, ks, vs, var, out);
  return out;
}

at::Tensor codec_attention(const at::Tensor& q_in, const std::vector<at::Tensor>& k_in,
                           const std::vector<at::Tensor>& v_in, const std::vector<at::Tensor>& k_plan,
                           const std::vector<at::Tensor>& v_plan, const c10::optional<at::Tensor>& k_new,
                           const c10::optional<at::Tensor>& v_new, const c10::optional<at::Tensor>& mask,
                           double scale, bool simd, double softcap, const c10::optional<at::Tensor>& sinks,
                           const c10::optional<at::Tensor>& alibi) {
  const Codec kc = Codec::parse(k_plan), vc = Codec::parse(v_plan);
  return codec_attention_codecs(q_in, k_in, v_in, kc, vc, k_new, v_new, mask, scale, simd, softcap, sinks, alibi);
}



// Floats of the workspace one call allocates besides its output: a function of the shapes and the thread count,
// never of the stored length.
int64_t attention_workspace(const std::vector<at::Tensor>& k_plan, const std::vector<at::Tensor>& v_plan, int64_t B,
                            int64_t Hkv, int64_t GT, int64_t D) {
  const Codec kc = Codec::parse(k_plan), vc = Codec::parse(v_plan);
  if (per_token(kc) && per_token(vc))
    return token_layout(B, Hkv, GT, static_cast<int>(D), at::get_num_threads()).total();
  return attention_layout(kc, B, Hkv, GT, static_cast<int>(D), at::get_num_threads()).total();
}

// Which code serves a pair of codecs: "block" (this file), else "token:<keys>/<values>" with how each stream's
// archive rows are read ("avx512", "avx2", "portable" or "raw").
std::string attention_path(const std::vector<at::Tensor>& k_plan, const std::vector<at::Tensor>& v_plan, bool simd) {
  const Codec kc = Codec::parse(k_plan), vc = Codec::parse(v_plan);
  if (!(per_token(kc) && per_token(vc))) return "block";
  return std::string("token:") + row_codes_name(row_codes(kc, simd), kc.head_dim) + "/" +
         row_codes_name(row_codes(vc, simd), vc.head_dim);
}

}  // namespace fc
