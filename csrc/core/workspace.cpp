#include "core/workspace.hpp"

#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <new>
#include <vector>

#ifdef __linux__
#include <sys/mman.h>
#endif

LMDX_NAMESPACE_BEGIN

namespace {

constexpr size_t kAlign = 64;

struct Pool {
  std::mutex mutex;
  std::vector<std::unique_ptr<PooledBuffer>> free;
};

Pool& pool() {
  static Pool* p = new Pool();  // intentionally leaked: outlives static destructors
  return *p;
}

}  // namespace

void prefer_huge_pages(void* data, size_t bytes) noexcept {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{1} << 21;
  if (data == nullptr || bytes < 2 * kHuge) return;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(kHuge - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)data;
  (void)bytes;
#endif
}

struct PooledBuffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  explicit PooledBuffer(size_t n) : bytes((n + kAlign - 1) / kAlign * kAlign) {
    ptr = std::aligned_alloc(kAlign, bytes == 0 ? kAlign : bytes);
    if (ptr == nullptr) throw std::bad_alloc();
  }
  ~PooledBuffer() { std::free(ptr); }
  PooledBuffer(const PooledBuffer&) = delete;
  PooledBuffer& operator=(const PooledBuffer&) = delete;
};

template <typename T>
BufferLease<T>::BufferLease(size_t size) {
  const size_t bytes = size * sizeof(T);
  {
    // Smallest pooled buffer that is large enough.
    std::lock_guard<std::mutex> lock(pool().mutex);
    auto& free = pool().free;
    auto best = free.end();
    for (auto it = free.begin(); it != free.end(); ++it) {
      if ((*it)->bytes >= bytes && (best == free.end() || (*it)->bytes < (*best)->bytes)) best = it;
    }
    if (best != free.end()) {
      block_ = std::move(*best);
      free.erase(best);
    }
  }
  if (!block_) block_ = std::make_unique<PooledBuffer>(bytes);
  data_ = static_cast<T*>(block_->ptr);
}

template <typename T>
BufferLease<T>::~BufferLease() {
  std::lock_guard<std::mutex> lock(pool().mutex);
  pool().free.push_back(std::move(block_));
}

template class BufferLease<float>;
template class BufferLease<double>;
template class BufferLease<Index>;
template class BufferLease<std::uint16_t>;

void release_scratch() noexcept {
  std::lock_guard<std::mutex> lock(pool().mutex);
  pool().free.clear();
}

size_t scratch_bytes() noexcept {
  std::lock_guard<std::mutex> lock(pool().mutex);
  size_t total = 0;
  for (auto& buffer : pool().free) total += buffer->bytes;
  return total;
}

LMDX_NAMESPACE_END
