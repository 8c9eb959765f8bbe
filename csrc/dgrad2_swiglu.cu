// dgrad2_swiglu: the backward's dgrad of linear 2 (dy . w2 on the plan's gathered dy rows) fused
// with the SwiGLU backward, the routing weight and the d(topk_weights) partials.
//   bf16: bf16_grouped_gemm.cuh's DGRAD2_SWIGLU mode (da, hw bf16; optionally the gathered dy
//         rows for wgrad_dw2).
//   FP8:  fp8_grouped_gemm.cuh's DGRAD2_SWIGLU mode (da per row, da^T and h^T per 128 rows, e4m3
//         with their scales: the all-FP8 recipe), or its DGRAD2_SWIGLU_ROWS mode (da and hw bf16,
//         da per row in e4m3: the bf16 weight gradients' recipe).
// Shapes are checked by the Python wrapper (ops/hopper/cuda/dgrad2_swiglu.py). Each entry point
// returns 0, or a negative code / CUDA error number (megamoe_error_string gives the message).

#include "include/bf16_grouped_gemm.cuh"
#include "include/fp8_grouped_gemm.cuh"
#include "include/launch_params.h"

extern "C" int megamoe_dgrad2_swiglu(const Dgrad2SwigluParams* a) {
  using namespace megamoe::bf16;
  // w2 as dgrad1's N-major boxes; a loaded as [128 rows, 64] boxes; da and hw stored as
  // [64 rows, 64] boxes (both in the 128-byte swizzle)
  CUtensorMap w2_map, a_map, da_map, hw_map, rows_map;
  const long long H = a->H;
  int rc = make_map(&w2_map, a->w2, static_cast<long long>(a->E) * a->D, H, BK, 64);
  if (rc == 0) rc = make_map(&a_map, a->a, a->rows, 2 * H, BM, 64);
  if (rc == 0) rc = make_map(&da_map, a->da, a->rows, 2 * H, 64, 64);
  if (rc == 0) rc = make_map(&hw_map, a->hw, a->rows, H, 64, 64);
  if (rc == 0 && a->dy_rows != nullptr) rc = make_map(&rows_map, a->dy_rows, a->rows, a->D, 64, 64);
  if (rc != 0) return rc;
  if (a->dy_rows == nullptr) rows_map = w2_map;  // never used
  KernelParams p = {};
  p.store_gathered = a->dy_rows != nullptr;
  p.x = static_cast<const __nv_bfloat16*>(a->dy);
  p.stride_x = a->stride_dy;
  p.part = a->part;
  p.part_stride = a->rows;
  p.topk_w = a->topk_w;
  p.row_slot = a->row_slot;
  p.tile_expert = a->tile_expert;
  p.num_rows_used = a->num_rows_used;
  p.N = a->H;
  p.K = a->D;
  p.k_split = a->D;
  p.top_k = a->top_k;
  p.plan_bm = a->plan_bm;
  p.group_m = 8;
  p.ticket = a->ticket;
  return launch<DGRAD2_SWIGLU>(w2_map, rows_map, da_map, hw_map, a_map, p, a->num_sms,
                               static_cast<cudaStream_t>(a->stream));
}

// The KernelParams both FP8 modes take from the struct (the outputs each writes added after).
static megamoe::fp8::KernelParams fp8_params(const Fp8Dgrad2SwigluParams* a) {
  using namespace megamoe::fp8;
  KernelParams p = gathered_params(a->dy, a->stride_dy, a->dy_scale, a->stride_dys,
                                   a->w2t_scale, a->stride_bse, a->stride_bsn, a->row_slot,
                                   a->tile_expert, a->num_rows_used, a->H, a->D, a->top_k,
                                   a->plan_bm, a->group_m);
  p.a_saved = static_cast<const __nv_bfloat16*>(a->a_saved);
  p.tw = a->tw;
  p.das = a->das;
  p.part = a->part;
  p.rows = a->rows;
  return p;
}

// w2^T as the B operand: [128 rows, 128] boxes of the [E H, D] e4m3 copy
static int w2t_map(CUtensorMap* map, const Fp8Dgrad2SwigluParams* a) {
  using namespace megamoe::fp8;
  return megamoe::make_e4m3_map(map, a->w2t, static_cast<long long>(a->E) * a->H, a->D, BN, BK);
}

extern "C" int megamoe_fp8_dgrad2_swiglu(const Fp8Dgrad2SwigluParams* a) {
  using namespace megamoe::fp8;
  const long long H = a->H;
  CUtensorMap w_map, daq_map, dat_map, ht_map;
  int rc = w2t_map(&w_map, a);
  if (rc == 0) rc = megamoe::make_e4m3_map(&daq_map, a->daq, a->rows, 2 * H, 64, BN);
  if (rc == 0) rc = megamoe::make_e4m3_map(&dat_map, a->daTq, 2 * H, a->rows, BN, 64);
  if (rc == 0) rc = megamoe::make_e4m3_map(&ht_map, a->hTq, H, a->rows, BN, 64);
  if (rc != 0) return rc;
  KernelParams p = fp8_params(a);
  p.hts = a->hTs;
  p.dats = a->daTs;
  return launch<DGRAD2_SWIGLU>(w_map, ht_map, dat_map, daq_map, p, a->num_sms,
                               static_cast<cudaStream_t>(a->stream));
}

extern "C" int megamoe_fp8_dgrad2_swiglu_rows(const Fp8Dgrad2SwigluParams* a) {
  using namespace megamoe::fp8;
  CUtensorMap w_map;
  const int rc = w2t_map(&w_map, a);
  if (rc != 0) return rc;
  KernelParams p = fp8_params(a);
  p.da = static_cast<__nv_bfloat16*>(a->da);
  p.hw = static_cast<__nv_bfloat16*>(a->hw);
  p.daq = static_cast<uint8_t*>(a->daq);
  // the maps after w_map are never read in this mode
  return launch<DGRAD2_SWIGLU_ROWS>(w_map, w_map, w_map, w_map, p, a->num_sms,
                                    static_cast<cudaStream_t>(a->stream));
}
