// The producer/consumer ring every kernel runs on: STAGES shared-memory stages, each with a
// `full` mbarrier (the producer's loads landed) and an `empty` one (both consumer warpgroups are
// done with it, one arrival each). Each role walks it with its own (stage, phase) locals: stage
// s of round r waits full(s) at parity r & 1 (consumers) or empty(s) at parity (r & 1) ^ 1
// (producers: a fresh barrier's parity 1 counts as completed, so the first round starts free).
// The kernels step (stage, phase) in their own loops: through a helper, nvcc schedules the
// loops differently.
#pragma once

#include <stdint.h>

#include "ptx.cuh"
#include "scheduler.cuh"

namespace megamoe {

// The dynamic shared memory from a 1024-byte boundary: the swizzled tiles need their 8-row
// groups aligned (1024 bytes covers the 128- and 64-byte swizzles).
__device__ __forceinline__ uint8_t* align_smem(uint8_t* raw) {
  return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) &
                                    ~static_cast<uintptr_t>(1023));
}

template <int STAGES>
struct Ring {
  uint32_t full_bar;   // STAGES barriers, 8 bytes apart
  uint32_t empty_bar;  // STAGES barriers, 8 bytes apart

  __device__ __forceinline__ Ring(uint32_t full, uint32_t empty)
      : full_bar(full), empty_bar(empty) {}

  // By thread 0, before mbar_init_fence. full_arrivals: 1 when the producer's thread 0 alone
  // loads a stage (TMA), 129 when its 128 threads also gather rows by cp.async.
  __device__ __forceinline__ void init(uint32_t full_arrivals) const {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full_bar + 8 * s, full_arrivals);
      mbar_init(empty_bar + 8 * s, 2);  // one per consumer warpgroup
    }
  }

  __device__ __forceinline__ uint32_t full(int s) const { return full_bar + 8 * s; }
  __device__ __forceinline__ uint32_t empty(int s) const { return empty_bar + 8 * s; }

  // Consumer warpgroup cw frees stage s: the whole warpgroup is past it before its one arrival.
  // The arrival is a predicated instruction, not a branch (see mbar_wait), so a wgmma batch can
  // stay in flight across a release.
  __device__ __forceinline__ void release(int s, int cw, bool pred = true) const {
    named_barrier(1 + cw, 128);
    mbar_arrive_if(empty(s), pred && threadIdx.x % 128 == 0);
  }
};

// A kernel's dynamic shared memory, from a 1024-aligned base: [STAGES ring stages | the
// epilogue's EPI_BYTES | the ring's full barriers | its empty barriers | the unit ring's 4
// barriers | its 2 ids]. The kernel's SMEM_BYTES adds the 1024 bytes of alignment slack (and
// leaves out the unit ring when it has none).
template <int STAGES, int STAGE_BYTES, int EPI_BYTES>
struct SmemLayout {
  static constexpr int RING_BYTES = STAGES * STAGE_BYTES;
  uint8_t* smem;
  uint32_t base;  // the ring's stage s at base + s * STAGE_BYTES

  __device__ __forceinline__ explicit SmemLayout(uint8_t* raw)
      : smem(align_smem(raw)), base(smem_u32(smem)) {}

  __device__ __forceinline__ uint32_t epilogue() const { return base + RING_BYTES; }
  __device__ __forceinline__ uint32_t full_bar() const { return epilogue() + EPI_BYTES; }
  __device__ __forceinline__ uint32_t empty_bar() const { return full_bar() + STAGES * 8; }
  __device__ __forceinline__ Ring<STAGES> ring() const {
    return Ring<STAGES>(full_bar(), empty_bar());
  }
  __device__ __forceinline__ UnitRing units() const {
    const uint32_t unit_full = empty_bar() + STAGES * 8;
    return UnitRing{unit_full, unit_full + 2 * 8,
                    reinterpret_cast<volatile int*>(smem + RING_BYTES + EPI_BYTES +
                                                    2 * STAGES * 8 + 4 * 8)};
  }
};

}  // namespace megamoe
