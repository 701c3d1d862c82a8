// The page layout of flashcodec_fx/vllm/page.py (PageFormat), as the launcher passes it (PageFormat.meta()): one
// (block, KV head) page of a uint8 cache (num_blocks, H, block_size, C) is `raw_rows` raw rows (K then V, the model's
// dtype), then one code slot per other token (fp16 scales / zero points of K and V, K codes, V codes). Which token
// sits where is page.py's (store_plan: the store is told; history_rows: the readers compute it, PageLayout::read).
// Concatenated after ops/cpu/common.h and ops/cpu/quantize.h (the quantizer), before the paged kernels.

#include <atomic>

namespace fc {

// page.py PAGE_FIELDS, by name and in its order (tests/vllm/test_page.py checks these names against it).
enum PageField : int { kAnchors, kRaw, kCenter, kSlot, kKScale, kKZero, kKCode, kVScale, kVZero, kVCode, kPageFields };
static_assert(kPageFields == 10, "page.py PAGE_FIELDS has 10 fields");

struct PageLayout {
  int64_t anchors = 0, raw = 0, center = 0, slot = 0;  // raw rows asked for, every row raw, centered keys, slot bytes
  int64_t k_scale = 0, k_zero = 0, k_code = 0, v_scale = 0, v_zero = 0, v_code = 0;  // field offsets in a slot
  int64_t bs = 0, heads = 0, head_dim = 0, elem = 0;  // block size, KV heads, D, bytes per raw value
  int64_t block_stride = 0, head_stride = 0;          // cache strides (bytes) of dims 0 and 1
  at::ScalarType dtype = at::kFloat;                   // raw rows

  static PageLayout parse(const at::Tensor& meta, const at::Tensor& cache, at::ScalarType dtype, int64_t head_dim) {
    TORCH_CHECK(meta.numel() == kPageFields && meta.scalar_type() == at::kLong, "page meta: expected PAGE_FIELDS");
    TORCH_CHECK(cache.scalar_type() == at::kByte && cache.dim() == 4, "cache: expected uint8 (blocks, H, bs, C)");
    TORCH_CHECK(cache.stride(3) == 1 && cache.stride(2) == cache.size(3), "cache: pages must be contiguous");
    const int64_t* m = meta.data_ptr<int64_t>();
    PageLayout p;
    p.anchors = m[kAnchors]; p.raw = m[kRaw]; p.center = m[kCenter]; p.slot = m[kSlot];
    p.k_scale = m[kKScale]; p.k_zero = m[kKZero]; p.k_code = m[kKCode];
    p.v_scale = m[kVScale]; p.v_zero = m[kVZero]; p.v_code = m[kVCode];
    p.bs = cache.size(2); p.heads = cache.size(1); p.head_dim = head_dim;
    p.dtype = dtype; p.elem = c10::elementSize(dtype);
    p.block_stride = cache.stride(0); p.head_stride = cache.stride(1);
    return p;
  }
  int64_t raw_rows() const { return raw ? bs : std::min(anchors, bs); }
  int64_t raw_row_bytes() const { return 2 * head_dim * elem; }
  int64_t row_bytes() const { return head_dim * elem; }  // one of K, V
  // Start of the page of (block, head), of raw row `row` (< raw_rows()), of code slot `index` (< bs - raw_rows()).
  uint8_t* page(uint8_t* cache, int64_t block, int64_t head) const {
    return cache + block * block_stride + head * head_stride;
  }
  int64_t raw_at(int64_t row) const { return row * raw_row_bytes(); }
  int64_t code_at(int64_t index) const { return raw_rows() * raw_row_bytes() + index * slot; }
  // Where offset `off` of page `index` (of a sequence) is read from by a call that stored up to `total` positions,
  // the page holding `held` of the history (page.py history_rows): a raw row (>= 0), or -1 - code slot index.
  int64_t read(int64_t index, int64_t off, int64_t held, int64_t total) const {
    const int64_t a = raw_rows();
    if (raw) return off;
    if (index == 0) return off < a ? off : -1 - (off - a);
    const int64_t ring_from = total - index * bs >= bs ? bs - a : held - a;
    return off >= ring_from ? off % a : -1 - off;
  }
  // The mean of a page's raw key rows, rows added in order then divided by their count (reference.raw_key_mean).
  void key_mean(const uint8_t* page, float* mean, float* row) const {
    const int D = static_cast<int>(head_dim);
    to_float(page + raw_at(0), dtype, mean, D);
    for (int64_t j = 1; j < anchors; ++j) {
      to_float(page + raw_at(j), dtype, row, D);
      for (int d = 0; d < D; ++d) mean[d] += row[d];
    }
    for (int d = 0; d < D; ++d) mean[d] /= static_cast<float>(anchors);
  }
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

// Items [0, n) handed out one at a time from a shared counter (list the largest first): threads that claim them finish
// together however uneven the items are, where at::parallel_for's contiguous ranges would give one thread the long
// requests.
struct Claims {
  std::atomic<int64_t> next{0};
  int64_t n;
  bool take(int64_t& item) { return (item = next++) < n; }
};

// fn(claims, thread) once on each of up to `threads` of at::parallel_for's threads (never more than n): each sets up
// its scratch, then runs the items it takes. `thread` (at::get_thread_num) indexes per-thread buffers.
template <typename F>
inline void for_claimed(int64_t n, int64_t threads, const F& fn) {
  Claims claims{{0}, n};
  at::parallel_for(0, std::clamp<int64_t>(threads, 1, std::max<int64_t>(n, 1)), 1,
                   [&](int64_t, int64_t) { fn(claims, at::get_thread_num()); });
}

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
