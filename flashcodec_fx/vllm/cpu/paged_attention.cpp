// Attention on vLLM pages on the CPU (the spec: vllm/reference.py attention_reference).
//
// Work items are (request, KV head, group of up to kTileGroup query tiles); a tile holds up to kLanes query rows
// (the GQA heads x this call's tokens of the request) side by side in SIMD lanes (common.h's lane kernels). The
// history is walked page by page through the block table, and each page is read once per item: the raw rows holding
// history tokens converted to fp32 (PageLayout::read: a first page's sinks, a later page's ring), its code slots
// holding the others unpacked into unscaled levels (an L1 scratch of one page, never a dequantized copy of the
// cache), then every tile of the item dots them with its queries: raw rows with q, code levels with q rotated once
// (R_k q), the fp16 scale applied per (row, lane), plus q . m for centered keys (m: the mean of the page before's raw
// key rows; the first page's own). One online-softmax step per page and tile (a page's keys in any order), then the
// values: raw rows into a plain accumulator, code levels weighted by p * scale into a rotated one, rotated back once
// at the end (R_v^T). The call's own tokens come last, raw and causal per lane (a tile stops at its last token).
// Optional sink logits (s_aux, per query head) join the softmax's denominator. Everything is fp32; `scale` is
// folded into q. Requests with more than `max_tokens` tokens in this call are left to the launcher (kernels.py).
//
// Items whose tiles have at most 4 rows (decode steps: the GQA heads of one token) read the code slots directly
// where token_simd.h's loops serve both codecs (AVX2 / AVX-512): code_scores / code_values expand 8 or 16 codes at a
// time into levels in a register and feed the tile's rows (row-major queries, no lanes wasted, no level rows written;
// trellis codes through TcqCodes, each level from its code and the low bits of the three before it; the other items
// unpack them with row_levels, which decodes trellis rows the same way).

namespace fc {

namespace {

constexpr int kTileGroup = 8;
constexpr int kDirectRows = 4;  // tile rows up to which code slots are read by the direct loops (token_simd.h)

struct Item {
  int64_t req, head, first_tile, tiles;
};
struct Lanes {
  int n = 0;                                             // lanes in use
  int64_t q_row[kLanes], q_head[kLanes], token[kLanes];  // query row (N axis), query head, token index in the call
};

// (D x kLanes) lane-major transposes of the tile's queries, times `scale`: plain and rotated by R (D x D, or null);
// the rotated ones also row-major (kLanes x D, for the direct code loops).
void load_queries(const TokenRows& q, const Lanes& lanes, int D, float scale, const float* rot, float* qt, float* qt_rot,
                  float* q_rows, float* row) {
  std::fill(qt, qt + D * kLanes, 0.0f);
  std::fill(qt_rot, qt_rot + D * kLanes, 0.0f);
  for (int l = 0; l < lanes.n; ++l) {
    to_float(q.at(lanes.q_row[l], lanes.q_head[l]), q.dtype, row, D);
    for (int d = 0; d < D; ++d) qt[d * kLanes + l] = row[d] * scale;
    for (int e = 0; e < D; ++e) {
      qt_rot[e * kLanes + l] = rot == nullptr ? qt[e * kLanes + l] : dot(rot + e * D, row, D) * scale;
      q_rows[l * D + e] = qt_rot[e * kLanes + l];
    }
  }
}

// One tile: its lanes, queries (plain and rotated), the online softmax (running max and sum per lane), the raw and
// the rotated value accumulators (lanes x D) and the rotated accumulator's zero-point mass.
struct Tile {
  int D;
  Lanes lanes;
  std::vector<float> qt, qt_rot, q_rows, acc_raw, acc_rot;
  float m[kLanes], s[kLanes], zacc[kLanes], qsum[kLanes], qmean[kLanes];

  explicit Tile(int d)
      : D(d), qt(d * kLanes), qt_rot(d * kLanes), q_rows(kLanes * d), acc_raw(kLanes * d), acc_rot(kLanes * d) {}

  // Tile `index` of a request's rows (token-major: row idx is token idx / G, query head head * G + idx % G).
  void reset(int64_t index, int64_t head, int64_t qs, int64_t t_len, int64_t G) {
    lanes.n = 0;
    for (int64_t idx = index * kLanes; idx < std::min<int64_t>(t_len * G, (index + 1) * kLanes); ++idx) {
      lanes.token[lanes.n] = idx / G;
      lanes.q_row[lanes.n] = qs + idx / G;
      lanes.q_head[lanes.n] = head * G + idx % G;
      ++lanes.n;
    }
    for (int l = 0; l < kLanes; ++l) { m[l] = kNegInf; s[l] = 0.0f; zacc[l] = 0.0f; }
    std::fill(acc_raw.begin(), acc_raw.end(), 0.0f);
    std::fill(acc_rot.begin(), acc_rot.end(), 0.0f);
  }

  void rescale(int l, float alpha) {
    scale_row(acc_raw.data() + l * D, alpha, D);
    scale_row(acc_rot.data() + l * D, alpha, D);
    zacc[l] *= alpha;
  }

  // scores (n x kLanes) -> probabilities in place, the running max and sum updated, the accumulators rescaled.
  void step(float* scores, int n, float* column) {
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
      if (alpha != 1.0f) rescale(l, alpha);
      s[l] = s[l] * alpha + sum;
      m[l] = mx;
    }
  }

  // Sinks, normalization, the rotated accumulator rotated back (R_v^T), the output rows written.
  void finish(const float* sink, const float* rot_v, bool coded, float* row, const TokenRows& o) {
    for (int l = 0; l < lanes.n; ++l) {
      float total = s[l];
      if (sink != nullptr) {
        const float logit = sink[lanes.q_head[l]], mx = std::max(m[l], logit);
        const float alpha = exp_one(m[l] - mx);
        total = total * alpha + exp_one(logit - mx);
        rescale(l, alpha);
      }
      float* ar = acc_rot.data() + l * D;
      for (int d = 0; d < D; ++d) ar[d] += zacc[l];
      for (int d = 0; d < D; ++d) row[d] = acc_raw[l * D + d] + (coded && rot_v == nullptr ? ar[d] : 0.0f);
      if (coded && rot_v != nullptr)
        for (int e = 0; e < D; ++e) axpy(row, ar[e], rot_v + e * D, D);
      scale_row(row, 1.0f / total, D);
      from_float(row, o.dtype, o.at(lanes.q_row[l], lanes.q_head[l]), D);
    }
  }
};

}  // namespace

void paged_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& cache,
                     const at::Tensor& block_table, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                     const at::Tensor& page_meta, const std::vector<at::Tensor>& kplan,
                     const std::vector<at::Tensor>& vplan, double softmax_scale, const c10::optional<at::Tensor>& s_aux,
                     int64_t max_tokens, const at::Tensor& out) {
  const TokenRows q(query), k(key), v(value), o(out);
  const int D = static_cast<int>(query.size(2));
  const int64_t Hq = query.size(1);
  const PageLayout p = PageLayout::parse(page_meta, cache, key.scalar_type(), D);
  const int64_t H = p.heads, G = Hq / H, R = seq_lens.size(0);
  const Requests req(block_table, seq_lens, query_start_loc);
  const int32_t* lens = req.lens;
  const int32_t* qsl = req.starts;
  const float* sink = s_aux.has_value() ? s_aux->data_ptr<float>() : nullptr;
  const bool coded = !p.raw;
  const SlotCodecs codecs(p, kplan, vplan);
  const Codec &ck = codecs.k, &cv = codecs.v;
  const float *rot_k = codecs.rot_k, *rot_v = codecs.rot_v;
  const float scale = static_cast<float>(softmax_scale);
  const RowCodes kcodes = coded ? row_codes(ck, true) : RowCodes::kRaw, vcodes = coded ? row_codes(cv, true) : kcodes;
  const bool simd_codes = coded && kcodes != RowCodes::kPortable && vcodes != RowCodes::kPortable;
  std::vector<Item> items;
  for (int64_t r = 0; r < R; ++r) {
    if (qsl[r + 1] - qsl[r] > max_tokens) continue;  // the launcher's dense path serves this request
    const int64_t tiles = ((qsl[r + 1] - qsl[r]) * G + kLanes - 1) / kLanes;
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < tiles; t += kTileGroup) items.push_back({r, h, t, std::min<int64_t>(kTileGroup, tiles - t)});
  }
  // Largest first (keys read x tiles), claimed one at a time: a decode step's requests differ in length.
  const auto cost = [&](const Item& item) { return static_cast<int64_t>(lens[item.req]) * item.tiles; };
  std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) { return cost(a) > cost(b); });
  uint8_t* base = cache.data_ptr<uint8_t>();
  const int64_t bs = p.bs, half = p.row_bytes(), n_items = static_cast<int64_t>(items.size());
  for_claimed(n_items, at::get_num_threads(), [&](Claims& claims, int) {
    std::vector<Tile> tiles(kTileGroup, Tile(D));
    std::vector<float> kraw(bs * D), vraw(bs * D), klev(bs * D), vlev(bs * D), kscale(bs), kzero(bs), vscale(bs);
    std::vector<float> vzero(bs), scores(bs * kLanes), w(bs * kLanes), column(bs), row(D), mean(D), mrow(D);
    std::vector<float> rows_out(kDirectRows * bs), rows_w(kDirectRows * bs);
    std::vector<int32_t> codes(D);
    for (int64_t it; claims.take(it);) {
      const Item& item = items[it];
      const int64_t qs = qsl[item.req], t_len = qsl[item.req + 1] - qs, ctx = lens[item.req] - t_len;
      bool direct = simd_codes;  // every tile small enough for the direct code loops
      for (int64_t t = 0; t < item.tiles; ++t) {
        Tile& tile = tiles[t];
        tile.reset(item.first_tile + t, item.head, qs, t_len, G);
        load_queries(q, tile.lanes, D, scale, rot_k, tile.qt.data(), tile.qt_rot.data(), tile.q_rows.data(),
                     row.data());
        for (int l = 0; l < kLanes; ++l) {
          tile.qsum[l] = 0.0f;
          for (int d = 0; d < D; ++d) tile.qsum[l] += tile.qt_rot[d * kLanes + l];
        }
        direct = direct && tile.lanes.n <= kDirectRows;
      }
      // --- the history, page by page: read once, used by every tile
      for (int64_t start = 0; start < ctx; start += bs) {
        const int64_t index = start / bs, n = std::min(bs, ctx - start);
        const uint8_t* page = p.page(base, req.block(item.req, index), item.head);
        int64_t na = 0, nc = 0;  // raw rows, code slots holding history tokens (slots 0 .. nc - 1)
        for (int64_t off = 0; off < n; ++off) {
          const int64_t at = p.read(index, off, n, lens[item.req]);
          if (at < 0) { nc = std::max(nc, -at); continue; }
          to_float(page + p.raw_at(at), p.dtype, kraw.data() + na * D, D);
          to_float(page + p.raw_at(at) + half, p.dtype, vraw.data() + na * D, D);
          ++na;
        }
        const bool centered = p.center && nc > 0;
        if (centered)  // the page before's raw key rows (the first page: its own)
          p.key_mean(p.page(base, req.block(item.req, std::max<int64_t>(index - 1, 0)), item.head), mean.data(),
                     mrow.data());
        for (int64_t j = 0; j < nc; ++j) {
          const uint8_t* slot = page + p.code_at(j);
          if (!direct) {
            row_levels(ck, slot + p.k_code, 0, codes.data(), klev.data() + j * D);
            row_levels(cv, slot + p.v_code, 0, codes.data(), vlev.data() + j * D);
          }
          kscale[j] = half_at(slot + p.k_scale);
          kzero[j] = ck.zero_classes ? half_at(slot + p.k_zero) : 0.0f;
          vscale[j] = half_at(slot + p.v_scale);
          vzero[j] = cv.zero_classes ? half_at(slot + p.v_zero) : 0.0f;
        }
        for (int64_t t = 0; t < item.tiles; ++t) {
          Tile& tile = tiles[t];
          lane_dots_n(tile.qt.data(), kraw.data(), D, static_cast<int>(na), D, scores.data());
          float* sc = scores.data() + na * kLanes;
          if (nc > 0 && direct) {
            code_scores(kcodes, ck, tile.lanes.n, tile.q_rows.data(), D, page + p.code_at(0) + p.k_code, p.slot, nc,
                        rows_out.data(), bs);
            for (int64_t j = 0; j < nc; ++j)
              for (int l = 0; l < kLanes; ++l) sc[j * kLanes + l] = l < tile.lanes.n ? rows_out[l * bs + j] : 0.0f;
          } else if (nc > 0) {
            lane_dots_n(tile.qt_rot.data(), klev.data(), D, static_cast<int>(nc), D, sc);
          }
          if (centered) lane_dots_n(tile.qt.data(), mean.data(), D, 1, D, tile.qmean);
          else std::fill(tile.qmean, tile.qmean + kLanes, 0.0f);
          for (int64_t j = 0; j < nc; ++j)
            for (int l = 0; l < kLanes; ++l)
              sc[j * kLanes + l] = sc[j * kLanes + l] * kscale[j] + kzero[j] * tile.qsum[l] + tile.qmean[l];
          tile.step(scores.data(), static_cast<int>(n), column.data());
          lane_axpys(scores.data(), static_cast<int>(na), vraw.data(), D, D, tile.acc_raw.data(), tile.lanes.n);
          for (int64_t j = 0; j < nc; ++j)
            for (int l = 0; l < kLanes; ++l) {
              const float pr = sc[j * kLanes + l];
              w[j * kLanes + l] = pr * vscale[j];
              tile.zacc[l] += pr * vzero[j];
            }
          if (nc > 0 && direct) {
            for (int l = 0; l < tile.lanes.n; ++l)
              for (int64_t j = 0; j < nc; ++j) rows_w[l * bs + j] = w[j * kLanes + l];
            code_values(vcodes, cv, tile.lanes.n, rows_w.data(), bs, D, page + p.code_at(0) + p.v_code, p.slot, nc,
                        tile.acc_rot.data());
          } else if (nc > 0) {
            lane_axpys(w.data(), static_cast<int>(nc), vlev.data(), D, D, tile.acc_rot.data(), tile.lanes.n);
          }
        }
      }
      // --- this call's own tokens, exact and causal (the lane of token i sees tokens 0..i of the call)
      const int64_t last = tiles[item.tiles - 1].lanes.token[tiles[item.tiles - 1].lanes.n - 1];
      for (int64_t start = 0; start <= last; start += bs) {
        const int64_t n = std::min(bs, last + 1 - start);
        for (int64_t j = 0; j < n; ++j) {
          to_float(k.at(qs + start + j, item.head), k.dtype, kraw.data() + j * D, D);
          to_float(v.at(qs + start + j, item.head), v.dtype, vraw.data() + j * D, D);
        }
        for (int64_t t = 0; t < item.tiles; ++t) {
          Tile& tile = tiles[t];
          const int64_t seen = std::min(n, tile.lanes.token[tile.lanes.n - 1] + 1 - start);
          if (seen <= 0) continue;
          lane_dots_n(tile.qt.data(), kraw.data(), D, static_cast<int>(seen), D, scores.data());
          for (int64_t j = 0; j < seen; ++j)
            for (int l = 0; l < kLanes; ++l)
              if (l >= tile.lanes.n || start + j > tile.lanes.token[l]) scores[j * kLanes + l] = kNegInf;
          tile.step(scores.data(), static_cast<int>(seen), column.data());
          lane_axpys(scores.data(), static_cast<int>(seen), vraw.data(), D, D, tile.acc_raw.data(), tile.lanes.n);
        }
      }
      for (int64_t t = 0; t < item.tiles; ++t) tiles[t].finish(sink, rot_v, coded, row.data(), o);
    }
  });
}

}  // namespace fc
