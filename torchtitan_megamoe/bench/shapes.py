"""The benchmarked MoE layers: Qwen3 shapes, stock TorchTitan's MoE block built and EP-sharded
as training does, and the output error measure."""

from __future__ import annotations

import torch

SHAPES = {
    # hidden a multiple of 128: the fp8 rows' 128-wide scaling blocks need it
    "tiny": dict(name="tiny (smoke)", dim=128, hidden=128, experts=8, top_k=2),
    "30b": dict(name="Qwen3-30B-A3B", dim=2048, hidden=768, experts=128, top_k=8),
    "235b": dict(name="Qwen3-235B-A22B", dim=4096, hidden=1536, experts=128, top_k=8),
}


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.float(), ref.float()
    return float((got - ref).norm() / ref.norm())


def build_stock_moe(shape: dict, device: torch.device):
    from torchtitan.models.moe import MoE, MoEArgs

    if device.type == "cpu":
        # stock counts int64 expert ids with torch.histc and pads the grouped GEMMs' rows (and
        # EP dispatch) with a Triton kernel, neither of which runs on CPU tensors: the project's
        # CPU shims (this process)
        from torchtitan_megamoe import cpu

        cpu.apply()

    args = MoEArgs(
        num_experts=shape["experts"],
        num_shared_experts=0,
        top_k=shape["top_k"],
        score_func="softmax",
        route_norm=True,
        route_scale=1.0,
        score_before_experts=False,
        # stock's grouped-mm path, as on GPUs: on CPU torch._grouped_mm runs too, and the CPU
        # shims above replace the Triton kernel of its index padding and EP dispatch
        use_grouped_mm=True,
    )
    with torch.device(device):
        moe = MoE(args, dim=shape["dim"], hidden_dim=shape["hidden"])
    with torch.no_grad():
        moe.init_weights(init_std=0.02, buffer_device=device)
    # Parameters in bf16 (what FSDP mixed precision computes with); router buffers stay fp32.
    for p in moe.parameters():
        p.data = p.data.to(torch.bfloat16)
    return moe


def shard_stock_experts(moe, mesh) -> None:
    """TorchTitan's own EP wiring of a MoE block (what apply_moe_ep_tp does without TP).

    ``mesh`` is 1-D with dim name "ep": GroupedExperts checks that name to skip its own index
    padding, since ExpertParallel's dispatch pads every local expert's rows to the group
    alignment itself. Experts are split evenly: rank r keeps [r*E/N, (r+1)*E/N).
    """
    from torch.distributed.tensor.parallel import parallelize_module
    from torchtitan.distributed.expert_parallel import ExpertParallel

    if mesh.mesh_dim_names != ("ep",):
        raise ValueError(f"stock EP needs a 1-D DeviceMesh named 'ep', got {mesh.mesh_dim_names}; "
                         "build it with init_device_mesh(type, (N,), mesh_dim_names=('ep',))")
    parallelize_module(moe.experts, mesh, ExpertParallel())
