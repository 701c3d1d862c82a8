// The page layout of flashcodec_fx/vllm/page.py (PageFormat), as the launcher passes it (kernels.py PAGE_FIELDS):
// one (block, KV head) page of a uint8 cache (num_blocks, H, block_size, C) is `raw_rows` raw rows (K then V, the
// model's dtype), then one code slot per other token (fp16 scales / zero points of K and V, K codes, V codes).
// Concatenated after ops/cpu/common.h and ops/cpu/append.cpp (the quantizer), before the paged kernels.

namespace fc {

struct PageLayout {
  int64_t anchors = 0, raw = 0, slot = 0;  // raw rows asked for, every row raw (a raw format), code slot bytes
  int64_t k_scale = 0, k_zero = 0, k_code = 0, v_scale = 0, v_zero = 0, v_code = 0;  // field offsets in a slot
  int64_t bs = 0, heads = 0, head_dim = 0, elem = 0;  // block size, KV heads, D, bytes per raw value
  int64_t block_stride = 0, head_stride = 0;          // cache strides (bytes) of dims 0 and 1
  at::ScalarType dtype = at::kFloat;                   // raw rows

  static PageLayout parse(const at::Tensor& meta, const at::Tensor& cache, at::ScalarType dtype, int64_t head_dim) {
    TORCH_CHECK(meta.numel() == 9 && meta.scalar_type() == at::kLong, "page meta: expected 9 int64 fields");
    TORCH_CHECK(cache.scalar_type() == at::kByte && cache.dim() == 4, "cache: expected uint8 (blocks, H, bs, C)");
    TORCH_CHECK(cache.stride(3) == 1 && cache.stride(2) == cache.size(3), "cache: pages must be contiguous");
    const int64_t* m = meta.data_ptr<int64_t>();
    PageLayout p;
    p.anchors = m[0]; p.raw = m[1]; p.slot = m[2];
    p.k_scale = m[3]; p.k_zero = m[4]; p.k_code = m[5]; p.v_scale = m[6]; p.v_zero = m[7]; p.v_code = m[8];
    p.bs = cache.size(2); p.heads = cache.size(1); p.head_dim = head_dim;
    p.dtype = dtype; p.elem = c10::elementSize(dtype);
    p.block_stride = cache.stride(0); p.head_stride = cache.stride(1);
    return p;
  }
  int64_t raw_rows() const { return raw ? bs : std::min(anchors, bs); }
  int64_t raw_row_bytes() const { return 2 * head_dim * elem; }
  int64_t row_bytes() const { return head_dim * elem; }  // one of K, V
  // Start of the page of (block, head), of raw row `offset` (offset < raw_rows()), of the code slot of `offset`.
  uint8_t* page(uint8_t* cache, int64_t block, int64_t head) const {
    return cache + block * block_stride + head * head_stride;
  }
  int64_t raw_at(int64_t offset) const { return offset * raw_row_bytes(); }
  int64_t slot_at(int64_t offset) const { return raw_rows() * raw_row_bytes() + (offset - raw_rows()) * slot; }
};

// A call's requests as vLLM's metadata gives them (int32): block-table rows, sequence lengths (history and this call),
// query starts (R + 1: request r's tokens of this call are rows starts[r] .. starts[r + 1] - 1).
struct Requests {
  const int32_t *table, *lens, *starts;
  int64_t table_stride, count;
  Requests(const at::Tensor& block_table, const at::Tensor& seq_lens, const at::Tensor& query_start_loc)
      : table(block_table.data_ptr<int32_t>()), lens(seq_lens.data_ptr<int32_t>()),
        starts(query_start_loc.data_ptr<int32_t>()), table_stride(block_table.stride(0)), count(seq_lens.size(0)) {
    TORCH_CHECK(block_table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                    query_start_loc.scalar_type() == at::kInt,
                "block_table, seq_lens, query_start_loc: int32");
  }
  int64_t tokens(int64_t r) const { return starts[r + 1] - starts[r]; }
  int64_t history(int64_t r) const { return lens[r] - tokens(r); }
  int64_t block(int64_t r, int64_t i) const { return table[r * table_stride + i]; }
};

// The K and V codecs of a format's code slots (parsed from the launcher's plans; none for a raw format) and their
// rotations (R, D x D row-major: a stored row is x R^T; null without rotation).
struct SlotCodecs {
  Codec k, v;
  const float *rot_k = nullptr, *rot_v = nullptr;
  SlotCodecs(const PageLayout& p, const std::vector<at::Tensor>& kplan, const std::vector<at::Tensor>& vplan) {
    if (p.raw) return;
    k = Codec::parse(kplan);
    v = Codec::parse(vplan);
    rot_k = k.rotate ? k.rot : nullptr;
    rot_v = v.rotate ? v.rot : nullptr;
  }
};

// An fp16 field of a code slot (scale, zero point) as a float.
inline float half_at(const uint8_t* p) { return static_cast<float>(*reinterpret_cast<const at::Half*>(p)); }

// Rows (N, H, D) of any strides with a contiguous last dim (query, key, value, out).
struct TokenRows {
  char* ptr = nullptr;
  at::ScalarType dtype = at::kFloat;
  int64_t sn = 0, sh = 0, elem = 0;  // bytes
  explicit TokenRows(const at::Tensor& t)
      : ptr(static_cast<char*>(t.data_ptr())), dtype(t.scalar_type()), sn(t.stride(0) * t.element_size()),
        sh(t.stride(1) * t.element_size()), elem(t.element_size()) {
    TORCH_CHECK(t.dim() == 3 && (t.size(2) == 1 || t.stride(2) == 1), "token rows: expected (N, H, D), D contiguous");
  }
  char* at(int64_t n, int64_t h) const { return ptr + n * sn + h * sh; }
};

}  // namespace fc
