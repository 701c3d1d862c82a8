// Store into vLLM pages on the CPU (the spec: vllm/reference.py store_reference). A token whose slot offset is
// below the page's raw rows is copied raw; the others are rotated with the reference's own ATen product (the coded
// tokens' (n, H, 1, D) fp32 rows times R^T, as codec.prepare computes it, so BLAS rounds it identically) and
// quantized by append.cpp's quantizer (torch's summation order): the bytes are the reference's, bitwise.

namespace fc {

namespace {

// Coded tokens' rows of one stream, (n, H, 1, D) fp32, rotated as the reference's encode (its 1x1 DCT: the identity).
at::Tensor prepared_rows(const TokenRows& x, const std::vector<int64_t>& tokens, int64_t H, int64_t D,
                         const Codec& c, const std::vector<at::Tensor>& plan) {
  const int64_t n = static_cast<int64_t>(tokens.size());
  at::Tensor rows = at::empty({n, H, 1, D}, at::TensorOptions().dtype(at::kFloat));
  float* pr = rows.data_ptr<float>();
  at::parallel_for(0, n * H, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) to_float(x.at(tokens[i / H], i % H), x.dtype, pr + i * D, static_cast<int>(D));
  });
  if (c.rotate) rows = at::matmul(rows, plan[4].t());
  return rows.contiguous();  // the 1x1 DCT (analysis @ blocks) is [[1.0]] @ row: the row itself
}

}  // namespace

void paged_store(const at::Tensor& key, const at::Tensor& value, const at::Tensor& cache, const at::Tensor& slot_mapping,
                 const at::Tensor& page_meta, const std::vector<at::Tensor>& kplan, const std::vector<at::Tensor>& vplan) {
  const TokenRows k(key), v(value);
  const int64_t D = key.size(2), H = key.size(1), N = slot_mapping.size(0);
  const PageLayout p = PageLayout::parse(page_meta, cache, key.scalar_type(), D);
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "slot_mapping: int64");
  uint8_t* base = cache.data_ptr<uint8_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t raw_rows = p.raw_rows(), row = p.row_bytes();
  std::vector<int64_t> coded;
  for (int64_t n = 0; n < N; ++n)
    if (slots[n] >= 0 && slots[n] % p.bs >= raw_rows) coded.push_back(n);
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const int64_t s = slots[n], off = s % p.bs;
      if (s < 0 || off >= raw_rows) continue;
      for (int64_t h = 0; h < H; ++h) {
        uint8_t* dst = p.page(base, s / p.bs, h) + p.raw_at(off);
        std::memcpy(dst, k.at(n, h), row);
        std::memcpy(dst + row, v.at(n, h), row);
      }
    }
  });
  if (coded.empty()) return;
  const Codec ck = Codec::parse(kplan), cv = Codec::parse(vplan);
  TORCH_CHECK(ck.r == 1 && ck.dense == 1 && cv.r == 1 && cv.dense == 1, "page slots hold one-token blocks");
  const at::Tensor xk = prepared_rows(k, coded, H, D, ck, kplan), xv = prepared_rows(v, coded, H, D, cv, vplan);
  const float *pk = xk.data_ptr<float>(), *pv = xv.data_ptr<float>();
  const int64_t n_coded = static_cast<int64_t>(coded.size()), used = p.v_code + cv.row_bytes;
  at::parallel_for(0, n_coded * H, 16, [&](int64_t i0, int64_t i1) {
    std::vector<float> xbuf, sq;
    std::vector<int> rbuf;
    std::vector<int32_t> cbuf, codes;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t s = slots[coded[i / H]];
      uint8_t* slot = p.page(base, s / p.bs, i % H) + p.slot_at(s % p.bs);
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
