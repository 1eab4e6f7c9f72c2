// A few threads that share the parts of one job with the thread that asks (decoder_layer.cpp's GEMMs and
// attention). Parts are claimed one at a time from a shared counter, the caller claiming too: a helper that has
// no core at the moment (another process holds it) claims nothing and the caller does its parts, so a busy
// machine costs speed, never a stall of a scheduler quantum per job. Which thread computes a part never changes
// its result (each part writes its own outputs), so the bits are those of one thread.
//
// Helpers spin a little after each job (the layers' jobs come microseconds apart), then sleep until the next.
// Waking a sleeping helper costs tens of microseconds on a VM, which Python's gaps between a step's calls pay
// again and again: while an owner holds the pool (hold), its helpers keep spinning between jobs instead, up to
// kHeldSpin of no job at all (then they sleep all the same); once no hold is left, the usual kSpin.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace dflash {

class WorkerPool {
 public:
  using Part = void (*)(void* context, int64_t part);

  explicit WorkerPool(int threads);  // threads in all, the caller included (1: no helpers, every job inline)
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  int threads() const { return static_cast<int>(helpers_.size()) + 1; }
  // Runs part(context, p) for p in [0, parts), on this thread and the helpers; returns when every part is done.
  // Jobs from several threads at once run one after another (ctypes calls release the GIL).
  void run(int64_t parts, Part part, void* context);
  // on: one more hold (helpers asleep are woken now, so that they are spinning when the first job comes); off: one
  // hold fewer (none below zero). Holds nest. Changes no result.
  void hold(bool on);

 private:
  void help();
  // Claims and runs parts of the job of generation `generation` until none is left or a newer job started.
  void work_on(uint64_t generation);

  // (generation << 32) | the next unclaimed part: a claim is a compare-and-swap that fails once a newer job
  // replaced the one a late helper saw.
  std::atomic<uint64_t> job_{0};
  std::atomic<Part> part_{nullptr};
  std::atomic<void*> context_{nullptr};
  std::atomic<int64_t> parts_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<int> sleeping_{0};
  std::atomic<int> holds_{0};
  std::atomic<uint64_t> wakes_{0};  // counts hold(true) calls: a helper that sees it change does not fall asleep
  std::atomic<bool> stop_{false};
  std::mutex mutex_;
  std::mutex run_mutex_;  // one job at a time
  std::condition_variable wake_;
  std::vector<std::thread> helpers_;
};

}  // namespace dflash
