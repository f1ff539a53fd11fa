// A pool of worker threads, one per core beyond the caller's, for the products' rows.
#pragma once

#include <cstdint>
#include <functional>

namespace mlx_tfm_kernels {

// Runs task(i) for i in [0, tasks) on the caller and the workers, returning when all are
// done. Tasks are taken from a shared counter, so a core slowed by other work takes fewer.
// A call made while the pool serves another caller (another MLX stream) runs inline.
void parallel_for(int64_t tasks, const std::function<void(int64_t)>& task);

// Threads that take part (the caller included): MLX_TFM_KERNELS_THREADS, else the cores
// this process may run on.
int pool_threads();

}  // namespace mlx_tfm_kernels
