// A work pool for the decode stack that never waits for a thread that is not running.
//
// OpenMP (torch's at::parallel_for) ends every parallel region at a barrier: all threads must arrive. On a
// machine where another process holds a core, the thread that lost its core arrives a scheduler slice later, and
// a decode step has hundreds of regions: a several-fold loss (docs/archive/benchmark-log-2026-11.md). Here a step is a list of stages,
// each cut into chunks; the caller and the helpers claim chunks from one atomic cursor, and a stage ends when
// all of its chunks are done, not when every thread has checked in. A helper that is off its core claims
// nothing, and the caller does its share.
//
// When the machine is oversubscribed even a helper that claims nothing costs: a spinning helper is one more
// runnable thread, and the scheduler takes that share from the caller. So the caller measures each program (its
// thread CPU time over the wall time, `Contention`): when it got less than 80% of a core over the last 20 ms of
// programs, other work is competing, and the helpers sleep for the next half second; then one program tries them
// again.
//
// The cursor packs {program epoch, stage, next chunk}: a claim is a compare-and-swap on it, so a helper holding a
// stale view (an older program or stage) can never claim a chunk that is not the current one.
//
// A chunk that throws (a small buffer's bad_alloc) would end the process on a helper thread and, on the caller, leave
// helpers running the stage after run() had unwound. So every chunk runs under a catch: the first exception is
// kept, the stage's other chunks are claimed and skipped, and run() drains that stage, goes idle as after any
// program, and rethrows it to its caller.
//
// One pool per helper count serves every program in the process (`Pool::shared`): a target model's decode stack
// and its draft's take turns on the same helpers, where a pool each would leave one pool's helper spinning on a
// core while the other pool works. Programs own their stages; the pool runs one program at a time, and a program
// is not referenced by the pool once its run returns (helpers enter claims counted, and run waits them out).
#pragma once

#include <time.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TM_PAUSE() _mm_pause()
#else
#define TM_PAUSE() std::this_thread::yield()
#endif

namespace tmk {

// Whether other work competes for the cores, from each program's wall time and the caller's CPU time in it. A
// program in which the caller got under 80% of a core is as often the host's hiccup (a VM's core descheduled for a
// few ms, now and then even on a quiet VM, each then costing half a second of one-thread steps).
// So programs are judged together, in windows of at least two programs and 20 ms: a hiccup of a few ms leaves a
// window above 80%, a competing process keeps it under whether it starves every program (steps longer than its
// time slice) or one in a few (short ones). The first program after a rest is judged alone. Programs shorter than
// 200 us say nothing.
struct Contention {
  static constexpr double kWindow = 20e-3;  // seconds of programs judged together, at least
  double wall = 0, cpu = 0;                 // the current window's sums
  int programs = 0;                         // ... over this many programs
  bool probing = false;                     // the next program is the first after a rest
  // the program just run: true when the helpers should rest
  bool starved_again(double w, double c) {
    if (w <= 200e-6) return false;
    if (probing) return probing = c < 0.8 * w;
    wall += w, cpu += c, ++programs;
    if (programs < 2 || wall < kWindow) return false;
    probing = cpu < 0.8 * wall;
    wall = cpu = 0, programs = 0;
    return probing;
  }
};

struct Stage {
  std::atomic<int64_t> n{0};         // chunks in this stage
  std::function<void(int64_t)> fn;  // runs chunk c
};

class Pool {
 public:
  explicit Pool(int helpers) {
    for (int i = 0; i < helpers; ++i) threads_.emplace_back([this, i] { helper(i); });
  }
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  // The process's pool with `helpers` helper threads, made on first use and kept for the process's life.
  static Pool& shared(int helpers) {
    static std::mutex made_mutex;
    static std::vector<std::pair<int, Pool*>> made;
    std::lock_guard<std::mutex> lock(made_mutex);
    for (auto& [n, pool] : made)
      if (n == helpers) return *pool;
    made.emplace_back(helpers, new Pool(helpers));  // never freed: its helpers run until the process exits
    return *made.back().second;
  }

  // Run stages [0, count) of `stages` in order, each stage's chunks on whichever threads claim them; returns when
  // all are done and no helper holds a reference to `stages`. One program at a time: other callers wait.
  // `marks` (count + 1 doubles, or null): the CLOCK_MONOTONIC seconds at the start and as each stage ended, as the
  // caller saw them (the stack's profile).
  void run(Stage* stages, int64_t count, double* marks = nullptr) {
    std::lock_guard<std::mutex> owner(owner_mutex_);
    const double wall0 = now(CLOCK_MONOTONIC), cpu0 = now(CLOCK_THREAD_CPUTIME_ID);
    if (marks) marks[0] = wall0;
    const int helpers = wall0 < quiet_after_ ? 0 : (int)threads_.size();
    active_.store(helpers, std::memory_order_seq_cst);
    program_.store(stages, std::memory_order_seq_cst), count_.store(count, std::memory_order_seq_cst);
    epoch_ = (epoch_ + 1) & kEpochMask;
    for (int64_t s = 0; s < count; ++s) {
      done_.store(0, std::memory_order_relaxed);
      cursor_.store(pack(epoch_, s, 0), std::memory_order_seq_cst);
      if (s == 0 && helpers > 0 && sleepers_.load(std::memory_order_seq_cst) > 0) {
        { std::lock_guard<std::mutex> lock(mutex_); }
        wake_.notify_all();
      }
      while (claim()) {
      }
      const int64_t n = stages[s].n.load(std::memory_order_relaxed);
      for (int spins = 0; done_.load(std::memory_order_acquire) < n; ++spins) {
        if (spins < 4096) TM_PAUSE();  // a helper is finishing its chunk
        else std::this_thread::yield();  // ... and may be off its core: let it run
      }
      if (marks) marks[s + 1] = now(CLOCK_MONOTONIC);
      if (failed_.load(std::memory_order_acquire)) break;  // a chunk threw: no later stage runs
    }
    cursor_.store(kIdle, std::memory_order_seq_cst);
    for (int spins = 0; inside_.load(std::memory_order_seq_cst) > 0; ++spins) {  // a helper between cursor and claim
      if (spins < 4096) TM_PAUSE();
      else std::this_thread::yield();
    }
    if (failed_.load(std::memory_order_acquire)) {
      std::exception_ptr error;
      {
        std::lock_guard<std::mutex> lock(error_mutex_);
        std::swap(error, error_);
      }
      failed_.store(false, std::memory_order_relaxed);
      std::rethrow_exception(error);
    }
    const double wall = now(CLOCK_MONOTONIC) - wall0, cpu = now(CLOCK_THREAD_CPUTIME_ID) - cpu0;
    if (helpers > 0 && contention_.starved_again(wall, cpu)) quiet_after_ = wall0 + wall + 0.5;  // see the top
  }

 private:
  static constexpr uint64_t kIdle = ~0ull;
  static constexpr uint64_t kEpochMask = (1ull << 28) - 1;
  static double now(clockid_t clock) {
    timespec t;
    clock_gettime(clock, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
  }
  static uint64_t pack(uint64_t epoch, uint64_t stage, uint64_t chunk) { return epoch << 36 | stage << 22 | chunk; }

  // Claim one chunk of the current stage and run it; false when there is none to claim. The program's stages are
  // read only while the cursor is that program's (run stores kIdle, then waits for `inside_` to drain).
  bool claim() {
    struct Inside {
      std::atomic<int>& n;
      explicit Inside(std::atomic<int>& c) : n(c) { n.fetch_add(1, std::memory_order_seq_cst); }
      ~Inside() { n.fetch_sub(1, std::memory_order_seq_cst); }
    } inside(inside_);
    uint64_t v = cursor_.load(std::memory_order_seq_cst);
    for (;;) {
      if (v == kIdle) return false;
      Stage* stages = program_.load(std::memory_order_seq_cst);
      const int64_t stage = (v >> 22) & ((1 << 14) - 1), chunk = v & ((1 << 22) - 1);
      if (stage >= count_.load(std::memory_order_seq_cst) || chunk >= stages[stage].n.load(std::memory_order_relaxed))
        return false;
      if (cursor_.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel)) {
        if (!failed_.load(std::memory_order_acquire)) {
          try {
            stages[stage].fn(chunk);
          } catch (...) {  // kept for run() to rethrow; the chunk counts as done either way
            std::lock_guard<std::mutex> lock(error_mutex_);
            if (!error_) error_ = std::current_exception();
            failed_.store(true, std::memory_order_release);
          }
        }
        done_.fetch_add(1, std::memory_order_release);
        return true;
      }
    }
  }

  void helper(int index) {
    int idle = 0;
    for (;;) {
      if (index < active_.load(std::memory_order_relaxed) && cursor_.load(std::memory_order_relaxed) != kIdle &&
          claim()) {
        idle = 0;
        continue;
      }
      if (++idle < 4000) {  // ~100 microseconds: the next stage or step is usually that close
        TM_PAUSE();
        continue;
      }
      std::unique_lock<std::mutex> lock(mutex_);
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      wake_.wait(lock, [this, index] {
        return index < active_.load(std::memory_order_seq_cst) && cursor_.load(std::memory_order_seq_cst) != kIdle;
      });
      sleepers_.fetch_sub(1, std::memory_order_seq_cst);
      idle = 0;
    }
  }

  std::atomic<uint64_t> cursor_{kIdle};
  std::atomic<Stage*> program_{nullptr};
  std::atomic<int64_t> count_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<int> inside_{0};  // helpers inside claim()
  std::atomic<int> active_{0};  // helpers [0, active_) take part in the current program
  std::atomic<bool> failed_{false};  // a chunk of the current program threw; error_ holds the first exception
  std::exception_ptr error_;
  std::mutex error_mutex_;
  uint64_t epoch_ = 0;
  double quiet_after_ = 0;  // the helpers rest until this time (CLOCK_MONOTONIC seconds)
  Contention contention_;
  std::mutex owner_mutex_;  // one program at a time
  std::mutex mutex_;
  std::condition_variable wake_;
  std::vector<std::thread> threads_;
};

// A program for the shared pool: its stages, set by its owner between runs.
class Program {
 public:
  Program(int helpers, int64_t max_stages) : pool_(Pool::shared(helpers)), stages_(new Stage[max_stages]) {}
  void set_stage(int64_t i, std::function<void(int64_t)> fn) { stages_[i].fn = std::move(fn); }
  void set_chunks(int64_t i, int64_t chunks) { stages_[i].n.store(chunks, std::memory_order_relaxed); }
  void run(int64_t count, double* marks = nullptr) { pool_.run(stages_.get(), count, marks); }

 private:
  Pool& pool_;
  std::unique_ptr<Stage[]> stages_;
};

// (tests) A program of `count` stages of `chunks` chunks on the pool of `helpers` helpers: chunk c of stage s adds
// c + 1 to sums[s] (atomically), except chunk `throw_at` of stage 1, which throws std::runtime_error. Returns the
// sums and the message of what run() threw ("" when nothing).
inline std::pair<std::vector<int64_t>, std::string> pool_selftest(int helpers, int64_t count, int64_t chunks,
                                                                  int64_t throw_at) {
  std::vector<std::atomic<int64_t>> sums(count);
  Program program(helpers, count);
  for (int64_t s = 0; s < count; ++s) {
    program.set_stage(s, [&sums, s, throw_at](int64_t c) {
      if (s == 1 && c == throw_at) throw std::runtime_error("pool selftest: chunk " + std::to_string(c) + " threw");
      sums[s].fetch_add(c + 1, std::memory_order_relaxed);
    });
    program.set_chunks(s, chunks);
  }
  std::string error;
  try {
    program.run(count);
  } catch (const std::exception& e) {
    error = e.what();
  }
  std::vector<int64_t> out;
  for (const auto& v : sums) out.push_back(v.load());
  return {out, error};
}

}  // namespace tmk
