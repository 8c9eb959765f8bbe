"""The softmax router's backward at the Qwen3 shape (16384 tokens x 128 experts, top 8, route
norm): the one-launch _gate_backward (ops/hopper/kernels/topk.py) against the torch ops autograd ran
before it (gather / normalize / scale backward, zero fill + scatter, aten's softmax backward,
the cast). Per variant: GPU time per call (kernel times summed by torch.profiler over 20 calls)
and host time per call (20 calls issued back to back, then one sync), and the largest
difference of the two results:

    source scripts/_device_env.sh; install_wheels
    python3 experiments/router_bwd_variants.py
"""

import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from torchtitan_megamoe.ops.hopper.kernels.topk import _gate_backward, _launch_gate

CALLS = 20


def torch_ops_backward(probs, idx, dvals, norm, scale, dtype):
    """The removed path: what autograd ran through stock's ops, written out."""
    dout = dvals * scale
    if norm:
        g = probs.gather(1, idx)
        denom = g.sum(dim=-1, keepdim=True) + 1e-20
        dout = (dout - (dout * (g / denom)).sum(dim=-1, keepdim=True)) / denom
    dscores = torch.zeros_like(probs).scatter_(1, idx, dout)
    return torch._softmax_backward_data(dscores, probs, 1, torch.float32).to(dtype)


def gpu_and_host_us(fn):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(CALLS):
        fn()
    host = (time.perf_counter() - t0) * 1e6 / CALLS
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
    gpu = sum(e.self_device_time_total for e in prof.key_averages()
              if e.device_type == DeviceType.CUDA) / CALLS
    return gpu, host


def main() -> None:
    torch.manual_seed(0)
    T, E, K = 16384, 128, 8
    logits = torch.randn(T, E, device="cuda").bfloat16()
    _, idx, _, probs = _launch_gate(logits, K, None, True, 1.0, softmax=True)
    dvals = torch.randn(T, K, device="cuda")
    runs = {
        "torch ops (before)": lambda: torch_ops_backward(probs, idx, dvals, True, 1.0,
                                                         torch.bfloat16),
        "one launch (now)": lambda: _gate_backward(probs, idx, dvals, True, 1.0,
                                                   softmax_dtype=torch.bfloat16),
    }
    ref = None
    for name, fn in runs.items():
        gpu, host = gpu_and_host_us(fn)
        out = fn().float()
        note = "" if ref is None else f", max |diff| vs before {(out - ref).abs().max().item():.1e}"
        ref = out if ref is None else ref
        print(f"router backward, {name}: GPU {gpu:.1f} us, host {host:.1f} us per call{note}",
              flush=True)


if __name__ == "__main__":
    main()
