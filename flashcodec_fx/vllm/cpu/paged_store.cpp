// Store into vLLM pages on the CPU (the spec: vllm/reference.py store_reference). The launcher says where each token
// goes (page.py store_plan: a raw row, a code slot, the block whose raw key rows center its key). Raw rows are copied
// first; then coded keys are centered on the mean of their mean block's raw key rows (added in the reference's
// order), rotated with the reference's own ATen product (the coded tokens' (n, H, 1, D) fp32 rows times R^T, as
// codec.prepare computes it, so BLAS rounds it identically) and quantized by quantize.h's quantizer (torch's
// summation order; trellis codes, levels="tcq": trellis.h's Viterbi encoder, its sums sequential as the reference's):
// the bytes are the reference's, bitwise.

namespace fc {

namespace {

// Coded tokens' rows of one stream, (n * H, D) fp32 at `out`, minus their page mean when `centers` (mean blocks' raw
// key rows), rotated as the reference's encode (its 1x1 DCT: the identity): the (n * H, D) rows times R^T in one BLAS
// product, the one the reference's matmul folds its (n, H, 1, D) rows into. `out` and `scratch` (the rows before the
// rotation) are thread-local workspaces kept between calls: fresh buffers of a prefill's size page-fault every call.
void prepared_rows(const TokenRows& x, const std::vector<int64_t>& tokens, int64_t H, int64_t D, const Codec& c,
                   const std::vector<at::Tensor>& plan, const PageLayout& p, uint8_t* base, const int64_t* centers,
                   float* out, float* scratch) {
  const int64_t n = static_cast<int64_t>(tokens.size());
  float* pr = c.rotate ? scratch : out;
  at::parallel_for(0, n * H, 64, [&](int64_t i0, int64_t i1) {
    std::vector<float> mean(D), row(D);
    for (int64_t i = i0; i < i1; ++i) {
      float* dst = pr + i * D;
      to_float(x.at(tokens[i / H], i % H), x.dtype, dst, static_cast<int>(D));
      if (centers == nullptr) continue;
      p.key_mean(p.page(base, centers[tokens[i / H]], i % H), mean.data(), row.data());
      for (int64_t d = 0; d < D; ++d) dst[d] -= mean[d];
    }
  });
  if (!c.rotate) return;
  const auto fp32 = at::TensorOptions().dtype(at::kFloat);
  at::Tensor rotated = at::from_blob(out, {n * H, D}, fp32);
  at::mm_out(rotated, at::from_blob(scratch, {n * H, D}, fp32), plan[4].t());
}

}  // namespace

// `raw_row`, `code_slot`, `mean_block` (N,) int64: the store plan (page.py StorePlan; -1: nowhere).
void paged_store(const at::Tensor& key, const at::Tensor& value, const at::Tensor& cache, const at::Tensor& slot_mapping,
                 const at::Tensor& raw_row, const at::Tensor& code_slot, const at::Tensor& mean_block,
                 const at::Tensor& page_meta, const std::vector<at::Tensor>& kplan, const std::vector<at::Tensor>& vplan) {
  const TokenRows k(key), v(value);
  const int64_t D = key.size(2), H = key.size(1), N = slot_mapping.size(0);
  const PageLayout p = PageLayout::parse(page_meta, cache, key.scalar_type(), D);
  for (const at::Tensor* t : {&slot_mapping, &raw_row, &code_slot, &mean_block})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == N,
                "slot_mapping and the store plan: (N,) int64");
  uint8_t* base = cache.data_ptr<uint8_t>();
  const int64_t *slots = slot_mapping.data_ptr<int64_t>(), *raws = raw_row.data_ptr<int64_t>();
  const int64_t *codes_at = code_slot.data_ptr<int64_t>(), *centers = mean_block.data_ptr<int64_t>();
  const int64_t row = p.row_bytes();
  std::vector<int64_t> coded;
  for (int64_t n = 0; n < N; ++n)
    if (codes_at[n] >= 0) coded.push_back(n);
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      if (raws[n] < 0) continue;
      for (int64_t h = 0; h < H; ++h) {
        uint8_t* dst = p.page(base, slots[n] / p.bs, h) + p.raw_at(raws[n]);
        std::memcpy(dst, k.at(n, h), row);
        std::memcpy(dst + row, v.at(n, h), row);
      }
    }
  });
  if (coded.empty()) return;
  const Codec ck = Codec::parse(kplan), cv = Codec::parse(vplan);
  TORCH_CHECK(ck.r == 1 && ck.dense == 1 && cv.r == 1 && cv.dense == 1, "page slots hold one-token blocks");
  const int64_t n_coded = static_cast<int64_t>(coded.size()), used = p.v_code + cv.row_bytes;
  float* pk = workspace(kWorkTransform, n_coded * H * D);
  float* pv = workspace(kWorkRows, n_coded * H * D);
  float* scratch = workspace(kWorkInputs, n_coded * H * D);
  prepared_rows(k, coded, H, D, ck, kplan, p, base, p.center ? centers : nullptr, pk, scratch);
  prepared_rows(v, coded, H, D, cv, vplan, p, base, nullptr, pv, scratch);
  at::parallel_for(0, n_coded * H, 16, [&](int64_t i0, int64_t i1) {
    std::vector<float> xbuf, sq;
    std::vector<int> rbuf;
    std::vector<int32_t> cbuf, codes;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t n = coded[i / H];
      uint8_t* slot = p.page(base, slots[n] / p.bs, i % H) + p.code_at(codes_at[n]);
      const Slot ks{reinterpret_cast<char*>(slot + p.k_code), reinterpret_cast<at::Half*>(slot + p.k_scale),
                    reinterpret_cast<at::Half*>(slot + p.k_zero), nullptr};
      const Slot vs{reinterpret_cast<char*>(slot + p.v_code), reinterpret_cast<at::Half*>(slot + p.v_scale),
                    reinterpret_cast<at::Half*>(slot + p.v_zero), nullptr};
      quantize_group(ck, pk + i * D, ks, xbuf, rbuf, cbuf, codes, sq);
      quantize_group(cv, pv + i * D, vs, xbuf, rbuf, cbuf, codes, sq);
      std::memset(slot + used, 0, p.slot - used);  // the slot's padding, as the reference writes it
    }
  });
}

}  // namespace fc
