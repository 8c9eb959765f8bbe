// gemm_rows: the grouped GEMM over the plan's row space with both operands by TMA, serving gemm2
// (h . w2) and dgrad1 ([da1 | da3] . [w1; w3]).
//   bf16: bf16_grouped_gemm.cuh's GEMM_ROWS (K-major weights) and GEMM_ROWS_NMAJOR (N-major
//         weights, read as stored) modes.
//   FP8:  fp8_grouped_gemm.cuh's GEMM_ROWS mode (1x128 activation, 128x128 weight scales).
// Shapes are checked by the Python wrapper (ops/hopper/cuda/gemm_rows.py). Each entry point
// returns 0, or a negative code / CUDA error number (megamoe_error_string gives the message).

#include "include/bf16_grouped_gemm.cuh"
#include "include/fp8_grouped_gemm.cuh"
#include "include/launch_params.h"

extern "C" int megamoe_gemm_rows(const GemmRowsParams* a) {
  using namespace megamoe::bf16;
  CUtensorMap w_map, w2_map, in_map, out_map;
  int rc;
  if (a->n_major) {
    rc = make_map(&w_map, a->w, static_cast<long long>(a->E) * a->k_split, a->N, BK, 64);
    if (rc == 0) {
      rc = make_map(&w2_map, a->K > a->k_split ? a->w2 : a->w,
                    static_cast<long long>(a->E) * a->k_split, a->N, BK, 64);
    }
  } else {
    rc = make_map(&w_map, a->w, static_cast<long long>(a->E) * a->N, a->K, BN);
    w2_map = w_map;
  }
  if (rc != 0) return rc;
  rc = make_map(&in_map, a->inp, a->rows, a->K, BM);
  if (rc != 0) return rc;
  rc = make_map(&out_map, a->out, a->rows, a->N, 64, 64);
  if (rc != 0) return rc;
  KernelParams p = {};
  p.h = static_cast<__nv_bfloat16*>(a->out);
  p.row_slot = a->row_slot;  // nullptr: no padding skip
  p.tile_expert = a->tile_expert;
  p.num_rows_used = a->num_rows_used;
  p.N = a->N;
  p.K = a->K;
  p.k_split = a->n_major ? a->k_split : a->K;
  p.top_k = 1;
  p.plan_bm = a->plan_bm;
  p.group_m = a->group_m;
  p.ticket = a->ticket;
  p.stride_h = a->N;
  cudaStream_t s = static_cast<cudaStream_t>(a->stream);
  if (a->n_major) {
    return launch<GEMM_ROWS_NMAJOR>(w_map, w2_map, out_map, out_map, in_map, p, a->num_sms, s);
  }
  return launch<GEMM_ROWS>(w_map, w2_map, out_map, out_map, in_map, p, a->num_sms, s);
}

extern "C" int megamoe_fp8_gemm_rows(const Fp8GemmRowsParams* a) {
  using namespace megamoe::fp8;
  CUtensorMap b_map, in_map, out_map;
  int rc = megamoe::make_e4m3_map(&b_map, a->b, static_cast<long long>(a->E) * a->N, a->K, BN,
                                  BK);
  if (rc == 0) rc = megamoe::make_e4m3_map(&in_map, a->a, a->rows, a->K, BM, BK);
  if (rc == 0) rc = megamoe::make_bf16_map(&out_map, a->out, a->rows, a->N, 64, 64);
  if (rc != 0) return rc;
  KernelParams p = {};
  p.a_scale = a->a_scale;
  p.b_scale = a->b_scale;
  p.tile_expert = a->tile_expert;
  p.num_rows_used = a->num_rows_used;
  p.seg_start = a->seg_start;
  p.expert_base = a->expert_base;
  p.num_experts = a->E;
  p.N = a->N;
  p.K = a->K;
  p.plan_bm = a->plan_bm;
  p.group_m = a->group_m;
  p.stride_as = a->stride_as;
  p.stride_bse = a->stride_bse;
  p.stride_bsn = a->stride_bsn;
  return launch<GEMM_ROWS>(b_map, b_map, in_map, out_map, p, a->num_sms,
                           static_cast<cudaStream_t>(a->stream));
}
