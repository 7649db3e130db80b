// parallel_stealing(begin, end, grain, f): at::parallel_for's contract (f(b, e) over disjoint ranges covering
// [begin, end), on torch's own OpenMP threads; serially inside a parallel region or with one thread; the first
// exception rethrown), but a thread that finishes its own part takes over what is left of another's.
//
// at::parallel_for cuts the range once into one part per thread, and the call ends when the slower part does (its
// thread started later, read slower memory or was preempted: the server's event loop and clients share the two cores
// a decode step runs on, issue 22). Here each thread still owns an equal contiguous part and runs it front to back,
// `grain` at a time (its reads stay one stream for the hardware prefetcher: handing out small chunks in turn instead
// cost Gemma's 16-row products 11-16 % on Zen 4), and one done with its own takes grains from the back of the
// others' parts. A part's (next, end) pair is one 64-bit word, so the owner's take and a thief's are one
// compare-and-swap each and never the same grain. Each grain computes the same elements whichever thread runs it:
// the same bits. Measured (docs/bench/HISTORY.md, "work stealing"): the 16-row decode step 0.15-0.56 ms shorter with
// the products and the screen on it, one row unchanged; it does not help much when another process preempts a
// thread, since the preempted thread still holds the grain it is in. Like at::parallel_for it has no num_threads
// clause (libgomp's pool, pytorch#32008); a part whose thread is not in the team is taken over the same way.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/ParallelGuard.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <vector>

namespace stealing {

struct alignas(64) Part {  // grains [next, end) of one thread's part, as (end << 32) | next
  std::atomic<uint64_t> range{0};
};

// The owner's next grain (from the front) or a thief's (from the back); false once the part is empty.
inline bool take(Part& part, bool front, int64_t& grain) {
  uint64_t r = part.range.load(std::memory_order_relaxed);
  while (true) {
    const uint64_t next = r & 0xFFFFFFFFu, end = r >> 32;
    if (next >= end) return false;
    const uint64_t taken = front ? (end << 32) | (next + 1) : ((end - 1) << 32) | next;
    if (part.range.compare_exchange_weak(r, taken, std::memory_order_relaxed)) {
      grain = static_cast<int64_t>(front ? next : end - 1);
      return true;
    }
  }
}

}  // namespace stealing

template <class F>
inline void parallel_stealing(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (end <= begin) return;
  grain = std::max<int64_t>(grain, 1);
  at::internal::lazy_init_num_threads();
  const int64_t grains = (end - begin + grain - 1) / grain;
  const int64_t parts = std::min<int64_t>(at::get_num_threads(), grains);
  if (parts <= 1 || at::in_parallel_region() || grains >= (int64_t{1} << 31)) {
    c10::ParallelGuard guard(true);
    f(begin, end);
    return;
  }
  std::vector<stealing::Part> part(parts);
  for (int64_t t = 0; t < parts; ++t)
    part[t].range.store((static_cast<uint64_t>((t + 1) * grains / parts) << 32) |
                        static_cast<uint64_t>(t * grains / parts));
  std::atomic_flag failed = ATOMIC_FLAG_INIT;  // the first exception is rethrown, as at::parallel_for does
  std::exception_ptr error;
  const auto run = [&](int64_t g) {
    try {
      f(begin + g * grain, std::min(end, begin + (g + 1) * grain));
    } catch (...) {
      if (!failed.test_and_set()) error = std::current_exception();
    }
  };
#pragma omp parallel
  {
    c10::ParallelGuard guard(true);
    const int64_t me = omp_get_thread_num();
    int64_t g = 0;
    if (me < parts)
      while (stealing::take(part[me], true, g)) run(g);
    for (int64_t k = 1; k <= parts; ++k)  // then the others' (and any part whose thread is not in the team)
      for (stealing::Part& other = part[(me + k) % parts]; stealing::take(other, false, g);) run(g);
  }
  if (error) std::rethrow_exception(error);
}
