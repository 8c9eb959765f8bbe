/* The parameters of every extern "C" entry point, one struct per launch, passed by pointer.
 * Plain C layout: torchtitan_megamoe/ops/hopper/cuda/params.py mirrors each struct as a
 * ctypes.Structure, and tests/hopper/test_launch_params.py checks that the two agree field by
 * field, so keep one field per line, written "type name;".
 * Shapes are checked by the Python wrappers; rows: the extent of the row-space tensors (the
 * plan's max_rows); ticket: a zeroed device int for the dynamic tile order (each launch leaves
 * it zeroed), or NULL for the static order; stream: a cudaStream_t. */
#pragma once

#ifdef __cplusplus
extern "C" {
#endif

/* gemm1_swiglu, bf16: h[r] = silu(x_tok(r) @ w1[e]^T) * (x_tok(r) @ w3[e]^T), and unless a is
 * NULL the pre-activations a = [a1 | a3]. */
typedef struct Gemm1SwigluParams {
  const void* x;
  const void* w1;
  const void* w3;
  void* h;
  void* a;
  const int* row_slot;
  const int* tile_expert;
  const int* num_rows_used;
  int E;
  int H;
  int D;
  int top_k;
  int plan_bm;
  int group_m;
  long long stride_x;
  long long stride_h;
  long long stride_a;
  long long rows;
  int num_sms;
  int* ticket;
  void* stream;
} Gemm1SwigluParams;

/* gemm1_swiglu, FP8: hq e4m3 + hs (per row and 128 columns) and unless a is NULL a bf16, from
 * the token rows of x e4m3 [T, D] (scales [T, D/128]) against w1, w3 [E, H, D] e4m3 with
 * 128x128 block scales (one layout, strides stride_bse, stride_bsn). */
typedef struct Fp8Gemm1SwigluParams {
  const void* x;
  long long stride_x;
  const float* x_scale;
  long long stride_xs;
  const void* w1;
  const float* w1_scale;
  const void* w3;
  const float* w3_scale;
  long long stride_bse;
  long long stride_bsn;
  void* hq;
  float* hs;
  void* a;
  const int* row_slot;
  const int* tile_expert;
  const int* num_rows_used;
  int E;
  int H;
  int D;
  int top_k;
  int plan_bm;
  int group_m;
  long long x_rows;  /* 0: x is [T, D] token rows, gathered in the kernel; else x [x_rows, D] is
                        the plan's row space (gathered before), x_scale likewise by row */
  int num_sms;
  void* stream;
} Fp8Gemm1SwigluParams;

/* gemm_rows, bf16: out[r] = inp[r] @ w[e]^T with w [E, N, K] (n_major 0), or inp[r, :k_split]
 * @ w[e] + inp[r, k_split:] @ w2[e] with w, w2 [E, k_split, N] (n_major 1; w2 only read when
 * K > k_split). row_slot: the plan's (padding halves of tiles are skipped) or NULL. */
typedef struct GemmRowsParams {
  const void* inp;
  const void* w;
  const void* w2;
  void* out;
  const int* row_slot;
  const int* tile_expert;
  const int* num_rows_used;
  int E;
  int N;
  int K;
  int k_split;
  int n_major;
  int plan_bm;
  int group_m;
  long long rows;
  int num_sms;
  int* ticket;
  void* stream;
} GemmRowsParams;

/* gemm_rows, FP8: out bf16 [rows, N] = a e4m3 [rows, K] (1x128 scales) @ b[e]^T, b e4m3
 * [E, N, K] (128x128 block scales). With seg_start (the plan's, on the device) only the rows of
 * experts [expert_base, expert_base + E), b holding just those experts. */
typedef struct Fp8GemmRowsParams {
  const void* a;
  const float* a_scale;
  long long stride_as;
  const void* b;
  const float* b_scale;
  long long stride_bse;
  long long stride_bsn;
  void* out;
  const int* tile_expert;
  const int* num_rows_used;
  const int* seg_start;
  int expert_base;
  int E;
  int N;
  int K;
  int plan_bm;
  int group_m;
  long long rows;
  int num_sms;
  void* stream;
} Fp8GemmRowsParams;

/* dgrad2_swiglu, bf16: dh = dy_tok(r) @ w2[e] (dy [T, D] gathered, w2 [E, D, H]), with the
 * saved a = [a1 | a3] and the routing weights topk_w (fp32, by slot): da [rows, 2H], hw [rows,
 * H], part [H/256, rows]; unless dy_rows is NULL the gathered dy rows [rows, D] too. */
typedef struct Dgrad2SwigluParams {
  const void* dy;
  long long stride_dy;
  const void* w2;
  const void* a;
  void* da;
  void* hw;
  void* dy_rows;
  float* part;
  const float* topk_w;
  const int* row_slot;
  const int* tile_expert;
  const int* num_rows_used;
  int E;
  int D;
  int H;
  int top_k;
  int plan_bm;
  long long rows;
  int num_sms;
  int* ticket;
  void* stream;
} Dgrad2SwigluParams;

/* dgrad2_swiglu, FP8: from dy e4m3 [T, D] (scales [T, D/128]), w2t = w2^T e4m3 [E, H, D], the
 * saved a [rows, 2H] bf16 and the routing weights tw: daq [rows, 2H] + das and part [H/128,
 * rows], then either (megamoe_fp8_dgrad2_swiglu) daTq [2H, rows] + daTs [2H, rows/128], hTq
 * [H, rows] + hTs, or (megamoe_fp8_dgrad2_swiglu_rows) da [rows, 2H] (may be a_saved) and hw
 * [rows, H] bf16; the other form's pointers are unused. */
typedef struct Fp8Dgrad2SwigluParams {
  const void* dy;
  long long stride_dy;
  const float* dy_scale;
  long long stride_dys;
  const void* w2t;
  const float* w2t_scale;
  long long stride_bse;
  long long stride_bsn;
  const void* a_saved;
  const float* tw;
  void* daq;
  float* das;
  void* daTq;
  float* daTs;
  void* hTq;
  float* hTs;
  void* da;
  void* hw;
  float* part;
  const int* row_slot;
  const int* tile_expert;
  const int* num_rows_used;
  int E;
  int H;
  int D;
  int top_k;
  int plan_bm;
  int group_m;
  long long rows;
  int num_sms;
  void* stream;
} Fp8Dgrad2SwigluParams;

/* wgrad, bf16: per expert e, over the rows r of its segment,
 *   gather 1 (dw2):    out[e] [M, N] = tokens[tok(r)]^T @ rows[r]
 *   gather 0 (dw1|3):  out[e] [M, N] = rows[r]^T @ tokens[tok(r)]
 *   gather 2 (either): out[e] [M, N] = tokens[r]^T @ rows[r]   (both row space)
 * M rows [0, m_split) go to out0 [E, m_split, N], the others (if M > m_split) to out1.
 * expert_order: the experts' unit order (NULL: 0..E-1); count: each expert's real rows. */
typedef struct WgradParams {
  const void* tokens;
  long long stride_tokens;
  const void* rows;
  long long num_rows;
  void* out0;
  void* out1;
  const int* row_slot;
  const int* seg_start;
  const int* count;
  const int* expert_order;
  int E;
  int M;
  int N;
  int m_split;
  int top_k;
  int gather;
  int regions;  /* > 1 (gather 0 or 2): seg_start [regions, E + 1] and count [regions, E], one
                   K walk over several plans' rows (of rows, row_slot and, gather 2, tokens) */
  int out_f32;  /* 1: out0 / out1 are fp32 (the gradients of fp32 parameters), 2: fp32 and
                   added to (out += gradient), 0: bf16 */
  int num_sms;
  int* ticket;
  void* stream;
} WgradParams;

/* wgrad, FP8: out [E, M, N] bf16 = per expert e, at[:, segment(e)] @ bt[:, segment(e)]^T with
 * at e4m3 [M, rows], bt e4m3 [N, rows], scaled per column and 128 rows. */
typedef struct Fp8WgradParams {
  const void* at;
  const float* at_scale;
  long long stride_as;
  const void* bt;
  const float* bt_scale;
  long long stride_bs;
  void* out;
  const int* seg_start;
  const int* count;
  const int* expert_order;
  int E;
  int M;
  int N;
  long long rows;
  int group_m;
  int num_sms;
  int* ticket;
  void* stream;
} Fp8WgradParams;

#ifdef __cplusplus
}
#endif
