// One pass over a worker's buffer for TASC: a = g + e and the energy ||a_b||^2 of each block.
//
// An XLA FFI handler for the CPU (see tasc/fused.py, which builds and registers it). XLA's CPU
// backend writes g + e and then reads it again to reduce it; here each element is summed,
// stored and squared while it is in a register, so the compression reads g and e and writes a
// once: the memory traffic of g + e alone.
//
// Blocks are split into chunks that the calling thread and XLA's intra-op thread pool take from
// a shared counter. The caller works too, so the call finishes even when no pool thread is
// free, and each block is summed by one thread in a fixed order: the result does not depend on
// the threads.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Independent partial sums per block, so that the compiler vectorises the loop without
// reassociating float additions (which it may not do without -ffast-math).
constexpr int64_t kLanes = 16;
// Elements per unit of work: large enough that taking one costs nothing, small enough that
// the threads finish together.
constexpr int64_t kChunkElements = 1 << 16;

void SumAndSquare(const float* g, const float* e, float* a, float* energies, int64_t size,
                  int64_t block_size, int64_t first_block, int64_t last_block) {
  for (int64_t b = first_block; b < last_block; ++b) {
    const int64_t start = b * block_size;
    const int64_t stop = std::min(start + block_size, size);
    float lanes[kLanes] = {};
    int64_t i = start;
    for (; i + kLanes <= stop; i += kLanes) {
      for (int64_t l = 0; l < kLanes; ++l) {
        const float v = g[i + l] + e[i + l];
        a[i + l] = v;
        lanes[l] += v * v;
      }
    }
    float rest = 0.0f;
    for (; i < stop; ++i) {
      const float v = g[i] + e[i];
      a[i] = v;
      rest += v * v;
    }
    float total = 0.0f;
    for (int64_t l = 0; l < kLanes; ++l) total += lanes[l];
    energies[b] = total + rest;
  }
}

// Shared by the caller and the pool's tasks; a task that starts after the call returned finds
// no chunk left, which is why the work lives on the heap.
struct Work {
  const float* g;
  const float* e;
  float* a;
  float* energies;
  int64_t size, block_size, blocks, blocks_per_chunk, chunks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Run() {
    for (int64_t chunk; (chunk = next.fetch_add(1)) < chunks;) {
      const int64_t first = chunk * blocks_per_chunk;
      SumAndSquare(g, e, a, energies, size, block_size, first,
                   std::min(first + blocks_per_chunk, blocks));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error ResidualEnergiesImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> g,
                                ffi::Buffer<ffi::F32> e, ffi::ResultBuffer<ffi::F32> a,
                                ffi::ResultBuffer<ffi::F32> energies, int64_t block_size) {
  const int64_t size = g.element_count();
  if (block_size < 1) {
    return ffi::Error::InvalidArgument("tasc_residual_energies: block_size must be >= 1");
  }
  if (e.element_count() != size || a->element_count() != size ||
      energies->element_count() != (size + block_size - 1) / block_size) {
    return ffi::Error::InvalidArgument(
        "tasc_residual_energies: g, e and a must have the same size, energies one element "
        "per block");
  }
  auto work = std::make_shared<Work>();
  work->g = g.typed_data();
  work->e = e.typed_data();
  work->a = a->typed_data();
  work->energies = energies->typed_data();
  work->size = size;
  work->block_size = block_size;
  work->blocks = energies->element_count();
  work->blocks_per_chunk = std::max<int64_t>(1, kChunkElements / block_size);
  work->chunks = (work->blocks + work->blocks_per_chunk - 1) / work->blocks_per_chunk;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), work->chunks - 1);
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([work] { work->Run(); });
  work->Run();
  while (work->done.load(std::memory_order_acquire) < work->chunks) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TascResidualEnergies, ResidualEnergiesImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // g
                                  .Arg<ffi::Buffer<ffi::F32>>()  // e
                                  .Ret<ffi::Buffer<ffi::F32>>()  // a, aliased to e
                                  .Ret<ffi::Buffer<ffi::F32>>()  // energies
                                  .Attr<int64_t>("block_size"));
