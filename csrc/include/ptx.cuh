// Hopper (sm_90a) PTX wrappers the kernels are built from: mbarriers, cp.async gathers, bulk
// tensor (TMA) loads and stores, shared-memory loads and stores, wgmma descriptors, the
// m64n256k16 bf16 and m64n128k32 e4m3 wgmmas. Each is one PTX instruction (or a short fixed
// sequence); ring.cuh and scheduler.cuh build the protocols from them.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace megamoe {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// *addr += (v.x, v.y) in L2, fire and forget (no load latency on the issuing warp); one add per
// element, round to nearest even (subnormal fp32 sums flush to zero, as every f32 atomic add)
__device__ __forceinline__ void red_add_f32x2(float* addr, float2 v) {
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(addr), "f"(v.x), "f"(v.y)
               : "memory");
}

// ---- mbarrier -------------------------------------------------------------------------------

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

// Makes the initialised barriers visible to the async proxy (TMA complete_tx) and other threads.
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

// One arrival that also raises the phase's expected transaction bytes (TMA loads to come).
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}

// Spins until the phase of parity `parity` has completed (parity 1 of a fresh barrier counts as
// completed, which lets producers start on empty slots). The loop lives inside the PTX: a C++
// loop around try_wait is a branch ptxas cannot prove uniform, and a wgmma batch left in flight
// across it gets serialized (ptxas C7518, "WG.DP in divergent path").
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// mbar_arrive by the threads whose `pred` is set, as one predicated instruction (no branch, for
// the same reason as above).
__device__ __forceinline__ void mbar_arrive_if(uint32_t bar, bool pred) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %1, 0;\n"
      "@p mbarrier.arrive.shared::cta.b64 _, [%0];\n}\n" ::"r"(bar),
      "r"(static_cast<uint32_t>(pred))
      : "memory");
}

// Named barrier over `threads` threads (a warpgroup: 128) with id 1..15 (0 is __syncthreads).
__device__ __forceinline__ void named_barrier(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// ---- cp.async (gathered rows) ---------------------------------------------------------------

// 16-byte copy global -> shared; src_bytes 0 fills the 16 bytes with zeros (padding rows).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
               "r"(src_bytes)
               : "memory");
}

// 4-byte copy global -> shared (scales): through L1 (.ca: the .cg form takes 16 bytes only).
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src) : "memory");
}

// The barrier receives one arrival once all of this thread's earlier cp.async copies have
// landed; noinc: that arrival is part of the count the barrier was initialised with.
__device__ __forceinline__ void cp_async_arrive_noinc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}

// Closes this thread's cp.async copies issued so far into one group; cp_async_wait<N> waits
// until at most N of its groups are still in flight.
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Orders generic-proxy shared-memory writes (cp.async, st.shared) before async-proxy reads
// (wgmma operands, TMA stores) that follow in this thread.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// ---- TMA ------------------------------------------------------------------------------------

// 2-D tile of `map` at (c0 inner, c1 outer) into shared memory; completes `bar`'s tx bytes.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int c0, int c1,
                                            uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}

// Bulk tensor store: the 2-D box of `map` at (c0 inner, c1 outer) from shared memory at `src`
// (written in the map's swizzle), tracked by this thread's bulk groups (commit / wait below).
// The writes to `src` must be fenced for the async proxy (fence_proxy_async) first.
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, int c0, int c1, uint32_t src) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(c0), "r"(c1), "r"(src)
               : "memory");
}
// tma_store_2d + bulk_commit by the threads where `pred` holds, as predicated instructions (no
// branch: they may sit between a wgmma batch's issue and its wait, see mbar_wait)
__device__ __forceinline__ void tma_store_2d_commit_if(const CUtensorMap* map, int c0, int c1,
                                                       uint32_t src, bool pred) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %4, 0;\n"
      " @p cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n"
      " @p cp.async.bulk.commit_group;\n}" ::"l"(reinterpret_cast<uint64_t>(map)),
      "r"(c0), "r"(c1), "r"(src), "r"(static_cast<uint32_t>(pred))
      : "memory");
}
// bulk_wait_read<0> where `pred` holds (predicated, as above)
__device__ __forceinline__ void bulk_wait_read_all_if(bool pred) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %0, 0;\n @p cp.async.bulk.wait_group.read 0;\n}" ::"r"(
          static_cast<uint32_t>(pred))
      : "memory");
}
__device__ __forceinline__ void bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
// Until at most N of this thread's bulk groups still READ their shared-memory source (the
// buffer may then be rewritten; the global writes may still be in flight).
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
// Until at most N of this thread's bulk groups are incomplete (global writes done).
template <int N>
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ void st_shared_b32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}
// The low 16 / 8 bits of v (packed e4m3 pairs, single e4m3 bytes of transposed tiles).
__device__ __forceinline__ void st_shared_b16(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b16 [%0], %1;" ::"r"(addr), "h"(static_cast<uint16_t>(v)) : "memory");
}
__device__ __forceinline__ void st_shared_b8(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b8 [%0], %1;" ::"r"(addr), "h"(static_cast<uint16_t>(v & 0xFF))
               : "memory");
}
// st_shared_b32 where `pred` holds (predicated, not a branch: a wgmma batch may be in flight)
__device__ __forceinline__ void st_shared_b32_if(uint32_t addr, uint32_t v, bool pred) {
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n @p st.shared.b32 [%0], %1;\n}" ::"r"(
                   addr),
               "r"(v), "r"(static_cast<uint32_t>(pred))
               : "memory");
}
__device__ __forceinline__ float2 ld_shared_f32x2(uint32_t addr) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ uint32_t ld_shared_b32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
  return v;
}

__device__ __forceinline__ void tma_prefetch_desc(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// ---- wgmma ----------------------------------------------------------------------------------

// Descriptor of a K-major operand tile in shared memory laid out by the ROW_BYTES-byte swizzle
// (rows of ROW_BYTES / 2 bf16, 8-row groups of 8 * ROW_BYTES bytes, base aligned to such a
// group; ROW_BYTES 128 or 64). Advancing along K inside a row is +32 bytes per 16 elements on
// the start address: the hardware applies the swizzle to the computed addresses, as the TMA
// did when it stored the tile.
template <int ROW_BYTES>
__device__ __forceinline__ uint64_t smem_desc_swizzled(uint32_t addr) {
  static_assert(ROW_BYTES == 128 || ROW_BYTES == 64, "128- or 64-byte swizzle");
  uint64_t desc = (addr & 0x3FFFF) >> 4;
  desc |= static_cast<uint64_t>(1) << 16;                      // leading byte offset (unused)
  desc |= static_cast<uint64_t>(8 * ROW_BYTES >> 4) << 32;     // stride: next 8-row group
  desc |= static_cast<uint64_t>(ROW_BYTES == 128 ? 1 : 2) << 62;  // swizzle mode
  return desc;
}

// Descriptor of an MN-major (N-contiguous) operand tile stored as boxes of [k rows, 64
// elements] with the 128-byte swizzle (each k row 128 bytes, 8-row groups of 1 KiB), the boxes
// box_bytes apart along N. In this layout the leading byte offset is the step between 64-wide
// N chunks and the stride byte offset the step between 8-row k groups; advancing along K is
// +128 bytes per k row on the start address.
__device__ __forceinline__ uint64_t smem_desc_nmajor128(uint32_t addr, uint32_t box_bytes) {
  uint64_t desc = (addr & 0x3FFFF) >> 4;
  desc |= static_cast<uint64_t>(box_bytes >> 4) << 16;  // leading: next 64-wide N chunk
  desc |= static_cast<uint64_t>(1024 >> 4) << 32;       // stride: next 8-row k group
  desc |= static_cast<uint64_t>(1) << 62;               // 128-byte swizzle
  return desc;
}

// Byte offset of 16-byte chunk c of row r in a tile stored with the ROW_BYTES-byte swizzle:
// address bits [4, 7) (the chunk) are XORed with bits [7, 10) of the unswizzled offset.
template <int ROW_BYTES>
__device__ __forceinline__ uint32_t swizzled_offset(int r, int c) {
  return r * ROW_BYTES + ((c ^ ((r * ROW_BYTES >> 7) & (ROW_BYTES / 16 - 1))) << 4);
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// Ties a register to this point of the instruction stream, so the compiler neither reads an
// accumulator before the wgmma.wait that completes it nor moves writes past a wgmma.
__device__ __forceinline__ void fence_reg(float& r) { asm volatile("" : "+f"(r)::"memory"); }

template <uint32_t N>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}
template <uint32_t N>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
}

// wgmma m64n256k16, bf16 x bf16 -> fp32, A and B from shared memory, each K-major or (TRANS_A,
// TRANS_B) MN-major. d[] is the warpgroup's 64x256 accumulator fragment (128 fp32 per thread);
// scale_d = 0 overwrites.
template <bool TRANS_A = false, bool TRANS_B = false>
__device__ __forceinline__ void wgmma_m64n256k16(float* d, uint64_t desc_a, uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
      "}, %128, %129, p, 1, 1, %131, %132;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TRANS_A ? 1 : 0), "n"(TRANS_B ? 1 : 0));
}

// wgmma m64n128k32, e4m3 x e4m3 -> fp32, A and B K-major from shared memory (FP8 wgmma has no
// transposed-operand form). d[] is the warpgroup's 64x128 accumulator fragment (64 fp32 per
// thread, laid out as m64n256k16's first half); scale_d = 0 overwrites. Hopper accumulates FP8
// products with reduced precision, so callers keep d to one 128-wide K block and promote it
// into an fp32 accumulator of their own (fp8_mma.cuh).
__device__ __forceinline__ void wgmma_m64n128k32_e4m3(float* d, uint64_t desc_a, uint64_t desc_b,
                                                      int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, %64, %65, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

}  // namespace megamoe
