// The phases one layer's RegMean merge went through, in the order first entered (the path
// it took: RegMeanInfo::phases), and, only in a build with LMDX_PROFILE (-DLMDX_PROFILE=ON,
// for benchmarks), the wall time of each (RegMeanInfo::timings; a phase entered again
// accumulates). Without LMDX_PROFILE no clock is read. Internal to the core.
#pragma once

#include <string>

#include "core/regmean.hpp"

#ifdef LMDX_PROFILE
#include <chrono>
#endif

LMDX_NAMESPACE_BEGIN

namespace detail {

class PhaseLog {
 public:
  explicit PhaseLog(RegMeanInfo& info) : info_(info) { restart(); }

  // The phase that just ended.
  void lap(const char* phase) {
    bool seen = false;
    for (const std::string& p : info_.phases) seen = seen || p == phase;
    if (!seen) info_.phases.emplace_back(phase);
#ifdef LMDX_PROFILE
    const Clock::time_point now = Clock::now();
    const double seconds = std::chrono::duration<double>(now - last_).count();
    last_ = now;
    for (auto& entry : info_.timings) {
      if (entry.first == phase) {
        entry.second += seconds;
        return;
      }
    }
    info_.timings.emplace_back(phase, seconds);
#endif
  }

  // The next phase starts now (time spent since the last lap belongs to no phase).
  void restart() {
#ifdef LMDX_PROFILE
    last_ = Clock::now();
#endif
  }

 private:
  RegMeanInfo& info_;
#ifdef LMDX_PROFILE
  using Clock = std::chrono::steady_clock;
  Clock::time_point last_;
#endif
};

}  // namespace detail

LMDX_NAMESPACE_END
