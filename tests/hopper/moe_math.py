"""Float64 oracle and routings shared by the Triton kernel tests."""

import torch
import torch.nn.functional as F


def make_weights(E, D, H, dtype=torch.bfloat16, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    w1 = (torch.randn(E, H, D, generator=g) / D**0.5).to(dtype).to(device)
    w3 = (torch.randn(E, H, D, generator=g) / D**0.5).to(dtype).to(device)
    w2 = (torch.randn(E, D, H, generator=g) / H**0.5).to(dtype).to(device)
    return w1, w2, w3


def random_moe(N, K, E, D, H, seed):
    """Random bf16 tokens x [N, D] and experts, fp32 routing weights [N, K] and K distinct
    expert ids per token, plus the generator (callers draw their routing edits from it).
    Returns (g, x, w1, w2, w3, weights, ids)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g).bfloat16()
    w1 = (torch.randn(E, H, D, generator=g) / D**0.5).bfloat16()
    w3 = (torch.randn(E, H, D, generator=g) / D**0.5).bfloat16()
    w2 = (torch.randn(E, D, H, generator=g) / H**0.5).bfloat16()
    w = torch.rand(N, K, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])
    return g, x, w1, w2, w3, w, ids


def routings(T, K, E, seed=0):
    """(name, topk_ids) covering the uneven cases the kernels must get right."""
    g = torch.Generator().manual_seed(seed)
    rnd = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    yield "random", rnd
    dropped = rnd.clone()
    dropped[::3, 0] = -1
    dropped[1::5] = -1
    yield "dropped", dropped
    one = torch.full((T, K), -1, dtype=torch.long)
    one[:, 0] = E - 1  # every token to one expert, other experts empty
    yield "one_expert", one
    yield "t1", rnd[:1]


def swiglu_rows(x, e, w1, w2, w3):
    """float64 expert output for rows x [n, D] of expert e."""
    a1 = x @ w1[e].double().T
    a3 = x @ w3[e].double().T
    return (F.silu(a1) * a3) @ w2[e].double().T


def moe_f64(x, ids, weights, w1, w2, w3):
    xd = x.double()
    out = torch.zeros_like(xd)
    T, K = ids.shape
    for t in range(T):
        for k in range(K):
            e = int(ids[t, k])
            if e >= 0:
                out[t] += float(weights[t, k]) * swiglu_rows(xd[t : t + 1], e, w1, w2, w3)[0]
    return out


def rel_err(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))
