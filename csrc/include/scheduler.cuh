// The tile scheduler: which unit (output tile) a persistent CTA computes next. Static order:
// every gridDim-th unit from blockIdx. Dynamic order: the producer's thread 0 takes the next
// number from a global ticket and hands it to both roles through a 2-slot unit ring, so the CTAs
// walk one global order however they drift apart (the weights in flight stay in L2).
#pragma once

#include "ptx.cuh"

namespace megamoe {

// Unit t of a [num_m, num_n] tile grid in grouped order: GROUP_M consecutive M tiles sweep one N
// tile together (weight tiles reused from L2).
__device__ __forceinline__ void grouped_tile(int t, int num_m, int num_n, int group_m, int& pid_m,
                                             int& pid_n) {
  const int per_group = group_m * num_n;
  const int first_m = (t / per_group) * group_m;
  const int size = min(num_m - first_m, group_m);
  pid_m = first_m + (t % per_group) % size;
  pid_n = (t % per_group) / size;
}

// The dynamic order's next unit number from a global ticket (one thread per CTA). Every CTA
// takes exactly one number >= num_units (then stops), so the taker of num_units + gridDim.x - 1
// is the last one to touch the ticket: it zeroes it for the next launch on this stream (the
// Python side keeps one ticket per stream).
__device__ __forceinline__ int take_unit(int* ticket, int num_units) {
  const int got = atomicAdd(ticket, 1);
  if (got == num_units + static_cast<int>(gridDim.x) - 1) atomicExch(ticket, 0);
  return got;
}

// The dynamic order's 2-slot ring in shared memory: unit_full[s] (1 arrival: the producer's
// thread 0 published id[s]) and unit_empty[s] (2 arrivals: both consumer warpgroups read it).
struct UnitRing {
  uint32_t full_bar;   // 2 barriers, 8 bytes apart
  uint32_t empty_bar;  // 2 barriers, 8 bytes apart
  volatile int* id;    // 2 ints

  // By thread 0, before mbar_init_fence.
  __device__ __forceinline__ void init() const {
    for (int s = 0; s < 2; ++s) {
      mbar_init(full_bar + 8 * s, 1);
      mbar_init(empty_bar + 8 * s, 2);
    }
  }

  // The producer's thread 0: the it-th unit of this CTA (slot = it & 1), taken from the ticket
  // once both consumer warpgroups have read the slot's previous id.
  __device__ __forceinline__ void publish(int it, int slot, int* ticket, int num_units) const {
    mbar_wait(empty_bar + 8 * slot, ((it >> 1) & 1) ^ 1);
    id[slot] = take_unit(ticket, num_units);
    mbar_arrive(full_bar + 8 * slot);  // release: the consumers' wait acquires the id
  }

  // The other producer threads, after a named barrier with thread 0.
  __device__ __forceinline__ int read(int slot) const { return id[slot]; }

  // A consumer warpgroup (barrier id 1 + cw): the it-th unit; the slot is freed once the whole
  // warpgroup has read it (the arrival is predicated, not a branch: see mbar_wait).
  __device__ __forceinline__ int receive(int it, int cw) const {
    const int slot = it & 1;
    mbar_wait(full_bar + 8 * slot, (it >> 1) & 1);
    const int u = id[slot];
    named_barrier(1 + cw, 128);
    mbar_arrive_if(empty_bar + 8 * slot, threadIdx.x % 128 == 0);
    return u;
  }
};

}  // namespace megamoe
