#include "core/workspace.hpp"

#include <mutex>

LMDX_NAMESPACE_BEGIN

namespace {

template <typename T>
struct Pool {
  std::mutex mutex;
  std::vector<std::unique_ptr<GramScratch<T>>> free;
};

template <typename T>
Pool<T>& pool() {
  static Pool<T>* p = new Pool<T>();  // intentionally leaked: outlives static destructors
  return *p;
}

template <typename T>
size_t bytes_of(const GramScratch<T>& s) {
  return static_cast<size_t>(s.gram.size() + s.rows.size()) * sizeof(T) +
         static_cast<size_t>(s.sum.size()) * sizeof(double);
}

}  // namespace

template <typename T>
ScratchLease<T>::ScratchLease(Index dim, int count) {
  items_.reserve(static_cast<size_t>(count));
  {
    std::lock_guard<std::mutex> lock(pool<T>().mutex);
    auto& free = pool<T>().free;
    for (auto it = free.begin(); it != free.end() && static_cast<int>(items_.size()) < count;) {
      if ((*it)->dim == dim) {
        items_.push_back(std::move(*it));
        it = free.erase(it);
      } else {
        ++it;
      }
    }
  }
  while (static_cast<int>(items_.size()) < count) {
    items_.push_back(std::make_unique<GramScratch<T>>(dim));
  }
}

template <typename T>
ScratchLease<T>::~ScratchLease() {
  std::lock_guard<std::mutex> lock(pool<T>().mutex);
  for (auto& item : items_) pool<T>().free.push_back(std::move(item));
}

void release_scratch() noexcept {
  {
    std::lock_guard<std::mutex> lock(pool<float>().mutex);
    pool<float>().free.clear();
  }
  std::lock_guard<std::mutex> lock(pool<double>().mutex);
  pool<double>().free.clear();
}

size_t scratch_bytes() noexcept {
  size_t total = 0;
  {
    std::lock_guard<std::mutex> lock(pool<float>().mutex);
    for (auto& s : pool<float>().free) total += bytes_of(*s);
  }
  std::lock_guard<std::mutex> lock(pool<double>().mutex);
  for (auto& s : pool<double>().free) total += bytes_of(*s);
  return total;
}

template class ScratchLease<float>;
template class ScratchLease<double>;

LMDX_NAMESPACE_END
