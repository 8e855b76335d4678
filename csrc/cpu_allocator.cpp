// The block cache behind fasttrans::cpu::empty (see cpu_allocator.h for why it exists).
#include "cpu_allocator.h"

#include <ATen/EmptyTensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <cstdlib>
#include <mutex>

namespace fasttrans::cpu {
namespace {

constexpr size_t kPage = 4096;

struct Block {
  void* ptr;
  size_t size;  // bytes allocated (a whole number of pages)
};

class BlockCache final : public c10::Allocator {
 public:
  BlockCache() {
    const char* env = std::getenv("FASTTRANS_CPU_CACHE_MB");
    long long mb = 256;
    if (env != nullptr && *env != '\0') {
      char* end = nullptr;
      long long v = std::strtoll(env, &end, 10);
      // fasttrans/extension.py refuses anything but a non-negative integer before loading us
      if (end != env && *end == '\0' && v >= 0) mb = v;
    }
    limit_ = static_cast<size_t>(mb) << 20;
  }

  c10::DataPtr allocate(size_t n) override {
    if (n < kMinCachedBytes || limit_ == 0) return c10::GetCPUAllocator()->allocate(n);
    const size_t want = (n + kPage - 1) / kPage * kPage;
    Block* block = take(want);
    if (block == nullptr) {
      block = new Block{c10::alloc_cpu(want), want};
      std::lock_guard<std::mutex> guard(mutex_);
      ++misses_;
      in_use_ += want;
    }
    report(block->ptr, static_cast<int64_t>(block->size));
    return {block->ptr, block, &BlockCache::give_back, c10::Device(c10::DeviceType::CPU)};
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  std::vector<int64_t> stats() {
    std::lock_guard<std::mutex> guard(mutex_);
    return {static_cast<int64_t>(cached_bytes_), static_cast<int64_t>(cached_.size()),
            static_cast<int64_t>(in_use_),       hits_,
            misses_,                             static_cast<int64_t>(limit_)};
  }

  void clear() {
    std::vector<Block*> out;
    {
      std::lock_guard<std::mutex> guard(mutex_);
      out.swap(cached_);
      cached_bytes_ = 0;
    }
    for (Block* b : out) release(b);
  }

 private:
  // The smallest cached block of at least `want` bytes wasting at most an eighth of it.
  Block* take(size_t want) {
    std::lock_guard<std::mutex> guard(mutex_);
    size_t best = cached_.size();
    for (size_t i = 0; i < cached_.size(); ++i) {
      const size_t s = cached_[i]->size;
      if (s >= want && s - want <= want / 8 && (best == cached_.size() || s < cached_[best]->size)) best = i;
    }
    if (best == cached_.size()) return nullptr;
    Block* b = cached_[best];
    cached_.erase(cached_.begin() + static_cast<std::ptrdiff_t>(best));
    cached_bytes_ -= b->size;
    in_use_ += b->size;
    ++hits_;
    return b;
  }

  static void give_back(void* ctx) { instance().put(static_cast<Block*>(ctx)); }

  void put(Block* b) {
    report(b->ptr, -static_cast<int64_t>(b->size));
    std::vector<Block*> evicted;
    {
      std::lock_guard<std::mutex> guard(mutex_);
      in_use_ -= b->size;
      if (b->size > limit_) {
        evicted.push_back(b);
      } else {
        cached_.push_back(b);
        cached_bytes_ += b->size;
        size_t drop = 0;  // oldest first
        size_t bytes = cached_bytes_;
        while (bytes > limit_) bytes -= cached_[drop++]->size;
        evicted.assign(cached_.begin(), cached_.begin() + static_cast<std::ptrdiff_t>(drop));
        cached_.erase(cached_.begin(), cached_.begin() + static_cast<std::ptrdiff_t>(drop));
        cached_bytes_ = bytes;
      }
    }
    for (Block* e : evicted) release(e);
  }

  static void release(Block* b) {
    c10::free_cpu(b->ptr);
    delete b;
  }

  // torch.profiler's memory view (and the benchmarks' peak memory) counts these blocks as
  // allocated while a tensor holds them, as it does torch's own.
  void report(void* ptr, int64_t delta) {
    if (!c10::memoryProfilingEnabled()) return;
    size_t in_use = 0;
    size_t reserved = 0;
    {
      std::lock_guard<std::mutex> guard(mutex_);
      in_use = in_use_;
      reserved = in_use_ + cached_bytes_;
    }
    c10::reportMemoryUsageToProfiler(ptr, delta, in_use, reserved, c10::Device(c10::DeviceType::CPU));
  }

 public:
  // Never destroyed: tensors may be freed during interpreter shutdown, after static
  // destructors have run.
  static BlockCache& instance() {
    static BlockCache* cache = new BlockCache();
    return *cache;
  }

 private:
  std::mutex mutex_;
  std::vector<Block*> cached_;
  size_t cached_bytes_ = 0;
  size_t in_use_ = 0;
  size_t limit_ = 0;
  int64_t hits_ = 0;
  int64_t misses_ = 0;
};

}  // namespace

at::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
  TORCH_INTERNAL_ASSERT(options.device().is_cpu());
  return at::detail::empty_generic(sizes, &BlockCache::instance(), c10::DispatchKeySet(c10::DispatchKey::CPU),
                                   c10::typeMetaToScalarType(options.dtype()), c10::MemoryFormat::Contiguous);
}

at::Tensor zeros(at::IntArrayRef sizes, const at::TensorOptions& options) { return empty(sizes, options).zero_(); }

std::vector<int64_t> cpu_cache_stats() { return BlockCache::instance().stats(); }

void cpu_cache_clear() { BlockCache::instance().clear(); }

}  // namespace fasttrans::cpu
