// flashcodec::append on the CPU (spec: ops/reference/append.py): the new tokens go to the sinks and the tail; a
// group is encoded only when it completes and leaves the window, decided here from the stored length, so a decode
// step is the same call every time and runs no ATen op. When groups complete, their products run through the
// reference's own ATen expressions on the reference's shapes (centering, `x @ R.T`, `M @ blocks`; for the memo
// `A @ S`, `x @ R`) on one BLAS thread (SerialBlas), so BLAS rounds them as it rounds the reference's run with one
// BLAS thread; the quantizer of codecs/quant.py (scale search, every level set and axis) runs in C++ with torch's
// summation order (quantize.h); png Top-M goes through at::topk. The per-channel mean (once per stream) uses the reference's own
// ATen ops. The result is bitwise the reference's at one BLAS thread (MKL rounds a few small shapes differently on
// more threads: there the reference itself changes with the thread count).

namespace fc {

// --- encode / decode ------------------------------------------------------------------------------------------------

struct Buffers {
  std::vector<float> xs, tmp, sq;
  std::vector<int> rows;
  std::vector<int32_t> cbuf, codes;
};

// The plan's matrices as tensors (the same values the reference's codec uses).
struct Matrices {
  at::Tensor synth, analysis, rot;
  explicit Matrices(const std::vector<at::Tensor>& plan)
      : synth(plan[kPlanSynth]), analysis(plan[kPlanAnalysis]), rot(plan[kPlanRot]) {}
};

constexpr int64_t kMinAppendWorkPerThread = 1 << 16;  // values x passes per extra thread (~0.1 ms)

// fn(bh, slot) for every (b, h) of B * H heads, on more than one thread only when `work_per_head` (values x passes)
// gives each thread kMinAppendWorkPerThread (a decode step's append runs on the calling thread alone).
template <typename F>
inline void for_heads(int64_t heads, int64_t work_per_head, F&& fn) {
  Pool::get().run(heads, static_cast<int>(threads_for(heads * work_per_head, kMinAppendWorkPerThread) - 1), fn);
}

// Passes of the quantizer over a group's values: one per clipping factor it tries, plus the final one.
inline int64_t quant_passes(const Codec& c) {
  return c.quant == kNone ? 1 : 1 + (c.search ? std::max(c.n_shrink, c.n_lloyd) : 1);
}

// Groups k < `written` of the work buffer (row p = position start + p) -> what the codec's transform produces for
// them: jpeg coefficients (B, H, n * blocks, K, D), png prepared blocks (B, H, n, r, D); fp32. The tensors have the
// reference's shapes and layouts (its `work[:, :, :n * G]`, a slice of a (B, H, tail + T, D) buffer, stays a slice
// for fp32 streams without a center), so torch's matmul takes the same BLAS path and rounds the same way; the rows
// of the groups that are not written are zero.
template <typename Work>
at::Tensor transform_groups(const Codec& c, const Matrices& mx, const Stream& s, int64_t B, int64_t H, int64_t T,
                            int64_t n, int64_t written, Work&& work) {
  const int64_t D = c.head_dim, G = c.group, rows = c.tail_cap + T;
  at::Tensor buffer = at::zeros({B, H, rows, D}, at::TensorOptions().dtype(at::kFloat));
  float* px = buffer.data_ptr<float>();
  for_heads(B * H, written * G * D, [&](int64_t bh, int) {
    const int64_t b = bh / H, h = bh % H;
    const float* mean = c.center ? s.mean.at(b, h) : nullptr;
    for (int64_t p = 0; p < written * G; ++p) {
      float* row = px + (bh * rows + p) * D;
      to_float(work(b, h, p), s.dtype, row, static_cast<int>(D));
      if (mean != nullptr)
        for (int64_t d = 0; d < D; ++d) row[d] = row[d] - mean[d];
    }
  });
  at::Tensor x = buffer.narrow(2, 0, n * G);
  if (c.center || s.dtype != at::kFloat) x = x.contiguous();  // there the reference's x is a new tensor
  if (c.rotate) x = at::matmul(x, mx.rot.t());
  at::Tensor blocks = x.reshape({B, H, n * G / c.r, c.r, D});
  // jpeg's analysis of one-token blocks is [[1.0]]: its product is the blocks themselves (a value times 1.0, exactly)
  const bool identity = !c.jpeg || (c.r == 1 && c.rows == 1);
  return (identity ? blocks : at::matmul(mx.analysis, blocks)).contiguous();
}

// One written group from its transform (`rows`: the group's g x K x D coefficients, or png's r x D block).
void store_group(const Codec& c, at::ScalarType data_dtype, const float* rows, const Slot& slot, Buffers& buf) {
  const int D = c.head_dim, r = c.r;
  if (c.jpeg) {
    if (c.quant == kNone) {
      from_float(rows, data_dtype, slot.data, c.rows * D);
    } else {
      quantize_group(c, rows, slot, buf.xs, buf.rows, buf.cbuf, buf.codes, buf.sq);
    }
    return;
  }
  float* data = reinterpret_cast<float*>(slot.data);  // png: anchor, then the deltas (or the kept ones)
  std::memcpy(data, rows, sizeof(float) * D);
  float* deltas = c.pruned ? (buf.tmp.resize(static_cast<size_t>(r - 1) * D), buf.tmp.data()) : data + D;
  for (int i = 1; i < r; ++i)
    for (int d = 0; d < D; ++d) deltas[(i - 1) * D + d] = rows[i * D + d] - rows[(i - 1) * D + d];
  if (!c.pruned) return;
  at::Tensor all = at::from_blob(deltas, {1, r - 1, D}, at::TensorOptions().dtype(at::kFloat));
  at::Tensor top = std::get<1>(at::topk(all.abs(), c.pruned, 1, true, false));
  const int64_t* idx = top.data_ptr<int64_t>();
  for (int i = 0; i < c.pruned; ++i)
    for (int d = 0; d < D; ++d) {
      const int64_t row = idx[i * D + d];
      data[(1 + i) * D + d] = deltas[row * D + d];
      slot.index[i * D + d] = static_cast<uint8_t>(row);
    }
}

// Dense stored rows (R x D, fp32, scales applied as the reference's dequantize does) of block `blk` of a slot.
void dense_rows(const Codec& c, at::ScalarType data_dtype, const Slot& slot, int blk, float* out, int32_t* codes) {
  const int D = c.head_dim;
  if (c.quant != kNone) {
    const uint8_t* block = reinterpret_cast<const uint8_t*>(slot.data) + blk * c.row_bytes;
    for (int j = 0; j < c.rows; ++j) {
      float* dst = out + j * D;
      row_levels(c, block, j, codes, dst);
      const int k = c.row_class[j], zs = c.class_zero[k];
      for (int d = 0; d < D; ++d) {
        const float sc = c.quant == kToken ? static_cast<float>(slot.scale[blk * c.classes + k])
                                           : static_cast<float>(slot.scale[k * D + d]);
        const float zr = zs < 0 ? 0.0f
                         : c.quant == kToken ? static_cast<float>(slot.zero[blk * c.zero_classes + zs])
                                             : static_cast<float>(slot.zero[zs * D + d]);
        dst[d] = dst[d] * sc + zr;
      }
    }
  } else if (c.jpeg) {
    to_float(slot.data, data_dtype, out, c.rows * D);
  } else {
    const float* png = reinterpret_cast<const float*>(slot.data);
    if (!c.pruned) {
      std::memcpy(out, png, sizeof(float) * c.r * D);
      return;
    }
    std::memcpy(out, png, sizeof(float) * D);
    std::fill(out + D, out + c.r * D, 0.0f);
    for (int i = 0; i < c.pruned; ++i)
      for (int d = 0; d < D; ++d) out[(1 + slot.index[i * D + d]) * D + d] = png[(1 + i) * D + d];
  }
}

// The decoded tokens of the written groups (the memo's values), (B, H, n * G, D) fp32 before the mean: jpeg through
// the reference's products `A @ S` then `x @ R`, png by its sequential cumsum.
template <typename SlotAt>
at::Tensor decode_groups(const Codec& c, const Matrices& mx, at::ScalarType data_dtype, int64_t B, int64_t H,
                         int64_t n, int64_t written, SlotAt&& slot_at) {
  const int64_t D = c.head_dim, R = c.dense, nb = c.blocks;
  at::Tensor rows = at::zeros({B, H, n * nb, R, D}, at::TensorOptions().dtype(at::kFloat));
  float* pr = rows.data_ptr<float>();
  for_heads(B * H, written * nb * R * D, [&](int64_t bh, int) {
    std::vector<int32_t> codes(D);
    for (int64_t k = 0; k < written; ++k)
      for (int64_t blk = 0; blk < nb; ++blk)
        dense_rows(c, data_dtype, slot_at(bh / H, bh % H, k), static_cast<int>(blk),
                   pr + ((bh * n + k) * nb + blk) * R * D, codes.data());
  });
  if (!c.jpeg) {  // png: X[i] = X[i - 1] + S[i], in order
    float* p = pr;
    for (int64_t block = 0; block < B * H * n; ++block, p += R * D)
      for (int64_t i = 1; i < R; ++i)
        for (int64_t d = 0; d < D; ++d) p[i * D + d] = p[(i - 1) * D + d] + p[i * D + d];
    return rows.view({B, H, n * c.group, D});
  }
  const bool identity = c.r == 1 && c.dense == 1;  // one-token blocks: the synthesis is [[1.0]]
  at::Tensor x = (identity ? rows : at::matmul(mx.synth, rows)).flatten(-3, -2);
  return c.rotate ? at::matmul(x, mx.rot) : x;
}

// --- driver ----------------------------------------------------------------------------------------------------------

void append_contiguous(const std::vector<at::Tensor>& state, const at::Tensor& x_new, const std::vector<at::Tensor>& plan,
                       const c10::optional<at::Tensor>& memo) {
  const Codec c = Codec::parse(plan);
  const Matrices mx(plan);
  const SerialBlas serial;  // the products (rotation, DCT, memo decode) on this thread: no BLAS team to stall
  Stream s(c, state);
  const int64_t B = x_new.size(0), H = x_new.size(1), T = x_new.size(2), D = x_new.size(3);
  const int64_t L = s.length, end = L + T;
  if (c.center && L <= c.sinks && end > c.sinks) {  // the reference's ops, so the mean is bitwise its own
    const at::Tensor& length = state[kStateLength];
    at::Tensor counted = ((at::arange(T, length.options()) + length) >= c.sinks).to(at::kFloat);
    at::Tensor mean = (x_new.to(at::kFloat) * counted.view({1, 1, -1, 1})).sum(2) / counted.sum().clamp_min(1);
    state[kStateMean].copy_(mean);
  }
  const int64_t start = s.start, new_start = c.advance(start, end);
  const int64_t first_slot = (start - c.sinks) / c.group;
  // groups the reference encodes (ceil(T / G)); of those, the ones that complete and fit in the capacity are written
  const int64_t n_enc = (T + c.group - 1) / c.group;
  const int64_t written = std::max<int64_t>(0, std::min((new_start - start) / c.group, s.groups - first_slot));
  const int64_t elem = s.elem;
  const char* nptr = static_cast<const char*>(x_new.data_ptr());
  const int64_t nsb = x_new.stride(0) * elem, nsh = x_new.stride(1) * elem, nst = x_new.stride(2) * elem;
  const int64_t row_bytes = D * elem;
  // work row i = position start + i: the new token start + i - L when it exists, else tail row i
  auto work = [&](int64_t b, int64_t h, int64_t i) -> const char* {
    const int64_t token = start + i - L;
    return token >= 0 ? nptr + b * nsb + h * nsh + token * nst : s.tail.at(b, h) + i * s.tail.sn;
  };
  auto slot_at = [&](int64_t b, int64_t h, int64_t k) {
    const int64_t g = first_slot + k;
    return Slot{s.data.at(b, h, g), s.scale.at(b, h, g), s.zero.at(b, h, g), s.index.at(b, h, g)};
  };
  at::Tensor transformed;
  if (written > 0) transformed = transform_groups(c, mx, s, B, H, T, n_enc, written, work);
  const float* pt = written > 0 ? transformed.data_ptr<float>() : nullptr;
  const int64_t group_floats = static_cast<int64_t>(c.group / c.r) * (c.jpeg ? c.rows : c.r) * D;
  char* mptr = memo.has_value() ? static_cast<char*>(memo->data_ptr()) : nullptr;
  int64_t msb = 0, msh = 0, mst = 0, memo_len = 0;
  if (mptr != nullptr) {
    msb = memo->stride(0) * elem; msh = memo->stride(1) * elem; mst = memo->stride(2) * elem;
    memo_len = memo->size(2);
  }
  const int64_t new_rows = std::min<int64_t>(end - new_start, c.tail_cap);
  const int64_t shift = new_start - start;
  const int64_t head_work = written * group_floats * quant_passes(c) + T * D;
  std::vector<Buffers> bufs(threads_for(B * H * head_work, kMinAppendWorkPerThread));  // one per slot
  for_heads(B * H, head_work, [&](int64_t bh, int slot) {
    Buffers& buf = bufs[slot];
    const int64_t b = bh / H, h = bh % H;
    const char* nb = nptr + b * nsb + h * nsh;
    for (int64_t p = L; p < std::min<int64_t>(c.sinks, end); ++p)
      std::memcpy(s.sink.at(b, h, p), nb + (p - L) * nst, row_bytes);
    if (mptr != nullptr)
      for (int64_t j = 0; j < std::min(T, memo_len - L); ++j)
        std::memcpy(mptr + b * msb + h * msh + (L + j) * mst, nb + j * nst, row_bytes);
    for (int64_t k = 0; k < written; ++k)
      store_group(c, s.data_dtype, pt + (bh * n_enc + k) * group_floats, slot_at(b, h, k), buf);
    char* tail = s.tail.at(b, h);
    for (int64_t i = 0; i < new_rows; ++i) {
      const int64_t src = shift + i;
      if (shift == 0 && start + src - L < 0) continue;  // the row stays where it is
      std::memmove(tail + i * s.tail.sn, work(b, h, src), row_bytes);
    }
    for (int64_t i = std::max<int64_t>(new_rows, 0); i < c.tail_cap; ++i) std::memset(tail + i * s.tail.sn, 0, row_bytes);
  });
  if (mptr != nullptr && written > 0) {
    const at::Tensor decoded = decode_groups(c, mx, s.data_dtype, B, H, n_enc, written, slot_at).contiguous();
    const float* pd = decoded.data_ptr<float>();
    for_heads(B * H, written * c.group * D, [&](int64_t bh, int) {
      std::vector<float> row(D);
      const int64_t b = bh / H, h = bh % H;
      const float* mean = c.center ? s.mean.at(b, h) : nullptr;
      for (int64_t p = 0; p < written * c.group; ++p) {
        const float* src = pd + (bh * n_enc * c.group + p) * D;
        for (int64_t d = 0; d < D; ++d) row[d] = mean != nullptr ? src[d] + mean[d] : src[d];
        from_float(row.data(), s.dtype, mptr + b * msb + h * msh + (c.sinks + first_slot * c.group + p) * mst,
                   static_cast<int>(D));
      }
    });
  }
  *state[kStateStart].data_ptr<int64_t>() = new_start;
  *state[kStateLength].data_ptr<int64_t>() += T;
}

// State tensors the kernel cannot address in place (inner dims not contiguous) are computed on contiguous copies
// that are written back.
void append(const std::vector<at::Tensor>& state, const at::Tensor& x_new, const std::vector<at::Tensor>& plan,
            const c10::optional<at::Tensor>& memo) {
  const std::vector<at::Tensor> work = readable_state(state);
  c10::optional<at::Tensor> mem = memo;
  if (memo.has_value() && !inner_contiguous(*memo, -1)) mem = memo->contiguous();
  append_contiguous(work, readable_rows(x_new), plan, mem);
  for (size_t i = 0; i < state.size(); ++i)
    if (!work[i].is_same(state[i])) state[i].copy_(work[i]);
  if (memo.has_value() && !mem->is_same(*memo)) memo->copy_(*mem);
}

}  // namespace fc
