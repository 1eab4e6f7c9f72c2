// worker_pool.h's pool, and its C ABI for ctypes (create, destroy; decoder_layer.cpp's jobs run on it).
#include "worker_pool.h"

#include <immintrin.h>

#include <chrono>

namespace dflash {

namespace {

constexpr auto kSpin = std::chrono::microseconds(50);  // how long an idle helper waits awake for the next job
constexpr auto kHeldSpin = std::chrono::milliseconds(2);  // the same while the pool is held
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

void WorkerPool::hold(bool on) {
  if (!on) {
    int holds = holds_.load();  // one hold fewer, never below none (an unmatched release changes nothing)
    while (holds > 0 && !holds_.compare_exchange_weak(holds, holds - 1)) {
    }
    return;
  }
  holds_.fetch_add(1);
  wakes_.fetch_add(1);  // before sleeping_ is read: a helper about to sleep either sees this or is seen asleep
  if (sleeping_.load() > 0) {
    { std::lock_guard<std::mutex> lock(mutex_); }
    wake_.notify_all();
  }
}

void WorkerPool::help() {
  using Clock = std::chrono::steady_clock;
  uint64_t seen = job_.load() >> 32;
  uint64_t wakes = wakes_.load();
  auto idle_since = Clock::now();
  for (uint32_t spins = 1; !stop_.load(); ++spins) {
    const uint64_t generation = job_.load() >> 32;
    if (generation != seen) {
      seen = generation;
      work_on(generation);
      idle_since = Clock::now();
      continue;
    }
    _mm_pause();
    if (spins % 64 != 0) continue;
    if (wakes_.load() != wakes) {  // a new hold: idle from now on
      wakes = wakes_.load();
      idle_since = Clock::now();
    }
    if (Clock::now() - idle_since <= (holds_.load() > 0 ? kHeldSpin : kSpin)) continue;
    std::unique_lock<std::mutex> lock(mutex_);
    sleeping_.fetch_add(1);
    wake_.wait(lock, [&] { return (job_.load() >> 32) != seen || stop_.load() || wakes_.load() != wakes; });
    sleeping_.fetch_sub(1);
    wakes = wakes_.load();
    idle_since = Clock::now();
  }
}

}  // namespace dflash

extern "C" {

void* dflash_pool_create(int64_t threads) { return new dflash::WorkerPool(threads < 1 ? 1 : static_cast<int>(threads)); }

void dflash_pool_destroy(void* pool) { delete static_cast<dflash::WorkerPool*>(pool); }

void dflash_pool_hold(void* pool, int64_t on) { static_cast<dflash::WorkerPool*>(pool)->hold(on != 0); }

}  // extern "C"
