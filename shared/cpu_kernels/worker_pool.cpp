// worker_pool.h's pool, and its C ABI for ctypes (create, destroy; decoder_layer.cpp's jobs run on it).
#include "worker_pool.h"

#include <immintrin.h>

#include <chrono>

namespace dflash {

namespace {

constexpr auto kSpin = std::chrono::microseconds(50);  // how long an idle helper waits awake for the next job
constexpr uint64_t kPartMask = 0xffffffffu;  // the low 32 bits of job_: the next unclaimed part
constexpr uint64_t kClosed = kPartMask;  // a job's part counter once it is over: no part of it can be claimed

}  // namespace

WorkerPool::WorkerPool(int threads) {
  for (int i = 1; i < threads; ++i) helpers_.emplace_back([this] { help(); });
}

WorkerPool::~WorkerPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_.store(true);
  }
  wake_.notify_all();
  for (std::thread& helper : helpers_) helper.join();
}

void WorkerPool::run(int64_t parts, Part part, void* context) {
  if (helpers_.empty() || parts <= 1) {
    for (int64_t p = 0; p < parts; ++p) part(context, p);
    return;
  }
  std::lock_guard<std::mutex> one_job(run_mutex_);
  const uint64_t previous = job_.load() >> 32;
  // Close the last job before its description is overwritten: a helper that saw that job but reads the new
  // description can then claim nothing with it (its claim of the old counter fails).
  job_.store((previous << 32) | kClosed);
  part_.store(part);
  context_.store(context);
  parts_.store(parts);
  done_.store(0);
  const uint64_t generation = previous + 1;
  job_.store(generation << 32);  // publishes the job (sequentially consistent, as is every atomic here)
  if (sleeping_.load() > 0) {
    { std::lock_guard<std::mutex> lock(mutex_); }  // a helper between its check and its wait holds the lock
    wake_.notify_all();
  }
  work_on(generation);
  for (int spins = 0; done_.load() < parts; ++spins) {  // a helper finishing a part it claimed
    if (spins < 4096) {
      _mm_pause();
    } else {
      std::this_thread::yield();
    }
  }
}

void WorkerPool::work_on(uint64_t generation) {
  // The counter first, then the description: a claim succeeds only while the counter still holds the value read,
  // so before run() closed this job and described the next one; the description read is then this job's.
  uint64_t job = job_.load();
  const Part part = part_.load();
  void* const context = context_.load();
  const int64_t parts = parts_.load();
  while ((job >> 32) == generation && static_cast<int64_t>(job & kPartMask) < parts) {
    if (job_.compare_exchange_weak(job, job + 1)) {  // claimed part (job & kPartMask) of this generation
      part(context, static_cast<int64_t>(job & kPartMask));
      done_.fetch_add(1);
      job = job_.load();
    }
  }
}

void WorkerPool::help() {
  uint64_t seen = job_.load() >> 32;
  while (true) {
    const auto idle_since = std::chrono::steady_clock::now();
    uint64_t generation = job_.load() >> 32;
    for (int spins = 0; generation == seen && !stop_.load(); ++spins) {
      _mm_pause();
      if (spins % 64 == 63 && std::chrono::steady_clock::now() - idle_since > kSpin) {
        std::unique_lock<std::mutex> lock(mutex_);
        sleeping_.fetch_add(1);
        wake_.wait(lock, [&] { return (job_.load() >> 32) != seen || stop_.load(); });
        sleeping_.fetch_sub(1);
      }
      generation = job_.load() >> 32;
    }
    if (stop_.load()) return;
    seen = generation;
    work_on(generation);
  }
}

}  // namespace dflash

extern "C" {

void* dflash_pool_create(int64_t threads) { return new dflash::WorkerPool(threads < 1 ? 1 : static_cast<int>(threads)); }

void dflash_pool_destroy(void* pool) { delete static_cast<dflash::WorkerPool*>(pool); }

}  // extern "C"
