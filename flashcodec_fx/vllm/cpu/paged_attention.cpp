// Attention on vLLM pages on the CPU (the spec: vllm/reference.py attention_reference).
//
// Work items are (request, KV head, query tile): a tile holds up to kLanes query rows (the GQA heads x this call's
// tokens of one request) side by side in SIMD lanes (common.h's lane kernels), so every history row read serves all
// of them. The history is walked page by page through the block table: a page's raw rows are dotted with the query
// as is; its code slots are unpacked into unscaled levels (an L1 scratch, never a dequantized copy of the cache) and
// dotted with the query rotated once per item (R_k q), the fp16 scale applied per (row, lane). One online-softmax
// step per page, then the values: raw rows into a plain accumulator, code levels weighted by p * scale into a
// rotated one, rotated back once at the end (R_v^T). The call's own tokens come last, raw, causal per lane. Optional
// sink logits (s_aux, per query head) join the softmax's denominator. Everything is fp32; `scale` is folded into q.

namespace fc {

namespace {

struct Item {
  int64_t req, head, tile;
};

struct Lanes {
  int n = 0;                       // lanes in use
  int64_t q_row[kLanes], q_head[kLanes], token[kLanes];  // query row (N axis), query head, token index in the call
};

// The online softmax of one tile: running max and sum per lane; rescales both accumulators when the max moves.
struct Softmax {
  float m[kLanes], s[kLanes];
  Softmax() {
    for (int l = 0; l < kLanes; ++l) { m[l] = kNegInf; s[l] = 0.0f; }
  }
  // scores (n x kLanes) -> probabilities in place; acc rows (lanes x D) and zacc rescaled.
  void step(float* scores, int n, const Lanes& lanes, int D, float* acc_raw, float* acc_rot, float* zacc,
            float* column) {
    for (int l = 0; l < lanes.n; ++l) {
      float mx = m[l];
      for (int j = 0; j < n; ++j) mx = std::max(mx, scores[j * kLanes + l]);
      if (mx == kNegInf) {  // nothing visible to this lane yet
        for (int j = 0; j < n; ++j) scores[j * kLanes + l] = 0.0f;
        continue;
      }
      const float alpha = m[l] == kNegInf ? 0.0f : exp_one(m[l] - mx);
      for (int j = 0; j < n; ++j) column[j] = scores[j * kLanes + l] - mx;
      exp_row(column, column, n);
      float sum = 0.0f;
      for (int j = 0; j < n; ++j) {
        scores[j * kLanes + l] = column[j];
        sum += column[j];
      }
      if (alpha != 1.0f) {
        scale_row(acc_raw + l * D, alpha, D);
        scale_row(acc_rot + l * D, alpha, D);
        zacc[l] *= alpha;
      }
      s[l] = s[l] * alpha + sum;
      m[l] = mx;
    }
  }
};

// (D x kLanes) lane-major transposes of the tile's queries, times `scale`: plain and rotated by R (D x D, or null).
void load_queries(const TokenRows& q, const Lanes& lanes, int D, float scale, const float* rot, float* qt, float* qt_rot,
                  float* row) {
  std::fill(qt, qt + D * kLanes, 0.0f);
  std::fill(qt_rot, qt_rot + D * kLanes, 0.0f);
  for (int l = 0; l < lanes.n; ++l) {
    to_float(q.at(lanes.q_row[l], lanes.q_head[l]), q.dtype, row, D);
    for (int d = 0; d < D; ++d) qt[d * kLanes + l] = row[d] * scale;
    for (int e = 0; e < D; ++e) qt_rot[e * kLanes + l] = rot == nullptr ? qt[e * kLanes + l] : dot(rot + e * D, row, D) * scale;
  }
}

}  // namespace

void paged_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& cache,
                     const at::Tensor& block_table, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                     const at::Tensor& page_meta, const std::vector<at::Tensor>& kplan,
                     const std::vector<at::Tensor>& vplan, double softmax_scale, const c10::optional<at::Tensor>& s_aux,
                     const at::Tensor& out) {
  const TokenRows q(query), k(key), v(value), o(out);
  const int D = static_cast<int>(query.size(2));
  const int64_t Hq = query.size(1);
  const PageLayout p = PageLayout::parse(page_meta, cache, key.scalar_type(), D);
  const int64_t H = p.heads, G = Hq / H, R = seq_lens.size(0);
  TORCH_CHECK(block_table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt,
              "block_table, seq_lens, query_start_loc: int32");
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const int64_t bt_stride = block_table.stride(0);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const float* sink = s_aux.has_value() ? s_aux->data_ptr<float>() : nullptr;
  const bool coded = !p.raw;
  Codec ck, cv;
  if (coded) { ck = Codec::parse(kplan); cv = Codec::parse(vplan); }
  const float* rot_k = coded && ck.rotate ? ck.rot : nullptr;
  const float* rot_v = coded && cv.rotate ? cv.rot : nullptr;
  const float scale = static_cast<float>(softmax_scale);
  std::vector<Item> items;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t rows = (qsl[r + 1] - qsl[r]) * G;
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t * kLanes < rows; ++t) items.push_back({r, h, t});
  }
  uint8_t* base = cache.data_ptr<uint8_t>();
  const int64_t bs = p.bs, raw_rows = p.raw_rows(), raw_bytes = p.raw_row_bytes(), half = p.row_bytes();
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> qt(D * kLanes), qt_rot(D * kLanes), scores(bs * kLanes), rows(bs * D), w(bs * kLanes);
    std::vector<float> acc_raw(kLanes * D), acc_rot(kLanes * D), column(bs), row(D);
    std::vector<int32_t> codes(D);
    float zacc[kLanes], qsum[kLanes];
    for (int64_t it = i0; it < i1; ++it) {
      const Item& item = items[it];
      const int64_t qs = qsl[item.req], t_len = qsl[item.req + 1] - qs, ctx = lens[item.req] - t_len;
      Lanes lanes;
      for (int64_t idx = item.tile * kLanes; idx < std::min<int64_t>(t_len * G, (item.tile + 1) * kLanes); ++idx) {
        lanes.token[lanes.n] = idx / G;
        lanes.q_row[lanes.n] = qs + idx / G;
        lanes.q_head[lanes.n] = item.head * G + idx % G;
        ++lanes.n;
      }
      load_queries(q, lanes, D, scale, rot_k, qt.data(), qt_rot.data(), row.data());
      for (int l = 0; l < kLanes; ++l) {
        zacc[l] = 0.0f;
        qsum[l] = 0.0f;
        for (int d = 0; d < D; ++d) qsum[l] += qt_rot[d * kLanes + l];
      }
      std::fill(acc_raw.begin(), acc_raw.end(), 0.0f);
      std::fill(acc_rot.begin(), acc_rot.end(), 0.0f);
      Softmax sm;
      // --- the history, page by page
      for (int64_t start = 0; start < ctx; start += bs) {
        const int64_t n = std::min(bs, ctx - start), na = std::min(n, raw_rows), nc = n - na;
        const uint8_t* page = p.page(base, bt[item.req * bt_stride + start / bs], item.head);
        for (int64_t j = 0; j < na; ++j) to_float(page + p.raw_at(j), p.dtype, rows.data() + j * D, D);
        lane_dots_n(qt.data(), rows.data(), D, static_cast<int>(na), D, scores.data());
        if (nc > 0) {
          for (int64_t j = 0; j < nc; ++j) row_levels(ck, page + p.slot_at(na + j) + p.k_code, 0, codes.data(),
                                                      rows.data() + j * D);
          float* sc = scores.data() + na * kLanes;
          lane_dots_n(qt_rot.data(), rows.data(), D, static_cast<int>(nc), D, sc);
          for (int64_t j = 0; j < nc; ++j) {
            const uint8_t* slot = page + p.slot_at(na + j);
            const float ks = static_cast<float>(*reinterpret_cast<const at::Half*>(slot + p.k_scale));
            const float kz = ck.zero_classes ? static_cast<float>(*reinterpret_cast<const at::Half*>(slot + p.k_zero)) : 0.0f;
            for (int l = 0; l < kLanes; ++l) sc[j * kLanes + l] = sc[j * kLanes + l] * ks + kz * qsum[l];
          }
        }
        sm.step(scores.data(), static_cast<int>(n), lanes, D, acc_raw.data(), acc_rot.data(), zacc, column.data());
        for (int64_t j = 0; j < na; ++j) to_float(page + p.raw_at(j) + half, p.dtype, rows.data() + j * D, D);
        lane_axpys(scores.data(), static_cast<int>(na), rows.data(), D, D, acc_raw.data(), lanes.n);
        if (nc > 0) {
          for (int64_t j = 0; j < nc; ++j) {
            const uint8_t* slot = page + p.slot_at(na + j);
            row_levels(cv, slot + p.v_code, 0, codes.data(), rows.data() + j * D);
            const float vs = static_cast<float>(*reinterpret_cast<const at::Half*>(slot + p.v_scale));
            const float vz = cv.zero_classes ? static_cast<float>(*reinterpret_cast<const at::Half*>(slot + p.v_zero)) : 0.0f;
            for (int l = 0; l < kLanes; ++l) {
              const float pr = scores[(na + j) * kLanes + l];
              w[j * kLanes + l] = pr * vs;
              zacc[l] += pr * vz;
            }
          }
          lane_axpys(w.data(), static_cast<int>(nc), rows.data(), D, D, acc_rot.data(), lanes.n);
        }
      }
      // --- this call's own tokens, exact and causal (lane of token i sees tokens 0..i of the call)
      for (int64_t start = 0; start < t_len; start += bs) {
        const int64_t n = std::min(bs, t_len - start);
        for (int64_t j = 0; j < n; ++j) to_float(k.at(qs + start + j, item.head), k.dtype, rows.data() + j * D, D);
        lane_dots_n(qt.data(), rows.data(), D, static_cast<int>(n), D, scores.data());
        for (int64_t j = 0; j < n; ++j)
          for (int l = 0; l < kLanes; ++l)
            if (l >= lanes.n || start + j > lanes.token[l]) scores[j * kLanes + l] = kNegInf;
        sm.step(scores.data(), static_cast<int>(n), lanes, D, acc_raw.data(), acc_rot.data(), zacc, column.data());
        for (int64_t j = 0; j < n; ++j) to_float(v.at(qs + start + j, item.head), v.dtype, rows.data() + j * D, D);
        lane_axpys(scores.data(), static_cast<int>(n), rows.data(), D, D, acc_raw.data(), lanes.n);
      }
      // --- sinks, normalization, the rotation back
      for (int l = 0; l < lanes.n; ++l) {
        float total = sm.s[l];
        if (sink != nullptr) {
          const float logit = sink[lanes.q_head[l]], mx = std::max(sm.m[l], logit);
          const float alpha = exp_one(sm.m[l] - mx);
          total = total * alpha + exp_one(logit - mx);
          scale_row(acc_raw.data() + l * D, alpha, D);
          scale_row(acc_rot.data() + l * D, alpha, D);
          zacc[l] *= alpha;
        }
        const float inv = 1.0f / total;
        float* ar = acc_rot.data() + l * D;
        for (int d = 0; d < D; ++d) ar[d] += zacc[l];
        for (int d = 0; d < D; ++d) {
          float x = acc_raw[l * D + d];
          if (coded) x += rot_v == nullptr ? ar[d] : 0.0f;
          row[d] = x;
        }
        if (coded && rot_v != nullptr)
          for (int e = 0; e < D; ++e) axpy(row.data(), ar[e], rot_v + e * D, D);
        scale_row(row.data(), inv, D);
        from_float(row.data(), o.dtype, o.at(lanes.q_row[l], lanes.q_head[l]), D);
      }
    }
  });
}

}  // namespace fc
