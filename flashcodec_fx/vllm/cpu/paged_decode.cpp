// The keys and values one request's pages hold, decoded (the spec: vllm/reference.py decode_pages): raw rows as
// stored, code slots as level * scale + zero rotated back (x R). For the launcher's dense path of long prefill chunks
// (kernels.py), which needs the history once per call as fp32 rows for torch's flash attention.

namespace fc {

namespace {

// One code slot's stream (K or V) into `out` (D floats): levels, scale and zero point, then R^T (x_rot @ R).
void decode_slot(const Codec& c, const uint8_t* slot, int64_t code, int64_t scale_at, int64_t zero_at, int D,
                 int32_t* codes, float* rotated, float* out) {
  row_levels(c, slot + code, 0, codes, rotated);
  const float s = static_cast<float>(*reinterpret_cast<const at::Half*>(slot + scale_at));
  const float z = c.zero_classes ? static_cast<float>(*reinterpret_cast<const at::Half*>(slot + zero_at)) : 0.0f;
  for (int d = 0; d < D; ++d) rotated[d] = rotated[d] * s + z;
  if (!c.rotate) {
    std::memcpy(out, rotated, sizeof(float) * D);
    return;
  }
  std::fill(out, out + D, 0.0f);
  for (int e = 0; e < D; ++e) axpy(out, rotated[e], c.rot + e * D, D);
}

}  // namespace

// Positions 0 .. length - 1 of the sequence whose pages are `blocks` (int64, in order): (K, V), (H, length, D) fp32.
std::vector<at::Tensor> paged_decode(const at::Tensor& cache, const at::Tensor& blocks, int64_t length,
                                     int64_t head_dim, at::ScalarType dtype, const at::Tensor& page_meta,
                                     const std::vector<at::Tensor>& kplan, const std::vector<at::Tensor>& vplan) {
  const int D = static_cast<int>(head_dim);
  const PageLayout p = PageLayout::parse(page_meta, cache, dtype, D);
  TORCH_CHECK(blocks.scalar_type() == at::kLong && blocks.is_contiguous(), "blocks: int64");
  TORCH_CHECK(blocks.numel() * p.bs >= length, "blocks: too few pages for the length");
  const int64_t H = p.heads, bs = p.bs, raw_rows = p.raw_rows(), half = p.row_bytes();
  Codec ck, cv;
  if (!p.raw) { ck = Codec::parse(kplan); cv = Codec::parse(vplan); }
  at::Tensor keys = at::empty({H, length, D}, at::TensorOptions().dtype(at::kFloat));
  at::Tensor values = at::empty({H, length, D}, at::TensorOptions().dtype(at::kFloat));
  float *pk = keys.data_ptr<float>(), *pv = values.data_ptr<float>();
  const int64_t* bt = blocks.data_ptr<int64_t>();
  uint8_t* base = cache.data_ptr<uint8_t>();
  at::parallel_for(0, H * length, 256, [&](int64_t i0, int64_t i1) {
    std::vector<int32_t> codes(D);
    std::vector<float> rotated(D);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t h = i / length, pos = i % length, off = pos % bs;
      const uint8_t* page = p.page(base, bt[pos / bs], h);
      if (off < raw_rows) {
        to_float(page + p.raw_at(off), p.dtype, pk + i * D, D);
        to_float(page + p.raw_at(off) + half, p.dtype, pv + i * D, D);
        continue;
      }
      const uint8_t* slot = page + p.slot_at(off);
      decode_slot(ck, slot, p.k_code, p.k_scale, p.k_zero, D, codes.data(), rotated.data(), pk + i * D);
      decode_slot(cv, slot, p.v_code, p.v_scale, p.v_zero, D, codes.data(), rotated.data(), pv + i * D);
    }
  });
  return {keys, values};
}

}  // namespace fc
