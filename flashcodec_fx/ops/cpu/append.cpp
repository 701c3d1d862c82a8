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

// Outputs d0 .. d0 + W - 1 of `x @ R.T` for R rows at once: each output one chain of FMAs over the input channels in
// order (from +0, variant 0, or from the first product, variant 1), or four chains over the channels k mod 4 summed
// (c0 + c2) + (c1 + c3) (from +0, variant 2: the order some BLAS builds take for two or three rows); R rows' chains
// interleaved so that the FMAs' latency is hidden (a row alone waits on its own chains).
template <int R, int W>
inline void rotate_block(const float* x, int D, const float* rot_t, int variant, int d0, float* y) {
  if (variant == 2) {
    float c[4][R][W] = {};
    for (int k = 0; k < D; ++k) {
      const float* rk = rot_t + static_cast<int64_t>(k) * D + d0;
      for (int r = 0; r < R; ++r) {
        const float s = x[r * D + k];
#pragma omp simd
        for (int l = 0; l < W; ++l) c[k & 3][r][l] = std::fma(s, rk[l], c[k & 3][r][l]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int l = 0; l < W; ++l) y[r * D + d0 + l] = (c[0][r][l] + c[2][r][l]) + (c[1][r][l] + c[3][r][l]);
    return;
  }
  float t[R][W];
  int k = 0;
  if (variant == 1) {
    for (int r = 0; r < R; ++r)
      for (int l = 0; l < W; ++l) t[r][l] = x[r * D] * rot_t[d0 + l];
    k = 1;
  } else {
    for (int r = 0; r < R; ++r)
      for (int l = 0; l < W; ++l) t[r][l] = 0.0f;
  }
  for (; k < D; ++k) {
    const float* rk = rot_t + static_cast<int64_t>(k) * D + d0;
    for (int r = 0; r < R; ++r) {
      const float s = x[r * D + k];
#pragma omp simd
      for (int l = 0; l < W; ++l) t[r][l] = std::fma(s, rk[l], t[r][l]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int l = 0; l < W; ++l) y[r * D + d0 + l] = t[r][l];
}

template <int R>
inline void rotate_rows_of(const float* x, const float* rot_t, int D, int variant, float* y) {
  int d0 = 0;
  for (; d0 + 64 <= D; d0 += 64) rotate_block<R, 64>(x, D, rot_t, variant, d0, y);
  for (; d0 + 16 <= D; d0 += 16) rotate_block<R, 16>(x, D, rot_t, variant, d0, y);
  for (; d0 < D; ++d0) rotate_block<R, 1>(x, D, rot_t, variant, d0, y);
}

// The encoder's rotation `x @ R.T` of M rows as loops, four rows at a time. Used only for the row counts where
// rotation_loop() found it bitwise the BLAS product the reference computes.
inline void rotate_rows(const float* x, int64_t M, const float* rot_t, int D, int variant, float* y) {
  constexpr int kRows = 4;
  int64_t i = 0;
  for (; i + kRows <= M; i += kRows) rotate_rows_of<kRows>(x + i * D, rot_t, D, variant, y + i * D);
  for (; i < M; ++i) rotate_rows_of<1>(x + i * D, rot_t, D, variant, y + i * D);
}

constexpr int kRotationVariants = 3;  // rotate_block's summation orders

// Which rotate_rows variant reproduces, bit for bit, the BLAS product `x @ R.T` of M rows the reference computes (on
// one BLAS thread), or -1 when neither does: probed once per plan and row count on rows of every kind (values of
// mixed signs and magnitudes, exact zeros of both signs), remembered in the plan's entry.
inline int rotation_loop(PlanEntry& entry, const at::Tensor& rot, int64_t M) {
  {
    std::lock_guard<std::mutex> lock(entry.mu);
    for (const auto& [rows, variant] : entry.loop_variant)
      if (rows == M) return variant;
  }
  const int D = entry.codec.head_dim;
  at::Tensor x = at::empty({M, D}, at::TensorOptions().dtype(at::kFloat));
  float* px = x.data_ptr<float>();
  uint64_t state = 0x9E3779B97F4A7C15ull ^ static_cast<uint64_t>(M);
  for (int64_t i = 0; i < M * D; ++i) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    const double u = static_cast<double>(state >> 11) / 9007199254740992.0;  // [0, 1)
    px[i] = static_cast<float>((u - 0.5) * std::ldexp(1.0, static_cast<int>(state >> 60) - 6));
  }
  int found = -1;
  std::vector<float> y(static_cast<size_t>(M) * D);
  for (int variant = 0; variant < kRotationVariants && found < 0; ++variant) {
    bool same = true;
    for (int probe = 0; probe < 3 && same; ++probe) {
      if (probe == 1) std::fill(px, px + D, 0.0f);                   // a row of +0
      if (probe == 2) std::fill(px + (M - 1) * D, px + M * D, -0.0f);  // a row of -0
      at::Tensor want;
      {
        const SerialBlas serial;
        want = at::matmul(x, rot.t()).contiguous();
      }
      rotate_rows(px, M, entry.rot_t.data(), D, variant, y.data());
      same = std::memcmp(want.data_ptr<float>(), y.data(), sizeof(float) * M * D) == 0;
    }
    if (same) found = variant;
  }
  std::lock_guard<std::mutex> lock(entry.mu);
  entry.loop_variant.emplace_back(M, found);
  return found;
}

// The new tokens of an append as the kernel reads them: (B, H, T, D) rows of one dtype, any strides along B, H, T
// (bytes), rows contiguous; `tensor` the same tokens as a tensor when the caller has one (else made on demand).
struct NewTokens {
  const char* ptr;
  at::ScalarType dtype;
  int64_t B, H, T, D, sb, sh, st;
  at::Tensor tensor;

  explicit NewTokens(const at::Tensor& t)
      : ptr(static_cast<const char*>(t.data_ptr())), dtype(t.scalar_type()), B(t.size(0)), H(t.size(1)),
        T(t.size(2)), D(t.size(3)), sb(t.stride(0) * t.element_size()), sh(t.stride(1) * t.element_size()),
        st(t.stride(2) * t.element_size()), tensor(t) {}
  NewTokens(const void* p, at::ScalarType t, int64_t b, int64_t h, int64_t n, int64_t d)
      : ptr(static_cast<const char*>(p)), dtype(t), B(b), H(h), T(n), D(d) {
    const int64_t elem = static_cast<int64_t>(c10::elementSize(t));
    st = d * elem; sh = n * st; sb = h * sh;
  }
  at::Tensor as_tensor() const {
    if (tensor.defined()) return tensor;
    const int64_t elem = static_cast<int64_t>(c10::elementSize(dtype));
    return at::from_blob(const_cast<char*>(ptr), {B, H, T, D}, {sb / elem, sh / elem, st / elem, 1},
                         at::TensorOptions().dtype(dtype));
  }
};

constexpr int64_t kMinAppendWorkPerThread = 1 << 16;  // values x passes per extra thread (~0.1 ms)

// fn(bh, slot) for every (b, h) of B * H heads, on more than one thread only when `work_per_head` (values x passes)
// gives each thread kMinAppendWorkPerThread (a decode step's append runs on the calling thread alone).
template <typename F>
inline void for_heads(int64_t heads, int64_t work_per_head, F&& fn) {
  Pool::get().run(heads, static_cast<int>(threads_for(heads * work_per_head, kMinAppendWorkPerThread) - 1), fn);
}

// Passes of the quantizer over a group's values: one per clipping factor it tries, plus the final one ("fit": two
// code passes and their sums).
inline int64_t quant_passes(const Codec& c) {
  if (c.quant == kNone) return 1;
  return 1 + (c.search == kSearchTrials ? std::max(c.n_shrink, c.n_lloyd) : c.search == kSearchFit ? 3 : 1);
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

// transform_groups without ATen where the result is the same bits: blocks the analysis leaves as they are (png,
// one-token jpeg blocks) and, with a rotation, the row counts where rotation_loop() matched BLAS. The written groups'
// rows into a reused buffer laid out as transform_groups' result ((B * H, n * G, D) fp32; the rows of unwritten
// groups unspecified); null where the ATen products are needed.
template <typename Work>
const float* transform_groups_fast(const Codec& c, PlanEntry* entry, const Matrices& mx, const Stream& s, int64_t B,
                                   int64_t H, int64_t n, int64_t written, Work&& work) {
  const bool identity = !c.jpeg || (c.r == 1 && c.rows == 1);
  if (entry == nullptr || !identity) return nullptr;
  const int64_t D = c.head_dim, G = c.group, M = B * H * n * G;
  int variant = -1;
  if (c.rotate && (variant = rotation_loop(*entry, mx.rot, M)) < 0) return nullptr;
  float* out = workspace(kWorkTransform, (c.rotate ? 2 : 1) * M * D);
  float* centered = c.rotate ? out + M * D : out;
  for (int64_t bh = 0; bh < B * H; ++bh) {
    const int64_t b = bh / H, h = bh % H;
    const float* mean = c.center ? s.mean.at(b, h) : nullptr;
    for (int64_t p = 0; p < written * G; ++p) {
      float* row = centered + (bh * n * G + p) * D;
      to_float(work(b, h, p), s.dtype, row, static_cast<int>(D));
      if (mean != nullptr)
        for (int64_t d = 0; d < D; ++d) row[d] = row[d] - mean[d];
    }
    if (c.rotate)
      rotate_rows(centered + bh * n * G * D, written * G, entry->rot_t.data(), static_cast<int>(D), variant,
                  out + bh * n * G * D);
  }
  return out;
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

// `entry`: the registered plan (its rotation loop), or null (the ATen products).
void append_contiguous(const std::vector<at::Tensor>& state, const NewTokens& x_new, const Codec& c,
                       const Matrices& mx, PlanEntry* entry, const c10::optional<at::Tensor>& memo) {
  Stream s(c, state);
  const int64_t B = x_new.B, H = x_new.H, T = x_new.T, D = x_new.D;
  const int64_t L = s.length, end = L + T;
  if (c.center && L <= c.sinks && end > c.sinks) {  // the reference's ops, so the mean is bitwise its own
    const at::Tensor& length = state[kStateLength];
    at::Tensor counted = ((at::arange(T, length.options()) + length) >= c.sinks).to(at::kFloat);
    at::Tensor mean = (x_new.as_tensor().to(at::kFloat) * counted.view({1, 1, -1, 1})).sum(2) /
                      counted.sum().clamp_min(1);
    state[kStateMean].copy_(mean);
  }
  const int64_t start = s.start, new_start = c.advance(start, end);
  const int64_t first_slot = (start - c.sinks) / c.group;
  // groups the reference encodes (ceil(T / G)); of those, the ones that complete and fit in the capacity are written
  const int64_t n_enc = (T + c.group - 1) / c.group;
  const int64_t written = std::max<int64_t>(0, std::min((new_start - start) / c.group, s.groups - first_slot));
  const char* nptr = x_new.ptr;
  const int64_t nsb = x_new.sb, nsh = x_new.sh, nst = x_new.st, elem = s.elem;
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
  const float* pt = nullptr;
  if (written > 0) {
    pt = transform_groups_fast(c, entry, mx, s, B, H, n_enc, written, work);
    if (pt == nullptr) {
      const SerialBlas serial;  // the products (rotation, DCT) on this thread: no BLAS team to stall
      transformed = transform_groups(c, mx, s, B, H, T, n_enc, written, work);
      pt = transformed.data_ptr<float>();
    }
  }
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
  thread_local std::vector<Buffers> slot_buffers;  // one per slot, kept between calls (their vectors keep capacity)
  std::vector<Buffers>& bufs = slot_buffers;
  const size_t slots = static_cast<size_t>(threads_for(B * H * head_work, kMinAppendWorkPerThread));
  if (bufs.size() < slots) bufs.resize(slots);
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
    const SerialBlas serial;  // the memo's decode products on this thread
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
// that are written back. `entry`: as in append_contiguous.
void append_tokens(const std::vector<at::Tensor>& state, const NewTokens& x_new, const Codec& c, const Matrices& mx,
                   PlanEntry* entry, const c10::optional<at::Tensor>& memo) {
  const std::vector<at::Tensor> work = readable_state(state);
  c10::optional<at::Tensor> mem = memo;
  if (memo.has_value() && !inner_contiguous(*memo, -1)) mem = memo->contiguous();
  append_contiguous(work, x_new, c, mx, entry, mem);
  for (size_t i = 0; i < state.size(); ++i)
    if (!work[i].is_same(state[i])) state[i].copy_(work[i]);
  if (memo.has_value() && !mem->is_same(*memo)) memo->copy_(*mem);
}

// flashcodec::append with a plan given as its tensors.
void append(const std::vector<at::Tensor>& state, const at::Tensor& x_new, const std::vector<at::Tensor>& plan,
            const c10::optional<at::Tensor>& memo) {
  const Codec c = Codec::parse(plan);
  append_tokens(state, NewTokens(readable_rows(x_new)), c, Matrices(plan), nullptr, memo);
}

// flashcodec::append with a registered plan (register_plan): no parsing, the encoder's rotation loop where it is
// BLAS's bits.
void append_plan(const std::vector<at::Tensor>& state, const at::Tensor& x_new, int64_t plan_id,
                 const c10::optional<at::Tensor>& memo) {
  PlanEntry& entry = PlanRegistry::get().at(plan_id);
  append_tokens(state, NewTokens(readable_rows(x_new)), entry.codec, Matrices(entry.tensors), &entry, memo);
}

}  // namespace fc
