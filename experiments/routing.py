"""What the variant harnesses share: balanced routing at a Qwen3 shape, the same every run."""

import torch

from torchtitan_megamoe.bench.shapes import SHAPES
from torchtitan_megamoe.ops.hopper.tiles import BLOCK_M
from torchtitan_megamoe.ops.hopper.plan import build_plan


def uniform_routing(E: int, K: int, T: int, device="cuda") -> torch.Tensor:
    """[T, K] expert ids: each token's K distinct experts drawn uniformly (one randperm each)."""
    return torch.stack([torch.randperm(E, device=device)[:K] for _ in range(T)])


def variant_setup(shape_name: str, tokens: int = 16384):
    """(D, H, E, K, T, plan) of a kernel variant harness at a Qwen3 shape: torch seeded with 0,
    then uniform_routing's ids planned in the GPU's 128-row tiles."""
    shape = SHAPES[shape_name]
    D, H, E, K = shape["dim"], shape["hidden"], shape["experts"], shape["top_k"]
    torch.manual_seed(0)
    return D, H, E, K, tokens, build_plan(uniform_routing(E, K, tokens), E, BLOCK_M)
