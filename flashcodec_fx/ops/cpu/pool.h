// The kernels' one parallel region per call, made for busy machines (issue 19, item 5).
//
// OpenMP's fork-join (at::parallel_for) ends every region at a barrier that waits for every thread of the team: on an
// oversubscribed machine one descheduled thread holds the whole call for a time slice, and the idle threads spin.
// Here the calling thread works too, items are claimed one at a time from a shared counter, and the call returns as
// soon as every item is done: it never waits for a helper that has not started (a helper the OS runs late finds no
// item left and goes back to sleep), only for items a running helper has claimed; when such a helper was
// descheduled in an item and held the call up, the next calls run on the calling thread alone (a backoff that
// doubles while it keeps happening). Helpers sleep on a condition variable between calls (no spinning). One call
// at a time: a caller that finds the pool busy, or that runs inside an ATen parallel region, runs its items itself.
// Which thread runs an item never changes its result. The helper threads are detached and the pool is never
// destroyed (a process exits with them asleep); a forked child starts with no helpers.

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <new>
#include <thread>

#include <pthread.h>

namespace fc {

class Pool {
 public:
  static Pool& get() {
    static Pool* pool = [] {
      Pool* p = new Pool();  // never destroyed: its detached threads may still be asleep at exit
      pthread_atfork(nullptr, nullptr, [] { Pool::get().forget_threads(); });
      return p;
    }();
    return *pool;
  }

  // fn(item, slot) for every item in [0, n): on the calling thread (slot 0) and on up to `helpers` pool threads
  // (slots 1 .. helpers); each slot is used by one thread at a time. Returns when all items are done.
  template <typename F>
  void run(int64_t n, int helpers, F&& fn) {
    if (n <= 0) return;
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    const bool backing_off = busy.owns_lock() && serial_calls_ > 0;
    if (helpers <= 0 || n == 1 || !busy.owns_lock() || at::in_parallel_region() || backing_off) {
      if (backing_off) --serial_calls_;
      for (int64_t item = 0; item < n; ++item) fn(item, 0);
      return;
    }
    start_threads(helpers);
    using Fn = std::remove_reference_t<F>;
    uint64_t gen;
    {
      std::lock_guard<std::mutex> lock(mu_);
      gen = (gen_ + 1) & kGenMask;
      gen_ = gen;
      n_ = n;
      want_ = helpers;
      ctx_ = static_cast<void*>(&fn);
      call_ = [](void* ctx, int64_t item, int slot) { (*static_cast<Fn*>(ctx))(item, slot); };
      done_.store(0, std::memory_order_relaxed);
      claim_.store(gen << kItemBits, std::memory_order_release);
    }
    wake_.notify_all();
    const auto start = Clock::now();
    work(gen, call_, ctx_, n, 0);
    const auto own = Clock::now();
    while (done_.load(std::memory_order_acquire) < n) std::this_thread::yield();  // items a helper is finishing
    // A helper that held the call up longer than the caller's own share took was descheduled in an item: the
    // machine is oversubscribed. The next calls run alone, twice as many after each such call in a row.
    if (Clock::now() - own > own - start) {
      strikes_ = std::min(strikes_ + 1, kMaxStrikes);
      serial_calls_ = (1 << strikes_) - 1;
    } else {
      strikes_ = 0;
    }
  }

 private:
  using Clock = std::chrono::steady_clock;
  static constexpr int kMaxStrikes = 8;  // at most 255 calls alone after a stall
  static constexpr int kItemBits = 40;
  static constexpr uint64_t kItemMask = (uint64_t(1) << kItemBits) - 1;
  static constexpr uint64_t kGenMask = (uint64_t(1) << (64 - kItemBits)) - 1;
  using Call = void (*)(void*, int64_t, int);

  Pool() = default;

  // Claim and run items of generation `gen` until none is left (or a newer call has replaced it).
  void work(uint64_t gen, Call call, void* ctx, int64_t n, int slot) {
    for (;;) {
      uint64_t v = claim_.load(std::memory_order_acquire);
      do {
        if ((v >> kItemBits) != gen || static_cast<int64_t>(v & kItemMask) >= n) return;
      } while (!claim_.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel));
      call(ctx, static_cast<int64_t>(v & kItemMask), slot);
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  void helper(int slot) {
    uint64_t seen = 0;
    for (;;) {
      uint64_t gen;
      Call call;
      void* ctx;
      int64_t n;
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [&] { return gen_ != seen; });
        seen = gen_;
        if (slot > want_) continue;  // this call asked for fewer helpers
        gen = gen_; call = call_; ctx = ctx_; n = n_;
      }
      work(gen, call, ctx, n, slot);
    }
  }

  void start_threads(int helpers) {
    std::lock_guard<std::mutex> lock(mu_);
    for (; started_ < helpers; ++started_) std::thread([this, slot = started_ + 1] { helper(slot); }).detach();
  }

  // After fork(): the child has none of the parent's threads, and a lock another thread held stays held.
  void forget_threads() {
    new (&busy_) std::mutex();
    new (&mu_) std::mutex();
    new (&wake_) std::condition_variable();
    started_ = 0;
  }

  std::mutex busy_;  // one call at a time; it guards strikes_ and serial_calls_
  int strikes_ = 0;       // calls in a row that a helper held up
  int serial_calls_ = 0;  // calls left to run alone
  std::mutex mu_;
  std::condition_variable wake_;
  int started_ = 0;
  // The current call (written under mu_, read by helpers under mu_ after they see gen_ change).
  uint64_t gen_ = 0;
  int want_ = 0;
  int64_t n_ = 0;
  void* ctx_ = nullptr;
  Call call_ = nullptr;
  std::atomic<uint64_t> claim_{0};  // generation << kItemBits | next item
  std::atomic<int64_t> done_{0};
};

// Threads worth using for `work` units when each extra thread needs at least `per_thread` of them: 1 .. the torch
// thread count (at::get_num_threads).
inline int64_t threads_for(int64_t work, int64_t per_thread) {
  return std::clamp<int64_t>(work / per_thread, 1, at::get_num_threads());
}

}  // namespace fc
