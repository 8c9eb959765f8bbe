"""The router's top-k launch (ops/hopper/kernels/topk.py, _topk_gate_kernel with the softmax, as the
Qwen3 routers run it) at 16384 tokens x 128 experts, top 8, per tile choice: BLOCK_T tokens per
program x num_warps. GPU time per launch: 20 launches captured in a CUDA graph, the graph's
replays timed by CUDA events (median of 20), so the host's launch cost is left out. Each
choice's indices, gating values and fp32 scores are compared with the current default's (a tile
change may reorder the softmax's sums):

    source scripts/_device_env.sh; install_wheels
    python3 experiments/topk_variants.py
"""

import torch

from torchtitan_megamoe.ops.hopper.kernels.topk import _launch_gate
from torchtitan_megamoe.timing import median_ms

CALLS = 20


def graphed_us(fn) -> float:
    """Microseconds of GPU time per call of fn (CALLS calls replayed from one CUDA graph)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    return median_ms(graph.replay, 20, 3) * 1e3 / CALLS


def main() -> None:
    torch.manual_seed(0)
    T, E, K = 16384, 128, 8
    logits = torch.randn(T, E, device="cuda").bfloat16()
    ref = _launch_gate(logits, K, None, True, 1.0, softmax=True)
    for block_t in (4, 8, 16, 32, 64):
        for num_warps in (1, 2, 4, 8):
            def run(b=block_t, w=num_warps):
                return _launch_gate(logits, K, None, True, 1.0, softmax=True, block_t=b,
                                    num_warps=w)
            us = graphed_us(run)
            vals, idx, counts, probs = run()
            same_idx = bool(torch.equal(idx, ref[1])) and bool(torch.equal(counts, ref[2]))
            dv = (vals - ref[0]).abs().max().item()
            dp = (probs - ref[3]).abs().max().item()
            print(f"block_t {block_t:3d} warps {num_warps}: {us:7.1f} us  indices "
                  f"{'equal' if same_idx else 'DIFFER'}, max |dvals| {dv:.1e}, "
                  f"max |dprobs| {dp:.1e}", flush=True)


if __name__ == "__main__":
    main()
