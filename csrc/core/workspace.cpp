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

// Matrices under this many bytes are not pooled: the allocator reuses them itself.
constexpr size_t kPooledMatrixBytes = size_t{4} << 20;

template <typename Scalar>
struct FreeMatrix {
  Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic> m;
  uint64_t stamp;  // when it was given back
};

struct Pool {
  std::mutex mutex;
  std::vector<std::unique_ptr<PooledBuffer>> free;
  // Free matrices, oldest first within each type; matrix_bytes: their total.
  std::vector<FreeMatrix<double>> doubles;
  std::vector<FreeMatrix<float>> floats;
  size_t matrix_bytes = 0;
  uint64_t stamp = 0;
  std::vector<FreeMatrix<double>>& matrices(double*) { return doubles; }
  std::vector<FreeMatrix<float>>& matrices(float*) { return floats; }
};

template <typename Scalar>
size_t bytes_of(const Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic>& m) {
  return static_cast<size_t>(m.size()) * sizeof(Scalar);
}

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

template <typename Scalar>
void PooledMatrix<Scalar>::resize(Index rows, Index cols) {
  if (rows * cols == this->size()) {
    Base::resize(rows, cols);  // (the same storage)
    return;
  }
  give_back();
  if (static_cast<size_t>(rows * cols) * sizeof(Scalar) >= kPooledMatrixBytes) {
    std::lock_guard<std::mutex> lock(pool().mutex);
    auto& free = pool().matrices(static_cast<Scalar*>(nullptr));
    for (auto it = free.end(); it != free.begin();) {  // the newest first
      --it;
      if (it->m.size() == rows * cols) {
        this->swap(it->m);
        pool().matrix_bytes -= bytes_of<Scalar>(*this);
        free.erase(it);
        Base::resize(rows, cols);
        return;
      }
    }
  }
  Base::resize(rows, cols);
  prefer_huge_pages(*this);
}

template <typename Scalar>
void PooledMatrix<Scalar>::give_back() noexcept {
  const size_t bytes = bytes_of<Scalar>(*this);
  if (bytes >= kPooledMatrixBytes && bytes <= kMatrixPoolBytes) {
    Pool& p = pool();
    std::lock_guard<std::mutex> lock(p.mutex);
    try {
      auto& free = p.matrices(static_cast<Scalar*>(nullptr));
      free.push_back(FreeMatrix<Scalar>{{}, ++p.stamp});
      free.back().m.swap(*this);
      p.matrix_bytes += bytes;
    } catch (...) {  // (no room to record it: freed below)
    }
    while (p.matrix_bytes > kMatrixPoolBytes) {  // the oldest leave first
      const bool d = !p.doubles.empty() &&
                     (p.floats.empty() || p.doubles.front().stamp < p.floats.front().stamp);
      if (d) {
        p.matrix_bytes -= bytes_of<double>(p.doubles.front().m);
        p.doubles.erase(p.doubles.begin());
      } else {
        p.matrix_bytes -= bytes_of<float>(p.floats.front().m);
        p.floats.erase(p.floats.begin());
      }
    }
  }
  Base::resize(0, 0);
}

template class PooledMatrix<double>;
template class PooledMatrix<float>;

template class BufferLease<float>;
template class BufferLease<double>;
template class BufferLease<Index>;
template class BufferLease<std::uint16_t>;

void release_scratch() noexcept {
  std::lock_guard<std::mutex> lock(pool().mutex);
  pool().free.clear();
  pool().doubles.clear();
  pool().floats.clear();
  pool().matrix_bytes = 0;
}

size_t scratch_bytes() noexcept {
  std::lock_guard<std::mutex> lock(pool().mutex);
  size_t total = 0;
  for (auto& buffer : pool().free) total += buffer->bytes;
  return total + pool().matrix_bytes;
}

LMDX_NAMESPACE_END
