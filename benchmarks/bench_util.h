// What the C++ benchmark programs share: how they summarise their timings.
#ifndef DEEPNEX_BENCHMARKS_BENCH_UTIL_H_
#define DEEPNEX_BENCHMARKS_BENCH_UTIL_H_

#include <time.h>

#include <algorithm>
#include <vector>

namespace deepnex::bench {

// The median (the mean of the middle two of an even count). REQUIRES: v is
// not empty.
inline double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// CPU seconds this process has used, all its threads (ended ones too).
inline double ProcessCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + ts.tv_nsec * 1e-9;
}

}  // namespace deepnex::bench

#endif  // DEEPNEX_BENCHMARKS_BENCH_UTIL_H_
