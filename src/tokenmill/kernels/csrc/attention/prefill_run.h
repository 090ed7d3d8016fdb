// A prefill attention call's tasks over the threads: each sequence's new tokens in blocks, times its KV heads; on
// AMX tiles where attention/prefill_amx.h takes the job, else the vector tiles of attention/prefill.h.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "attention/prefill.h"
#include "attention/prefill_amx.h"

namespace tmk {

// Every task of the job over the threads: the longest first, each thread taking the next from a shared counter.
template <typename T, typename C>
void prefill_attention_run(const PrefillJob<T, C>& job, int64_t num_seqs) {
  const bool amx = amx_prefill<T>(job.Dh);
  const int64_t G = job.H / job.Hkv, qb = std::max<int64_t>(1, (amx ? AMX_PREFILL_ROWS : PREFILL_ROWS) / G);
  std::vector<PrefillTask> tasks;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t n_new = job.seqs[b * 3 + 1], first = job.seqs[b * 3 + 2] - n_new;
    for (int64_t i0 = 0; i0 < n_new; i0 += qb) {
      const int64_t i1 = std::min(n_new, i0 + qb), span = job.window > 0 ? std::min(job.window, first + i1) : first + i1;
      for (int64_t g = 0; g < job.Hkv; ++g) tasks.push_back({b, g, i0, i1, (i1 - i0) * span});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const PrefillTask& a, const PrefillTask& b) { return a.cost > b.cost; });
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (int64_t)tasks.size());
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    if (amx) {
      amx_configure_attention();
      AmxPrefillScratch sc(qb * G, (qb * G + 31) / 32 * 32, job.Dh);
      for (int64_t i = next.fetch_add(1); i < (int64_t)tasks.size(); i = next.fetch_add(1))
        prefill_task_amx(job, tasks[i], sc);
      amx_release_attention();
      return;
    }
    PrefillScratch<T> sc(qb * G, job.Dh);
    for (int64_t i = next.fetch_add(1); i < (int64_t)tasks.size(); i = next.fetch_add(1)) prefill_task(job, tasks[i], sc);
  });
}

}  // namespace tmk
