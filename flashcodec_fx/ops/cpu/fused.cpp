// flashcodec::append_attention on the CPU (spec: ops/reference/append_attention.py): one decode step of a codec layer
// in one call, the two appends then attention, with what the launchers did around them in ATen done here:
//
//   append:     the new tokens in the raw rows' dtype (rounded to bf16 under raw=bfloat16), divided by a normalized
//               stream's channel factors n = 2 ** norm (in that dtype), appended (append.cpp);
//   attention:  q times n_k (in q's dtype), the call's own tokens divided by n (in their dtype), the output times n_v
//               (rounded to q's dtype first, as `out.to(dtype) * n.to(dtype)` rounds), attention.cpp /
//               token_attention.cpp on the stored form.
//
// Each product and quotient rounds as the ATen expression it replaces (powers of two scale exactly; the conversions
// are the same c10 conversions), so the states are bitwise those of flashcodec::append twice and the output bitwise
// that of the CPU kernel of flashcodec::codec_attention after them. A normalized stream's first append past its sinks
// (the one that measures its channel exponents) is left to the launcher (the separate kernels), before anything is
// written.
//
// AppendAttention is one pair of codecs' entry: the argument layouts the launcher validated (shapes, dtypes, devices,
// with the plans of their head_dim), so that a step whose layout is known runs no Python check; a call with another
// layout returns None before changing anything, and the launcher validates it (admit) or runs the reference.

namespace fc {

// The layout a call's arguments have, as a flat key: dtype, device, rank and sizes of every tensor (the mask's first
// three dims: its last one, the positions, may grow), -1 for an absent optional.
class LayoutKey {
 public:
  void clear() { key_.clear(); }
  void add(const at::Tensor& t, int64_t dims = 8) {
    key_.push_back(static_cast<int64_t>(t.scalar_type()));
    key_.push_back(static_cast<int64_t>(t.device().type()));
    key_.push_back(t.dim());
    for (int64_t d = 0; d < std::min<int64_t>(t.dim(), dims); ++d) key_.push_back(t.size(d));
  }
  void add(const c10::optional<at::Tensor>& t, int64_t dims = 8) {
    if (t.has_value()) add(*t, dims);
    else key_.push_back(-1);
  }
  void add(const std::vector<at::Tensor>& ts) {
    key_.push_back(static_cast<int64_t>(ts.size()));
    for (const at::Tensor& t : ts) add(t);
  }
  const std::vector<int64_t>& key() const { return key_; }

 private:
  std::vector<int64_t> key_;
};

inline void layout_key(LayoutKey& key, const at::Tensor& q, const std::vector<at::Tensor>& ks,
                       const std::vector<at::Tensor>& vs, const at::Tensor& kn, const at::Tensor& vn,
                       const c10::optional<at::Tensor>& mask, const c10::optional<at::Tensor>& sinks,
                       const c10::optional<at::Tensor>& alibi) {
  key.clear();
  key.add(q);
  key.add(ks);
  key.add(vs);
  key.add(kn);
  key.add(vn);
  key.add(mask, 3);
  key.add(sinks);
  key.add(alibi);
}

// n = 2 ** norm (channel_factors) of a normalized stream, (B, H, D) fp32 into out; false (nothing written) when the
// stream is not normalized or every exponent is zero (n = 1: the launchers' host=True path skips the scaling).
inline bool channel_factors(const at::Tensor& norm, float* out) {
  if (norm.numel() == 0) return false;
  const at::Tensor n = norm.is_contiguous() ? norm : norm.contiguous();
  const uint8_t* e = n.data_ptr<uint8_t>();
  bool any = false;
  for (int64_t i = 0; i < n.numel(); ++i) {  // 2 ** e as torch.exp2 gives it: exact, inf from 2 ** 128 on
    const uint32_t bits = e[i] < 128 ? static_cast<uint32_t>(e[i] + 127) << 23 : 0x7F800000u;
    std::memcpy(out + i, &bits, sizeof(float));
    any = any || e[i] != 0;
  }
  return any;
}

// Rows (B, H, T, D) of dtype xt -> contiguous rows of dtype ot: `x.to(ot)`, then times (mul) or divided by (!mul) the
// factors n (per (b, h) row of D, null: none) as ATen rounds `y * n.to(ot)` / `y / n.to(ot)`. `group`: rows of x per
// row of n (query heads per kv head).
inline void scaled_rows(const Rows& x, int64_t B, int64_t H, int64_t T, int D, at::ScalarType ot, const float* n,
                        int64_t group, bool mul, char* out) {
  const int64_t elem = static_cast<int64_t>(c10::elementSize(ot));
  float* row = workspace(kWorkRows, 2LL * D);
  float* nr = row + D;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      if (n != nullptr)
        for (int d = 0; d < D; ++d) nr[d] = round_to(n[((b * (H / group)) + h / group) * D + d], ot);
      for (int64_t t = 0; t < T; ++t) {
        if (x.dtype == at::kFloat && ot == at::kFloat && n != nullptr) {  // fp32 streams: one product per value
          const float* src = reinterpret_cast<const float*>(x.at(b, h, t));
          float* dst = reinterpret_cast<float*>(out + ((b * H + h) * T + t) * D * elem);
          if (mul) {
#pragma omp simd
            for (int d = 0; d < D; ++d) dst[d] = src[d] * nr[d];
          } else {
#pragma omp simd
            for (int d = 0; d < D; ++d) dst[d] = src[d] / nr[d];
          }
          continue;
        }
        to_float(x.at(b, h, t), x.dtype, row, D);
        if (x.dtype != ot)
          for (int d = 0; d < D; ++d) row[d] = round_to(row[d], ot);
        if (n != nullptr) {
          if (mul) {
            for (int d = 0; d < D; ++d) row[d] = round_to(row[d] * nr[d], ot);
          } else {
            for (int d = 0; d < D; ++d) row[d] = round_to(row[d] / nr[d], ot);
          }
        }
        from_float(row, ot, out + ((b * H + h) * T + t) * D * elem, D);
      }
    }
}

struct StepLayout {
  std::vector<int64_t> key;
  int64_t k_plan, v_plan;
};

class AppendAttention {
 public:
  static constexpr size_t kMaxLayouts = 64;

  // Remember a layout the launcher validated, with the plans (register_plan) of its head_dim.
  void admit(const at::Tensor& q, const std::vector<at::Tensor>& ks, const std::vector<at::Tensor>& vs,
             const at::Tensor& kn, const at::Tensor& vn, const c10::optional<at::Tensor>& mask,
             const c10::optional<at::Tensor>& sinks, const c10::optional<at::Tensor>& alibi, int64_t k_plan,
             int64_t v_plan) {
    PlanRegistry::get().at(k_plan);
    PlanRegistry::get().at(v_plan);
    LayoutKey key;
    layout_key(key, q, ks, vs, kn, vn, mask, sinks, alibi);
    if (find(key.key()) != nullptr) return;
    if (layouts_.size() >= kMaxLayouts) layouts_.clear();
    layouts_.push_back({key.key(), k_plan, v_plan});
  }

  // The step, or None (nothing changed) for a layout not admitted, an invalid softcap or a measuring append.
  c10::optional<at::Tensor> call(const at::Tensor& q, const std::vector<at::Tensor>& ks,
                                 const std::vector<at::Tensor>& vs, const at::Tensor& kn, const at::Tensor& vn,
                                 const c10::optional<at::Tensor>& mask, c10::optional<double> scale,
                                 c10::optional<double> softcap, const c10::optional<at::Tensor>& sinks,
                                 const c10::optional<at::Tensor>& alibi) {
    thread_local LayoutKey key;
    layout_key(key, q, ks, vs, kn, vn, mask, sinks, alibi);
    const StepLayout* layout = find(key.key());
    if (layout == nullptr) return c10::nullopt;
    if (softcap.has_value() && !(std::isfinite(*softcap) && *softcap > 0.0)) return c10::nullopt;
    PlanEntry& ke = PlanRegistry::get().at(layout->k_plan);
    PlanEntry& ve = PlanRegistry::get().at(layout->v_plan);
    const int64_t T = kn.size(2);
    if (measures(ke.codec, ks, T) || measures(ve.codec, vs, T)) return c10::nullopt;
    pybind11::gil_scoped_release release;
    return step(ke, ve, q, ks, vs, kn, vn, mask, scale, softcap, sinks, alibi);
  }

 private:
  const StepLayout* find(const std::vector<int64_t>& key) const {
    for (const StepLayout& layout : layouts_)
      if (layout.key == key) return &layout;
    return nullptr;
  }

  // Whether appending T tokens to a normalized stream sets its channel exponents (normalize.measures).
  static bool measures(const Codec& c, const std::vector<at::Tensor>& st, int64_t T) {
    if (st[kStateNorm].numel() == 0) return false;
    const int64_t L = *st[kStateLength].data_ptr<int64_t>();
    return L <= c.sinks && L + T > c.sinks;
  }

  static at::Tensor step(PlanEntry& ke, PlanEntry& ve, const at::Tensor& q_in, const std::vector<at::Tensor>& ks_in,
                         const std::vector<at::Tensor>& vs_in, const at::Tensor& kn_in, const at::Tensor& vn_in,
                         const c10::optional<at::Tensor>& mask, c10::optional<double> scale,
                         c10::optional<double> softcap, const c10::optional<at::Tensor>& sinks,
                         const c10::optional<at::Tensor>& alibi) {
    const at::Tensor q = readable_rows(q_in), kn = readable_rows(kn_in), vn = readable_rows(vn_in);
    const int64_t B = q.size(0), Hq = q.size(1), Tq = q.size(2), Hkv = kn.size(1), T = kn.size(2);
    const int D = static_cast<int>(q.size(3));
    const at::ScalarType k_raw = ks_in[kStateTail].scalar_type(), v_raw = vs_in[kStateTail].scalar_type();
    // the workspace: factors, then the rows that change (aligned to floats)
    const int64_t nf = B * Hkv * D, rows = B * Hkv * T * D, qrows = B * Hq * Tq * D;
    float* base = workspace(kWorkInputs, 2 * nf + 4 * rows + qrows);
    float* nk = base;
    float* nv = base + nf;
    char* k_app = reinterpret_cast<char*>(base + 2 * nf);
    char* v_app = reinterpret_cast<char*>(base + 2 * nf + rows);
    char* k_att = reinterpret_cast<char*>(base + 2 * nf + 2 * rows);
    char* v_att = reinterpret_cast<char*>(base + 2 * nf + 3 * rows);
    char* q_att = reinterpret_cast<char*>(base + 2 * nf + 4 * rows);
    const bool k_norm = channel_factors(ks_in[kStateNorm], nk), v_norm = channel_factors(vs_in[kStateNorm], nv);
    const Rows kr(kn), vr(vn);
    // the appends: tokens in the raw rows' dtype, divided by n
    const auto append_one = [&](PlanEntry& e, const std::vector<at::Tensor>& st, const at::Tensor& x, const Rows& xr,
                                at::ScalarType raw, bool norm, const float* n, char* buf) {
      if (x.scalar_type() == raw && !norm) {
        append_tokens(st, NewTokens(x), e.codec, Matrices(e.tensors), &e, c10::nullopt);
        return;
      }
      scaled_rows(xr, B, Hkv, T, D, raw, norm ? n : nullptr, 1, false, buf);
      append_tokens(st, NewTokens(buf, raw, B, Hkv, T, D), e.codec, Matrices(e.tensors), &e, c10::nullopt);
    };
    append_one(ke, ks_in, kn, kr, k_raw, k_norm, nk, k_app);
    append_one(ve, vs_in, vn, vr, v_raw, v_norm, nv, v_app);
    // attention on the stored domain
    const std::vector<at::Tensor> k_state = readable_state(ks_in), v_state = readable_state(vs_in);
    const Stream kstream(ke.codec, k_state), vstream(ve.codec, v_state);
    at::Tensor sink_logits, slopes;  // held for the call
    const Variants var = variants(Hq, softcap.has_value() ? *softcap : 0.0, sinks, alibi, sink_logits, slopes);
    AttentionInput in;
    in.B = B; in.Hq = Hq; in.Tq = Tq; in.Hkv = Hkv; in.D = D; in.tn = T;
    const at::ScalarType qt = q.scalar_type(), kt = kn.scalar_type(), vt = vn.scalar_type();
    const auto contiguous = [&](const char* p, at::ScalarType t, int64_t H, int64_t N) {
      const int64_t elem = static_cast<int64_t>(c10::elementSize(t));
      return Rows(p, t, H * N * D * elem, N * D * elem, D * elem);
    };
    if (k_norm) {
      scaled_rows(Rows(q), B, Hq, Tq, D, qt, nk, Hq / Hkv, true, q_att);
      in.q = contiguous(q_att, qt, Hq, Tq);
      scaled_rows(kr, B, Hkv, T, D, kt, nk, 1, false, k_att);
      in.knew = contiguous(k_att, kt, Hkv, T);
    } else {
      in.q = Rows(q);
      in.knew = kr;
    }
    if (v_norm) {
      scaled_rows(vr, B, Hkv, T, D, vt, nv, 1, false, v_att);
      in.vnew = contiguous(v_att, vt, Hkv, T);
      in.out_factors = nv;
    } else {
      in.vnew = vr;
    }
    in.mask = &mask;
    in.scale = scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(D));
    in.simd = true;
    at::Tensor out = at::empty(q_in.sizes(), q_in.options().memory_format(at::MemoryFormat::Contiguous));
    run_codec_attention(in, kstream, vstream, var, out);
    return out;
  }

  std::vector<StepLayout> layouts_;
};

// codec_attention with registered plans (register_plan): no parsing of the plans' tensors per call.
at::Tensor codec_attention_plans(const at::Tensor& q_in, const std::vector<at::Tensor>& k_in,
                                 const std::vector<at::Tensor>& v_in, int64_t k_plan, int64_t v_plan,
                                 const c10::optional<at::Tensor>& k_new, const c10::optional<at::Tensor>& v_new,
                                 const c10::optional<at::Tensor>& mask, double scale, bool simd, double softcap,
                                 const c10::optional<at::Tensor>& sinks, const c10::optional<at::Tensor>& alibi) {
  const PlanEntry& ke = PlanRegistry::get().at(k_plan);
  const PlanEntry& ve = PlanRegistry::get().at(v_plan);
  return codec_attention_codecs(q_in, k_in, v_in, ke.codec, ve.codec, k_new, v_new, mask, scale, simd, softcap, sinks,
                                alibi);
}

}  // namespace fc
