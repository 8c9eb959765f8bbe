// gemm1_swiglu: GEMM 1 ([w1 | w3] . x) on the plan's gathered token rows with the SwiGLU in the
// epilogue, h = silu(a1) a3 (and optionally a = [a1 | a3] saved for the backward).
//   bf16: bf16_grouped_gemm.cuh's GEMM1_SWIGLU mode (h bf16).
//   FP8:  fp8_grouped_gemm.cuh's GEMM1_SWIGLU mode (h e4m3 with per-row scales per 128 columns),
//         on the token rows of x (gathered inside) or on rows gathered before (x_rows > 0).
// Shapes are checked by the Python wrapper (ops/hopper/cuda/gemm1_swiglu.py). Each entry point
// returns 0, or a negative code / CUDA error number (megamoe_error_string gives the message).

#include "include/bf16_grouped_gemm.cuh"
#include "include/fp8_grouped_gemm.cuh"
#include "include/launch_params.h"

extern "C" int megamoe_gemm1_swiglu(const Gemm1SwigluParams* a) {
  using namespace megamoe::bf16;
  CUtensorMap w1_map, w3_map;
  int rc = make_map(&w1_map, a->w1, static_cast<long long>(a->E) * a->H, a->D, BN);
  if (rc != 0) return rc;
  rc = make_map(&w3_map, a->w3, static_cast<long long>(a->E) * a->H, a->D, BN);
  if (rc != 0) return rc;
  // epilogue maps: h [rows, H] and a [rows, 2H], boxes of 64 x 64; without a, the a map is a
  // copy of h's (never used)
  CUtensorMap h_map, a_map;
  rc = make_map(&h_map, a->h, a->rows, a->stride_h, 64, 64);
  if (rc != 0) return rc;
  if (a->a != nullptr) {
    rc = make_map(&a_map, a->a, a->rows, a->stride_a, 64, 64);
    if (rc != 0) return rc;
  } else {
    a_map = h_map;
  }
  KernelParams p;
  p.x = static_cast<const __nv_bfloat16*>(a->x);
  p.h = static_cast<__nv_bfloat16*>(a->h);
  p.a = static_cast<__nv_bfloat16*>(a->a);
  p.row_slot = a->row_slot;
  p.tile_expert = a->tile_expert;
  p.num_rows_used = a->num_rows_used;
  p.N = a->H;
  p.K = a->D;
  p.top_k = a->top_k;
  p.plan_bm = a->plan_bm;
  p.group_m = a->group_m;
  p.ticket = a->ticket;
  p.stride_x = a->stride_x;
  p.stride_h = a->stride_h;
  p.stride_a = a->stride_a;
  return launch<GEMM1_SWIGLU>(w1_map, w3_map, h_map, a_map, w1_map, p, a->num_sms,
                              static_cast<cudaStream_t>(a->stream));
}

extern "C" int megamoe_fp8_gemm1_swiglu(const Fp8Gemm1SwigluParams* a) {
  using namespace megamoe::fp8;
  CUtensorMap w1_map, w3_map;
  int rc = megamoe::make_e4m3_map(&w1_map, a->w1, static_cast<long long>(a->E) * a->H, a->D,
                                  BN, BK);
  if (rc == 0) {
    rc = megamoe::make_e4m3_map(&w3_map, a->w3, static_cast<long long>(a->E) * a->H, a->D, BN,
                                BK);
  }
  if (rc != 0) return rc;
  KernelParams p = gathered_params(a->x, a->stride_x, a->x_scale, a->stride_xs, a->w1_scale,
                                   a->stride_bse, a->stride_bsn, a->row_slot, a->tile_expert,
                                   a->num_rows_used, a->H, a->D, a->top_k, a->plan_bm,
                                   a->group_m);
  p.b3_scale = a->w3_scale;
  p.hq = static_cast<uint8_t*>(a->hq);
  p.hs = a->hs;
  p.a = static_cast<__nv_bfloat16*>(a->a);
  const cudaStream_t stream = static_cast<cudaStream_t>(a->stream);
  if (a->x_rows == 0) {
    return launch<GEMM1_SWIGLU>(w1_map, w3_map, w1_map, w1_map, p, a->num_sms, stream);
  }
  // x holds the plan's rows (gathered before): read by TMA, its scales by row
  CUtensorMap x_map;
  rc = megamoe::make_e4m3_map(&x_map, a->x, a->x_rows, a->D, BM, BK);
  if (rc != 0) return rc;
  return launch<GEMM1_SWIGLU, true>(w1_map, w3_map, x_map, w1_map, p, a->num_sms, stream);
}
