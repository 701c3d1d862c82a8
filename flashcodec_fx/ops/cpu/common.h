// Shared by the CPU kernels (attention.cpp, quantize.h, append.cpp): the codec as parsed from plan.py's tables, views
// of one stream's stored state, code unpacking, row loads and small vector math. The launcher (build.py) concatenates this
// file before the kernels, after the header generated from the Python declarations of the layout (layout.py:
// `python -m flashcodec_fx.ops.cpu.layout` prints it): the enums that name each state tensor (StateField: kStateTail,
// ...), plan tensor (PlanField) and meta field, and CodecMeta, the meta fields as members. It is not a standalone
// header.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

namespace fc {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kFp16Max = 65504.0f;

enum Quant { kNone = 0, kToken = 1, kChannel = 2 };
enum Levels { kInt = 0, kUniform = 1, kMidrise = 2, kLloyd = 3, kTcq = 4 };  // ops/plan.py LEVEL_KINDS
enum Search { kSearchNone = 0, kSearchTrials = 1, kSearchFit = 2 };  // ops/plan.py SEARCH_*

// One codec, parsed from plan.Plan: the meta fields by name (CodecMeta, generated), the tables, and what follows.
struct Codec : CodecMeta {
  float level_off[kMaxRows];  // affine level sets: level[c] == c + level_off (int, uniform, midrise)
  bool affine[kMaxRows];
  bool tcq[kMaxRows];     // trellis codes (levels="tcq", trellis.h): `levels` holds the row's 2**(bits+1) alphabet
  bool bytes8;            // every row 8-bit affine, rows back to back: a block converts as one run of bytes
  const float* synth;     // (r, dense)
  const float* levels;    // (rows, kLevelWidth)
  const float* rot;       // (D, D) or nullptr
  const float* rot_t = nullptr;  // rot transposed ((D, D): rot_t[k * D + d] = rot[d][k]), where registered (PlanEntry)
  const float* factors;   // shrink factors, lloyd factors, (a, c) of "fit"'s start per class, trellis candidates
                          // per class (kTcqSlots each: cpu/plan.py)

  static Codec parse(const std::vector<at::Tensor>& plan) {
    TORCH_CHECK(plan.size() == kPlanFields, "codec plan: expected the tensors of plan.Plan");
    const int64_t* m = plan[kPlanMeta].data_ptr<int64_t>();
    Codec c;
    c.read_head(m);
    if (c.quant != kNone) {
      const int64_t* record = m + kMetaFields;
      for (int j = 0; j < c.rows; ++j, record += kRowFields) c.read_row(j, record);
      for (int k = 0; k < c.classes; ++k, record += kClassFields) c.read_class(k, record);
      for (int j = 0; j < c.rows; ++j) {
        int kind = c.class_levels[c.row_class[j]], half = 1 << (c.bits[j] - 1);
        c.affine[j] = kind != kLloyd && kind != kTcq;
        c.tcq[j] = kind == kTcq;
        c.level_off[j] = kind == kInt ? -half : kind == kMidrise ? 0.5f - half : 0.0f;
      }
    }
    c.bytes8 = c.quant != kNone;
    for (int j = 0; c.bytes8 && j < c.rows; ++j)
      c.bytes8 = c.bits[j] == 8 && c.affine[j] && c.byte_offset[j] == j * c.head_dim;
    c.synth = plan[kPlanSynth].data_ptr<float>();
    c.levels = plan[kPlanLevels].numel() ? plan[kPlanLevels].data_ptr<float>() : nullptr;
    c.rot = plan[kPlanRot].numel() ? plan[kPlanRot].data_ptr<float>() : nullptr;
    c.factors = plan[kPlanFactors].data_ptr<float>();
    return c;
  }

  // The archive's end after appending up to `end` tokens to an archive ending at `start` (state.advance).
  int64_t advance(int64_t start, int64_t end) const {
    const int64_t behind = std::max<int64_t>(end - start - window, 0);
    return start + behind / group * group;
  }
};

// A plan registered once (plan_id(): the launchers pass its number, not its tensors, on every call): the tensors, the
// codec parsed from them, the rotation transposed (for the encoder's rotation loop) and, per number of rows, whether
// that loop rounds as the BLAS product of the reference does (append.cpp: rotation_loop).
struct PlanEntry {
  std::vector<at::Tensor> tensors;
  Codec codec;
  std::vector<float> rot_t;  // (D, D): rot_t[k * D + d] = rot[d][k]; empty without a rotation
  std::mutex mu;             // guards loop_variant
  std::vector<std::pair<int64_t, int>> loop_variant;  // (rows, variant): -1 BLAS only, else the loop's variant

  explicit PlanEntry(const std::vector<at::Tensor>& plan) {
    for (const at::Tensor& t : plan) tensors.push_back(t.contiguous().clone());  // owned: the caller's may go
    codec = Codec::parse(tensors);
    if (codec.rot != nullptr) {
      const int D = codec.head_dim;
      rot_t.resize(static_cast<size_t>(D) * D);
      for (int d = 0; d < D; ++d)
        for (int k = 0; k < D; ++k) rot_t[static_cast<size_t>(k) * D + d] = codec.rot[d * D + k];
      codec.rot_t = rot_t.data();
    }
  }
};

// Every plan registered in this process, by number (never removed: a process registers one per (spec, head_dim)).
class PlanRegistry {
 public:
  static constexpr int kMaxPlans = 1 << 16;
  static PlanRegistry& get() {
    static PlanRegistry* registry = new PlanRegistry();  // never destroyed (kernels may run at exit)
    return *registry;
  }
  int64_t add(const std::vector<at::Tensor>& plan) {
    TORCH_CHECK(plan.size() == kPlanFields, "codec plan: expected the tensors of plan.Plan");
    auto entry = std::make_unique<PlanEntry>(plan);
    std::lock_guard<std::mutex> lock(mu_);
    const int n = count_.load(std::memory_order_relaxed);
    TORCH_CHECK(n < kMaxPlans, "flashcodec: more than ", kMaxPlans, " codec plans registered");
    entries_[n] = entry.release();
    count_.store(n + 1, std::memory_order_release);
    return n;
  }
  PlanEntry& at(int64_t id) const {
    TORCH_CHECK(id >= 0 && id < count_.load(std::memory_order_acquire), "flashcodec: unknown codec plan ", id);
    return *entries_[id];
  }

 private:
  PlanRegistry() : entries_(new PlanEntry*[kMaxPlans]) {}
  std::unique_ptr<PlanEntry*[]> entries_;
  std::atomic<int> count_{0};
  std::mutex mu_;
};

inline int64_t register_plan(const std::vector<at::Tensor>& plan) { return PlanRegistry::get().add(plan); }

// A (B, H, N, ...) tensor whose dims past the third are contiguous: base pointer and element strides of B, H, N.
template <typename T>
struct Lead3 {
  T* ptr = nullptr;
  int64_t sb = 0, sh = 0, sn = 0;
  Lead3() = default;
  explicit Lead3(const at::Tensor& t) : ptr(static_cast<T*>(t.data_ptr())) {
    if (t.dim() >= 3) { sb = t.stride(0); sh = t.stride(1); sn = t.stride(2); }
    else if (t.dim() == 2) { sb = t.stride(0); sh = t.stride(1); }
  }
  T* at(int64_t b, int64_t h, int64_t n = 0) const { return ptr + b * sb + h * sh + n * sn; }
};

// One stream's stored state (ops/state.py): its tensors but `norm` (the launchers apply it) as views, plus the codec.
struct Stream {
  const Codec* c;
  at::ScalarType dtype;  // stream dtype (sink, tail)
  at::ScalarType data_dtype;
  Lead3<char> data;      // byte pointer; element size below
  int64_t data_elem;
  Lead3<at::Half> scale, zero;
  Lead3<uint8_t> index;
  Lead3<float> mean;
  Lead3<char> sink, tail;  // byte pointers, rows along dim 2
  int64_t elem, groups, length, start;  // start: the archive's end (state.start)

  Stream(const Codec& codec, const std::vector<at::Tensor>& st)
      : c(&codec), dtype(st[kStateTail].scalar_type()), data_dtype(st[kStateData].scalar_type()),
        data(st[kStateData]), data_elem(st[kStateData].element_size()), scale(st[kStateScale]),
        zero(st[kStateZero]), index(st[kStateIndex]), mean(st[kStateMean]), sink(st[kStateSink]),
        tail(st[kStateTail]), elem(st[kStateTail].element_size()), groups(st[kStateData].size(2)),
        length(*st[kStateLength].data_ptr<int64_t>()), start(*st[kStateStart].data_ptr<int64_t>()) {
    // Lead3<char> strides count elements; convert to bytes.
    data.sb *= data_elem; data.sh *= data_elem; data.sn *= data_elem;
    sink.sb *= elem; sink.sh *= elem; sink.sn *= elem;
    tail.sb *= elem; tail.sh *= elem; tail.sn *= elem;
  }
};

// Dims `first..` of t laid out contiguously (the kernels' requirement), else a contiguous copy.
inline bool inner_contiguous(const at::Tensor& t, int64_t first) {
  if (t.numel() == 0 || t.dim() == 0) return true;
  if (first < 0) first += t.dim();
  int64_t expected = 1;
  for (int64_t i = t.dim() - 1; i >= first; --i) {
    if (t.size(i) != 1 && t.stride(i) != expected) return false;
    expected *= t.size(i);
  }
  return true;
}

// The first inner dim of state field i: the archive's fields are read per group (dims 3..), the others per row.
inline int64_t state_inner_dim(size_t field) {
  switch (field) {
    case kStateData: case kStateScale: case kStateZero: case kStateIndex: return 3;
    default: return -1;
  }
}

inline std::vector<at::Tensor> readable_state(const std::vector<at::Tensor>& st) {
  std::vector<at::Tensor> out(st);
  for (size_t i = 0; i < out.size(); ++i)
    if (!inner_contiguous(out[i], state_inner_dim(i))) out[i] = out[i].contiguous();
  return out;
}

inline at::Tensor readable_rows(const at::Tensor& t) { return inner_contiguous(t, -1) ? t : t.contiguous(); }

// --- attention inputs: a mask over absolute positions, raw rows of q and of the call's new tokens --------------

struct MaskView {
  const char* ptr = nullptr;
  at::ScalarType dtype = at::kBool;
  int64_t sb = 0, sh = 0, st = 0, sl = 0, len = 0;  // strides in elements (0 on broadcast dims)
  int64_t elem = 1;

  MaskView() = default;
  explicit MaskView(const at::Tensor& mk)
      : ptr(static_cast<const char*>(mk.data_ptr())), dtype(mk.scalar_type()), sb(mk.size(0) == 1 ? 0 : mk.stride(0)),
        sh(mk.size(1) == 1 ? 0 : mk.stride(1)), st(mk.size(2) == 1 ? 0 : mk.stride(2)), sl(mk.stride(3)),
        len(mk.size(3)), elem(mk.element_size()) {}

  // out[i * stride] += bias of position p0 + i, i < n, for query (b, head, t)
  void apply(int64_t b, int64_t head, int64_t t, int64_t p0, int n, float* out, int stride) const {
    const char* base = ptr + (b * sb + head * sh + t * st) * elem;
    for (int i = 0; i < n; ++i) {
      const int64_t p = std::min<int64_t>(p0 + i, len - 1);
      const char* cell = base + p * sl * elem;
      float& o = out[i * stride];
      switch (dtype) {
        case at::kBool: if (!*reinterpret_cast<const bool*>(cell)) o = kNegInf; break;
        case at::kFloat: o += *reinterpret_cast<const float*>(cell); break;
        case at::kDouble: o += static_cast<float>(*reinterpret_cast<const double*>(cell)); break;
        case at::kHalf: o += static_cast<float>(*reinterpret_cast<const at::Half*>(cell)); break;
        default: o += static_cast<float>(*reinterpret_cast<const at::BFloat16*>(cell)); break;
      }
    }
  }
};

// Raw rows (B, H, N, D) with arbitrary strides, last dim contiguous (q, k_new, v_new).
struct Rows {
  const char* ptr = nullptr;
  at::ScalarType dtype = at::kFloat;
  int64_t sb = 0, sh = 0, sn = 0;  // bytes
  Rows() = default;
  explicit Rows(const at::Tensor& t)
      : ptr(static_cast<const char*>(t.data_ptr())), dtype(t.scalar_type()), sb(t.stride(0) * t.element_size()),
        sh(t.stride(1) * t.element_size()), sn(t.stride(2) * t.element_size()) {}
  Rows(const void* p, at::ScalarType t, int64_t sb_bytes, int64_t sh_bytes, int64_t sn_bytes)
      : ptr(static_cast<const char*>(p)), dtype(t), sb(sb_bytes), sh(sh_bytes), sn(sn_bytes) {}
  const char* at(int64_t b, int64_t h, int64_t n) const { return ptr + b * sb + h * sh + n * sn; }
};

// --- reused memory -------------------------------------------------------------------------------------------

// A growable buffer of floats, 64-byte aligned, that keeps its memory between calls (the kernels' workspaces: a
// decode step allocates nothing but its output). Contents are unspecified after grow().
class FloatBuffer {
 public:
  float* grow(int64_t floats) {
    if (floats > size_) {
      std::free(data_);
      const int64_t bytes = ((std::max<int64_t>(floats, 16) * static_cast<int64_t>(sizeof(float)) + 63) / 64) * 64;
      data_ = static_cast<float*>(std::aligned_alloc(64, static_cast<size_t>(bytes)));
      TORCH_CHECK(data_ != nullptr, "flashcodec: out of memory for a workspace of ", floats, " floats");
      size_ = bytes / static_cast<int64_t>(sizeof(float));
    }
    return data_;
  }
  ~FloatBuffer() { std::free(data_); }
  FloatBuffer() = default;
  FloatBuffer(const FloatBuffer&) = delete;
  FloatBuffer& operator=(const FloatBuffer&) = delete;

 private:
  float* data_ = nullptr;
  int64_t size_ = 0;
};

// The calling thread's buffer number `which` (each use in a call has its own number; pool helpers write into the
// caller's buffers, never into their own).
enum Workspace : int { kWorkAttention, kWorkRows, kWorkTransform, kWorkInputs, kWorkRawRows, kWorkspaces };
inline float* workspace(Workspace which, int64_t floats) {
  thread_local FloatBuffer buffers[kWorkspaces];
  return buffers[which].grow(floats);
}

// The calling thread's per-slot record of the query tile each pool slot has prepared, reset to none (-1) for `slots`
// slots. Taken by reference before a parallel region: a thread_local named inside the region's lambda would be the
// helper thread's own.
inline std::vector<int64_t>& prepared_tiles(int64_t slots) {
  thread_local std::vector<int64_t> prepared;
  prepared.assign(static_cast<size_t>(slots), -1);
  return prepared;
}

// --- BLAS threads ---------------------------------------------------------------------------------------------

// MKL's call setting the calling thread's BLAS thread count (it returns the previous setting; 0: the global one). A
// weak reference, resolved against torch's MKL when it has one, null otherwise.
extern "C" int MKL_Set_Num_Threads_Local(int) __attribute__((weak));

inline bool serial_blas_available() { return MKL_Set_Num_Threads_Local != nullptr; }

// BLAS calls made in this scope run on the calling thread. The encoder's products are small (a decode step: a few
// rows per call), and a threaded BLAS forks a team for them that a busy machine stalls: a (3 x 64) @ (64 x 64)
// product measured 16 us at the median and 50 ms at the 90th percentile with 2 threads beside other jobs, 9.7 us at
// the 90th percentile on one. MKL's result for some small shapes depends on its thread count, so the encoder's
// products are those of the reference run with one BLAS thread.
struct SerialBlas {
  int previous = 0;
  SerialBlas() {
    if (serial_blas_available()) previous = MKL_Set_Num_Threads_Local(1);
  }
  ~SerialBlas() {
    if (serial_blas_available()) MKL_Set_Num_Threads_Local(previous);
  }
  SerialBlas(const SerialBlas&) = delete;
  SerialBlas& operator=(const SerialBlas&) = delete;
};

// --- element conversion ---------------------------------------------------------------------------------------

inline void to_float(const void* src, at::ScalarType t, float* dst, int n) {
  if (t == at::kFloat) {
    std::memcpy(dst, src, sizeof(float) * n);
  } else if (t == at::kBFloat16) {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    uint32_t* d = reinterpret_cast<uint32_t*>(dst);
    for (int i = 0; i < n; ++i) d[i] = static_cast<uint32_t>(s[i]) << 16;
  } else {
    const at::Half* s = static_cast<const at::Half*>(src);
    for (int i = 0; i < n; ++i) dst[i] = static_cast<float>(s[i]);
  }
}

// A row of n values of dtype t as fp32: the row itself when it is fp32, else converted into `scratch`.
inline const float* float_row(const void* src, at::ScalarType t, float* scratch, int n) {
  if (t == at::kFloat) return static_cast<const float*>(src);
  to_float(src, t, scratch, n);
  return scratch;
}

inline void from_float(const float* src, at::ScalarType t, void* dst, int n) {
  if (t == at::kFloat) {
    std::memcpy(dst, src, sizeof(float) * n);
  } else if (t == at::kBFloat16) {
    at::BFloat16* d = static_cast<at::BFloat16*>(dst);
    for (int i = 0; i < n; ++i) d[i] = at::BFloat16(src[i]);
  } else {
    at::Half* d = static_cast<at::Half*>(dst);
    for (int i = 0; i < n; ++i) d[i] = at::Half(src[i]);
  }
}

// A value of dtype t as stored (rounded to t) and read back as fp32.
inline float round_to(float v, at::ScalarType t) {
  if (t == at::kBFloat16) return static_cast<float>(at::BFloat16(v));
  if (t == at::kHalf) return static_cast<float>(at::Half(v));
  return v;
}

// An output row o (fp32, D values) into dst of dtype t, times the channel factors n (D fp32; null: none) as ATen's
// `out.to(t) * n.to(t)` rounds them: the row is rounded to t, multiplied by the rounded factor, rounded again.
inline void store_output(float* o, at::ScalarType t, void* dst, int D, const float* n) {
  if (n != nullptr)
    for (int d = 0; d < D; ++d) o[d] = round_to(o[d], t) * round_to(n[d], t);
  from_float(o, t, dst, D);
}

// --- codes ----------------------------------------------------------------------------------------------------

// One power-of-two slice (codecs/pack.py): channel d in byte d*W/8, at bit d*W%8; OR-ed into codes at `shift`.
// Eight channels at a time (W bytes, little-endian) as one 8-lane vector: the word broadcast, shifted right per lane,
// masked (a GCC / clang vector; d_count is a multiple of 8).
template <int W>
inline void unpack_slice(const uint8_t* src, int shift, int d_count, int32_t* codes) {
  typedef uint32_t vu8 __attribute__((vector_size(32)));
  constexpr uint32_t mask = (1u << W) - 1;
  if constexpr (W == 8) {
    for (int d = 0; d < d_count; ++d) codes[d] |= static_cast<int32_t>(static_cast<uint32_t>(src[d]) << shift);
  } else {
    const vu8 lanes = {0, W, 2 * W, 3 * W, 4 * W, 5 * W, 6 * W, 7 * W};
    for (int c = 0; c < d_count / 8; ++c) {
      uint32_t word = 0;
      std::memcpy(&word, src + c * W, W);
      vu8 v = (((vu8{} + word) >> lanes) & mask) << shift, out;
      std::memcpy(&out, codes + 8 * c, sizeof(out));
      out |= v;
      std::memcpy(codes + 8 * c, &out, sizeof(out));
    }
  }
}

// The `bits`-bit codes of one row of D channels (slices widest first, as pack.slices).
inline void unpack_codes(const uint8_t* src, int bits, int d_count, int32_t* codes) {
  for (int d = 0; d < d_count; ++d) codes[d] = 0;
  int shift = 0;
  const int widths[4] = {8, 4, 2, 1};
  for (int w : widths) {
    if (bits - shift < w) continue;
    switch (w) {
      case 8: unpack_slice<8>(src, shift, d_count, codes); break;
      case 4: unpack_slice<4>(src, shift, d_count, codes); break;
      case 2: unpack_slice<2>(src, shift, d_count, codes); break;
      default: unpack_slice<1>(src, shift, d_count, codes); break;
    }
    src += d_count * w / 8;
    shift += w;
  }
}

// out[d] = table[codes[d]] for a table of N <= 16 levels. GCC: the table in one 16-lane vector read by a variable
// shuffle (one cross-lane permute per 16 channels); otherwise N - 1 selects per channel, unrolled (N is known), so
// the loop over channels vectorizes (a gather or a runtime-length inner loop does not).
template <int N>
inline void select_levels(const int32_t* codes, const float* table, int D, float* out) {
  static_assert(N <= 16, "select_levels: at most 16 levels");
  int d = 0;
#if defined(__GNUC__) && !defined(__clang__)
  typedef float vf16 __attribute__((vector_size(64)));
  typedef int32_t vi16 __attribute__((vector_size(64)));
  vf16 t = {};
  for (int e = 0; e < N; ++e) t[e] = table[e];
  for (; d + 16 <= D; d += 16) {
    vi16 c;
    std::memcpy(&c, codes + d, sizeof(c));
    const vf16 v = __builtin_shuffle(t, c);
    std::memcpy(out + d, &v, sizeof(v));
  }
#endif
  float t8[N];
  for (int e = 0; e < N; ++e) t8[e] = table[e];
#pragma omp simd
  for (int k = d; k < D; ++k) {
    float v = t8[0];
#pragma GCC unroll 8
    for (int e = 1; e < N; ++e) v = codes[k] == e ? t8[e] : v;
    out[k] = v;
  }
}

inline void tcq_indices(int32_t* codes, int D);  // trellis.h

// The unscaled level values of row j of a packed block (`block` = the block's row_bytes).
inline void row_levels(const Codec& c, const uint8_t* block, int j, int32_t* codes, float* out) {
  const int D = c.head_dim;
  const uint8_t* src = block + c.byte_offset[j];
  if (c.bits[j] == 8 && c.affine[j]) {
    const float off = c.level_off[j];
    for (int d = 0; d < D; ++d) out[d] = static_cast<float>(src[d]) + off;
    return;
  }
  unpack_codes(src, c.bits[j], D, codes);
  if (c.tcq[j]) {  // trellis codes: alphabet indices (each from its code and the three before it), then the alphabet
    tcq_indices(codes, D);
    const float* table = c.levels + j * kLevelWidth;
    switch (c.bits[j]) {
      case 1: select_levels<4>(codes, table, D, out); break;
      case 2: select_levels<8>(codes, table, D, out); break;
      case 3: select_levels<16>(codes, table, D, out); break;
      default: for (int d = 0; d < D; ++d) out[d] = table[codes[d]];
    }
    return;
  }
  if (c.affine[j]) {
    const float off = c.level_off[j];
    for (int d = 0; d < D; ++d) out[d] = static_cast<float>(codes[d]) + off;
  } else if (c.bits[j] <= 4) {  // small Lloyd tables: a shuffle or a select per level vectorizes, a gather does not
    const float* table = c.levels + j * kLevelWidth;
    switch (c.bits[j]) {
      case 1: select_levels<2>(codes, table, D, out); break;
      case 2: select_levels<4>(codes, table, D, out); break;
      case 3: select_levels<8>(codes, table, D, out); break;
      default: select_levels<16>(codes, table, D, out); break;
    }
  } else {
    const float* table = c.levels + j * kLevelWidth;
    for (int d = 0; d < D; ++d) out[d] = table[codes[d]];
  }
}

// --- vector math ----------------------------------------------------------------------------------------------

inline float dot(const float* a, const float* b, int n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int i = 0; i < n; ++i) s = std::fma(a[i], b[i], s);
  return s;
}

// dot() of `count` rows a_j (stride as) with b into out[j * os], in the order of the additions the compiler gave dot()
// for W lanes: lane l the chain of FMAs of i = l, l + W, ... (from 0), then 0 + lane 0 + lane 1 + ... + lane W-1
// (GCC's `omp simd` reduction: a lane array summed in order). Eight rows at a time, so their chains overlap: dot()
// one row at a time waits on each row's W dependent additions. Only for n a multiple of W (dots() checks).
template <int W>
inline void dots_lanes(const float* a, int64_t as, const float* b, int n, int count, float* out, int64_t os) {
  constexpr int R = 8;
  int j = 0;
  for (; j + R <= count; j += R) {
    float lanes[R][W];
    for (int r = 0; r < R; ++r)
      for (int l = 0; l < W; ++l) lanes[r][l] = 0.0f;
    for (int c = 0; c < n; c += W)
      for (int r = 0; r < R; ++r) {
        const float* ar = a + (j + r) * as + c;
#pragma omp simd
        for (int l = 0; l < W; ++l) lanes[r][l] = std::fma(ar[l], b[c + l], lanes[r][l]);
      }
    float sum[R];
    for (int r = 0; r < R; ++r) sum[r] = 0.0f;
    for (int l = 0; l < W; ++l)
      for (int r = 0; r < R; ++r) sum[r] = sum[r] + lanes[r][l];
    for (int r = 0; r < R; ++r) out[(j + r) * os] = sum[r];
  }
  for (; j < count; ++j) out[j * os] = dot(a + j * as, b, n);
}

// The lane count W for which dots_lanes<W> is bitwise dot() in this build (probed once on random rows of every
// length class, against dot() itself), or 0: none (dots() then calls dot() row by row).
inline int dot_lanes() {
  static const int lanes = [] {
    uint64_t state = 0x2545F4914F6CDD1Dull;
    std::vector<float> a(16 * 8 * 40), b(16 * 40), got(16), want(16);
    for (float& x : a) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      x = static_cast<float>(static_cast<double>(state >> 11) / 9007199254740992.0 - 0.5) * 8.0f;
    }
    for (size_t i = 0; i < b.size(); ++i) b[i] = a[a.size() - 1 - i] * 0.37f;
    for (int w : {16, 8, 4}) {
      bool same = true;
      for (int n = w; n <= 8 * w && same; n += w) {
        const auto run = [&](auto width) {
          dots_lanes<decltype(width)::value>(a.data(), n, b.data(), n, 16, got.data(), 1);
        };
        if (w == 16) run(std::integral_constant<int, 16>());
        else if (w == 8) run(std::integral_constant<int, 8>());
        else run(std::integral_constant<int, 4>());
        for (int j = 0; j < 16; ++j) want[j] = dot(a.data() + j * n, b.data(), n);
        same = std::memcmp(got.data(), want.data(), sizeof(float) * 16) == 0;
      }
      if (same) return w;
    }
    return 0;
  }();
  return lanes;
}

// out[d] = dot(rot + d * D, q, D) for every d < D (the query's rotation q_rot = R @ q), bitwise, from the transposed
// matrix: W-lane accumulators of 16 outputs each (lane l: the FMAs of k = l, l + W, ... for 16 outputs side by side),
// then the W lanes added in order, 16 outputs at a time. D a multiple of 16 and of W.
template <int W>
inline void rotate_query_lanes(const float* rot_t, const float* q, int D, float* out) {
  for (int d0 = 0; d0 < D; d0 += 16) {
    float acc[W][16];
    for (int l = 0; l < W; ++l)
      for (int e = 0; e < 16; ++e) acc[l][e] = 0.0f;
    for (int c = 0; c < D; c += W)
      for (int l = 0; l < W; ++l) {
        const float x = q[c + l];
        const float* r = rot_t + static_cast<int64_t>(c + l) * D + d0;
#pragma omp simd
        for (int e = 0; e < 16; ++e) acc[l][e] = std::fma(r[e], x, acc[l][e]);
      }
    float sum[16];
    for (int e = 0; e < 16; ++e) sum[e] = 0.0f;
    for (int l = 0; l < W; ++l)
#pragma omp simd
      for (int e = 0; e < 16; ++e) sum[e] = sum[e] + acc[l][e];
    for (int e = 0; e < 16; ++e) out[d0 + e] = sum[e];
  }
}

inline void dots(const float* a, int64_t as, const float* b, int n, int count, float* out, int64_t os);

// q_rot = R @ q for a codec with a rotation (c.rot (D, D)), bitwise dot() row by row: from the transposed matrix
// where the plan is registered and the shapes allow, else dots().
inline void rotate_query(const Codec& c, const float* q, int D, float* out) {
  const int w = dot_lanes();
  if (c.rot_t != nullptr && D % 16 == 0 && w > 0 && D % w == 0) {
    if (w == 16) rotate_query_lanes<16>(c.rot_t, q, D, out);
    else if (w == 8) rotate_query_lanes<8>(c.rot_t, q, D, out);
    else rotate_query_lanes<4>(c.rot_t, q, D, out);
    return;
  }
  dots(c.rot, D, q, D, D, out, 1);
}

// out[j * os] = dot(a + j * as, b, n) for j < count, bitwise, several rows at a time where dot_lanes() allows.
inline void dots(const float* a, int64_t as, const float* b, int n, int count, float* out, int64_t os) {
  const int w = dot_lanes();
  if (w == 16 && n % 16 == 0) dots_lanes<16>(a, as, b, n, count, out, os);
  else if (w == 8 && n % 8 == 0) dots_lanes<8>(a, as, b, n, count, out, os);
  else if (w == 4 && n % 4 == 0) dots_lanes<4>(a, as, b, n, count, out, os);
  else
    for (int j = 0; j < count; ++j) out[j * os] = dot(a + j * as, b, n);
}

// y += a * x
inline void axpy(float* y, float a, const float* x, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) y[i] = std::fma(a, x[i], y[i]);
}

inline void scale_row(float* y, float a, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) y[i] *= a;
}

// o[d] += sum_e a[e] * rot[e][d] for d < D, e ascending: the rotation back (`out += acc_rot @ R`), each channel's
// sum the chain of FMAs a sequence of axpy(o, a[e], rot + e * D, D) makes, with 64 channels held in registers.
inline void rotate_back(float* o, const float* a, const float* rot, int D) {
  int d0 = 0;
  for (; d0 + 64 <= D; d0 += 64) {
    float t[64];
    for (int l = 0; l < 64; ++l) t[l] = o[d0 + l];
    for (int e = 0; e < D; ++e) {
      const float s = a[e];
      const float* r = rot + static_cast<int64_t>(e) * D + d0;
#pragma omp simd
      for (int l = 0; l < 64; ++l) t[l] = std::fma(s, r[l], t[l]);
    }
    for (int l = 0; l < 64; ++l) o[d0 + l] = t[l];
  }
  for (; d0 + 16 <= D; d0 += 16) {
    float t[16];
    for (int l = 0; l < 16; ++l) t[l] = o[d0 + l];
    for (int e = 0; e < D; ++e) {
      const float s = a[e];
      const float* r = rot + static_cast<int64_t>(e) * D + d0;
#pragma omp simd
      for (int l = 0; l < 16; ++l) t[l] = std::fma(s, r[l], t[l]);
    }
    for (int l = 0; l < 16; ++l) o[d0 + l] = t[l];
  }
  for (; d0 < D; ++d0)
    for (int e = 0; e < D; ++e) o[d0] = std::fma(a[e], rot[static_cast<int64_t>(e) * D + d0], o[d0]);
}

// --- lane kernels: kLanes query rows side by side (GQA heads x tokens), one SIMD vector ---------------------------

constexpr int kLanes = 16;

// out[j][l] = sum_d qt[d][l] * rows[j][d] for N rows (qt: D x kLanes, the queries transposed).
template <int N>
inline void lane_dots(const float* qt, const float* rows, int64_t row_stride, int D, float* out) {
  float acc[N][kLanes];
  for (int j = 0; j < N; ++j)
    for (int l = 0; l < kLanes; ++l) acc[j][l] = 0.0f;
  for (int d = 0; d < D; ++d) {
    const float* qd = qt + d * kLanes;
#pragma GCC unroll 8
    for (int j = 0; j < N; ++j) {
      const float r = rows[j * row_stride + d];
#pragma omp simd
      for (int l = 0; l < kLanes; ++l) acc[j][l] = std::fma(qd[l], r, acc[j][l]);
    }
  }
  for (int j = 0; j < N; ++j)
    for (int l = 0; l < kLanes; ++l) out[j * kLanes + l] = acc[j][l];
}

// A single row with four partial sums over d (one accumulator would wait on the FMA latency).
inline void lane_dot1(const float* qt, const float* row, int D, float* out) {
  float acc[4][kLanes];
  for (int k = 0; k < 4; ++k)
    for (int l = 0; l < kLanes; ++l) acc[k][l] = 0.0f;
  int d = 0;
  for (; d + 4 <= D; d += 4)
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      const float r = row[d + k];
      const float* qd = qt + (d + k) * kLanes;
#pragma omp simd
      for (int l = 0; l < kLanes; ++l) acc[k][l] = std::fma(qd[l], r, acc[k][l]);
    }
  for (; d < D; ++d) {
    const float* qd = qt + d * kLanes;
    for (int l = 0; l < kLanes; ++l) acc[0][l] = std::fma(qd[l], row[d], acc[0][l]);
  }
  for (int l = 0; l < kLanes; ++l) out[l] = (acc[0][l] + acc[1][l]) + (acc[2][l] + acc[3][l]);
}

// out[j][:] = qt . rows[j] for n rows (any n), eight at a time.
inline void lane_dots_n(const float* qt, const float* rows, int64_t row_stride, int n, int D, float* out) {
  int j = 0;
  for (; j + 8 <= n; j += 8) lane_dots<8>(qt, rows + j * row_stride, row_stride, D, out + j * kLanes);
  switch (n - j) {
    case 7: lane_dots<7>(qt, rows + j * row_stride, row_stride, D, out + j * kLanes); break;
    case 6: lane_dots<6>(qt, rows + j * row_stride, row_stride, D, out + j * kLanes); break;
    case 5: lane_dots<5>(qt, rows + j * row_stride, row_stride, D, out + j * kLanes); break;
    case 4: lane_dots<4>(qt, rows + j * row_stride, row_stride, D, out + j * kLanes); break;
    default:
      for (; j < n; ++j) lane_dot1(qt, rows + j * row_stride, D, out + j * kLanes);
  }
}

// acc[m][0:D] += sum_j w[j][m] * rows[j][0:D] for m < mt (w: n x kLanes), 64 channels (four independent
// accumulator vectors) at a time.
inline void lane_axpys(const float* w, int n, const float* rows, int64_t row_stride, int D, float* acc, int mt) {
  for (int m = 0; m < mt; ++m) {
    float* am = acc + m * D;
    int d0 = 0;
    for (; d0 + 64 <= D; d0 += 64) {
      float t[4][16];
      for (int k = 0; k < 4; ++k)
        for (int l = 0; l < 16; ++l) t[k][l] = am[d0 + 16 * k + l];
      for (int j = 0; j < n; ++j) {
        const float s = w[j * kLanes + m];
        const float* r = rows + j * row_stride + d0;
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k)
#pragma omp simd
          for (int l = 0; l < 16; ++l) t[k][l] = std::fma(s, r[16 * k + l], t[k][l]);
      }
      for (int k = 0; k < 4; ++k)
        for (int l = 0; l < 16; ++l) am[d0 + 16 * k + l] = t[k][l];
    }
    for (; d0 + 16 <= D; d0 += 16) {
      float t[16];
      for (int l = 0; l < 16; ++l) t[l] = am[d0 + l];
      for (int j = 0; j < n; ++j) {
        const float s = w[j * kLanes + m];
        const float* r = rows + j * row_stride + d0;
#pragma omp simd
        for (int l = 0; l < 16; ++l) t[l] = std::fma(s, r[l], t[l]);
      }
      for (int l = 0; l < 16; ++l) am[d0 + l] = t[l];
    }
    for (; d0 < D; ++d0)
      for (int j = 0; j < n; ++j) am[d0] = std::fma(w[j * kLanes + m], rows[j * row_stride + d0], am[d0]);
  }
}

// out[i][:] = base[:] + sum_j a[i * lda + j * step] x[j][:] for i < NI, j < nj (lane vectors x: nj x kLanes):
// NI independent FMA chains. The synthesis products: scores = A @ coef (lda = R, step = 1), p @ A (lda = 1, step = R).
template <int NI>
inline void lane_matmul_tile(const float* a, int64_t lda, int64_t step, const float* x, int nj, const float* base,
                             float* out) {
  float acc[NI][kLanes];
  for (int ii = 0; ii < NI; ++ii)
    for (int l = 0; l < kLanes; ++l) acc[ii][l] = base == nullptr ? 0.0f : base[l];
  for (int j = 0; j < nj; ++j) {
    const float* xj = x + j * kLanes;
#pragma GCC unroll 8
    for (int ii = 0; ii < NI; ++ii) {
      const float c = a[ii * lda + j * step];
#pragma omp simd
      for (int l = 0; l < kLanes; ++l) acc[ii][l] = std::fma(c, xj[l], acc[ii][l]);
    }
  }
  for (int ii = 0; ii < NI; ++ii)
    for (int l = 0; l < kLanes; ++l) out[ii * kLanes + l] = acc[ii][l];
}

inline void lane_matmul(const float* a, int64_t lda, int64_t step, const float* x, int ni, int nj, const float* base,
                        float* out) {
  int i = 0;
  for (; i + 8 <= ni; i += 8) lane_matmul_tile<8>(a + i * lda, lda, step, x, nj, base, out + i * kLanes);
  for (; i + 4 <= ni; i += 4) lane_matmul_tile<4>(a + i * lda, lda, step, x, nj, base, out + i * kLanes);
  for (; i < ni; ++i) lane_matmul_tile<1>(a + i * lda, lda, step, x, nj, base, out + i * kLanes);
}

// exp(x), x <= 0 expected (scores minus their running max): Cephes expf (about 1 ulp); 0 below -87.3 (and for -inf).
// Branch-free (selects, a round-to-nearest by the 1.5 * 2**23 trick) so that loops calling it vectorize.
inline float exp_lane(float v0) {
  float v = v0 < -87.33654f ? -87.33654f : v0;
  v = v > 88.3762626647949f ? 88.3762626647949f : v;
  const float t = v * 1.44269504088896341f;
  const float fx = (t + 12582912.0f) - 12582912.0f;
  float r = std::fma(fx, -0.693359375f, v);
  r = std::fma(fx, 2.12194440e-4f, r);
  const float z = r * r;
  float p = 1.9875691500E-4f;
  p = std::fma(p, r, 1.3981999507E-3f);
  p = std::fma(p, r, 8.3334519073E-3f);
  p = std::fma(p, r, 4.1665795894E-2f);
  p = std::fma(p, r, 1.6666665459E-1f);
  p = std::fma(p, r, 5.0000001201E-1f);
  p = std::fma(p, z, r + 1.0f);
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(fx) + 127) << 23;
  float pow2;
  std::memcpy(&pow2, &bits, sizeof(float));
  return v0 < -87.33654f ? 0.0f : p * pow2;
}

// exp(x) for a row (exp_lane).
inline void exp_row(const float* x, float* y, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) y[i] = exp_lane(x[i]);
}

inline float exp_one(float x) {
  float y;
  exp_row(&x, &y, 1);
  return y;
}

// --- variants of codec_attention's logits and softmax (ops/reference/attention.py) ------------------------------

// What a call asks for on top of plain attention, each off by default; the kernels test these outside their inner
// loops, so a call without them runs the code it ran before they existed.
struct Variants {
  float softcap = 0.0f;          // > 0: s = softcap * tanh(s / softcap), after the scale
  const float* alibi = nullptr;  // (Hq,) fp32 slopes: s += alibi[head] * position, after the softcap, before the mask
  const float* sinks = nullptr;  // (Hq,) fp32 logits: exp(sinks[head] - max) joins each row's denominator (and max)
  bool logits() const { return softcap > 0.0f || alibi != nullptr; }
};

// y = cap * tanh(y / cap) for n logits; -inf stays -inf (positions no slot holds). tanh(a) for a = |x|: (1 - e) /
// (1 + e) with e = exp(-2a) (exp_lane) from a = 0.25 on, below it the Taylor polynomial to a^9 (the quotient loses
// relative precision near 0; the next term is under 1e-8 relative there): within a few ulp of torch.tanh.
// Branch-free, so that it vectorizes.
inline void softcap_row(float* y, int n, float cap) {
#pragma omp simd
  for (int i = 0; i < n; ++i) {
    const float v = y[i];
    const float x = v / cap;
    const float a = std::fabs(x);
    const float e = exp_lane(-2.0f * a);
    const float quotient = (1.0f - e) / (1.0f + e);
    const float z = a * a;
    float p = 62.0f / 2835.0f;
    p = std::fma(p, z, -17.0f / 315.0f);
    p = std::fma(p, z, 2.0f / 15.0f);
    p = std::fma(p, z, -1.0f / 3.0f);
    const float series = std::fma(a * z, p, a);
    const float t = a < 0.25f ? series : quotient;
    const float capped = cap * (x < 0.0f ? -t : t);
    y[i] = v == kNegInf ? kNegInf : capped;
  }
}

}  // namespace fc
