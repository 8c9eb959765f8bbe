"""MoE layer benchmark: stock TorchTitan MoE vs mega_moe on the same weights and routing.

    python -m torchtitan_megamoe.bench [--shapes 30b,235b] [--tokens 16384] [--json out.json]
        [--precisions bf16,fp8,fp8_bwd] [--accuracy] [--baselines eager,compiled,block,torchao]
    torchrun --nproc_per_node 2 -m torchtitan_megamoe.bench --ep 2 [--json out.json]
    python -m torchtitan_megamoe.bench --ep 8 --loopback [--shapes 30b] [--tokens 4096]
        (EP=8 as 8 loopback ranks in one process on one GPU: bench/ep_loopback.py)

For each Qwen3 shape it builds stock ``torchtitan.models.moe.MoE`` with Qwen3's MoEArgs (softmax,
route_norm, no shared experts, score_before_experts=False) in bf16, then times:

- stock: the module's forward (router + permute + grouped GEMMs + unpermute + combine), eager;
- stock compiled (unless --no-compile-stock, or "compiled" left out of --baselines): the same
  module compiled as TorchTitan's ``--compile.enable`` compiles a MoE block (bench/stock.py:
  router and reorderer under ``torch.compile(fullgraph=True)``, the grouped-GEMM function
  compiled; dynamic=False here),
  timed after a warm-up that compiles it (its wall time is reported); at EP > 1 with the EP
  wiring of that compile (received rows marked dynamic);
- stock block-compiled (EP=1; unless --baselines leaves out "block"): the whole stock block
  (router, reorder, gather, index padding, grouped GEMMs + SwiGLU, unpermute, combine) under
  one ``torch.compile(fullgraph=True, dynamic=False)`` (bench/stock.py BlockCompiledStock), a
  stronger baseline than TorchTitan's own compile; where fullgraph does not trace (on CPU:
  TorchTitan's CPU index padding branches on ``.item()`` of the counts) it is compiled with
  graph breaks allowed, and the output says which, with the fullgraph error and the graph
  breaks of its forward. Its first call per pass (the compilation) is timed on its own;
- stock + torchao FP8 compiled (when --precisions lists an FP8 precision, unless --no-torchao):
  torchao 0.18's rowwise FP8 grouped GEMMs on stock's experts (quantize_ with
  Float8TrainingOpConfig, as TorchTitan's quantize.grouped_mm.float8 converter does), compiled
  the same way; "not available" without torchao;
- ours: the same module's router with its top-k in one launch (router.route), then ``mega_moe``
  on its routing and expert weights (the layer the converter builds); at EP=1 also the op
  alone, stock's and our router alone and the op's forward stages (plan, gemm1_swiglu, gemm2,
  combine);
- with --backward (default on): forward + backward of both, when the backend has a backward;
  at EP=1 with the hopper backend also the backward's stages (dgrad2_swiglu: dgrad of layer 2
  + SwiGLU, wgrad_dw2 and wgrad_dw13, dgrad1: dgrad of layer 1, bwd_combine; each with every
  side: Triton, grouped_mm and, where they run, sm90; and the totals per forced side and with
  the tuner's per-stage pick), timed by
  ``bench/backward_stages.py`` on its own random routing of the same shape;
- ours at each of --precisions (bf16 always), EP=1: ``mega_moe(..., precision=p)``; a
  precision the backend lacks (NotImplementedError) prints its row as "not available: ...". Each
  precision's first fwd+bwd call at a shape (kernel JIT and tuner) is timed on its own. The
  table gives ours' speedup over each stock layer, its TFLOP/s and the fraction of its compute
  floor reached (fp8: all GEMMs at --peak-fp8-tflops; fp8_bwd: forward bf16, backward FP8), and
  the peak memory of one fwd+bwd of every layer;
- with --accuracy: per shape, the relative error of ours' output and every gradient (dx, dw1,
  dw2, dw3, d topk_weights) at each precision, of stock bf16 and of stock + torchao FP8, against
  a float64 reference on the same inputs (bench/accuracy.py).

EP > 1 (under torchrun, one process per GPU, each with --tokens tokens): stock is TorchTitan's
own EP layer, its experts sharded by ``ExpertParallel`` on a 1-D DeviceMesh named "ep" exactly
as ``apply_moe_ep_tp`` does in training (all_to_all dispatch, per-expert padding to
TOKEN_GROUP_ALIGN_SIZE_M, grouped GEMMs, all_to_all combine); ours is ``mega_moe`` with the
mesh's group on the same rank's expert shard and routing; ours at EP=1 (every expert on each
GPU, same tokens) is timed in the same run for the EP=N / EP=1 ratio. Rank 0's times are
reported; output errors are the max over ranks.

Timing: CUDA events around each call after warm-up (which also runs the kernels' tuner), the
median of --iters calls; and, for both sides' forward and forward + backward, --iters calls
issued back to back with one pair of events around them (the host may run ahead, as across
layers in training: GPU-bound, so a slow host moves it less). Flops: 6*T*K*D*H forward (three
GEMMs), 3x that forward + backward; the floor is those flops at --peak-tflops (765: dense bf16
GEMM measured on the H200; docs/PERF.md, Compute floors) and, for FP8 GEMMs, at
--peak-fp8-tflops (1339, dense FP8 measured on the same GPU).
On a machine without CUDA only --backend reference runs (a smoke test of the code path, with
wall-clock times, under gloo for --ep > 1).
"""

from torchtitan_megamoe.bench.cli import main
from torchtitan_megamoe.bench.ep1 import bwd_stage_breakdown
from torchtitan_megamoe.bench.shapes import SHAPES, build_stock_moe, shard_stock_experts
from torchtitan_megamoe.bench.tables import BWD_STAGES, bwd_table

__all__ = ["BWD_STAGES", "SHAPES", "build_stock_moe", "bwd_stage_breakdown", "bwd_table", "main",
           "shard_stock_experts"]
