"""The replacement MoE block: stock router (top-k in one launch) -> fused ``mega_moe`` op ->
shared experts.

``MegaMoE`` is a drop-in for ``torchtitan.models.moe.MoE`` (it subclasses it, so TorchTitan's
``isinstance(.., MoE)`` checks in compile/AC/load-balancing keep treating it as an MoE block) with
the same parameter and buffer names, so checkpoints move freely between stock and converted
models. Only the forward differs: stock's reorder / all-to-all / grouped GEMM / unpermute / combine
chain becomes one call of the fused op.

That call runs inside ``MegaExperts.__call__``: with expert parallelism FSDP wraps ``moe.experts``
as its own unit, and its unshard / reduce-scatter hooks live on that module's call. Calling the op
with the experts' weights from anywhere else trains on stale shards and gives wrong losses.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from torchtitan.models.moe.moe import GroupedExperts, MoE, MoEArgs

import torchtitan_megamoe
from torchtitan_megamoe.ops.options import MegaMoEOptions
from torchtitan_megamoe.router import route


class KeepDtype:
    """Carries a tensor past FSDP's mixed-precision input cast.

    With expert parallelism FSDP wraps ``moe.experts`` on its own and casts every floating-point
    tensor argument of its call to ``param_dtype`` (bf16). Stock TorchTitan applies the routing
    weights outside the experts, in fp32; to keep that numerics, the weights travel in this holder,
    which FSDP's argument traversal does not open. Autograd is unaffected: the tensor inside is the
    same graph node.
    """

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class MegaExperts(GroupedExperts):
    """Routed experts computed by the fused op; same ``w1``/``w2``/``w3`` and init as stock.

    ``w1``, ``w3``: ``[num_experts, hidden_dim, dim]``; ``w2``: ``[num_experts, dim, hidden_dim]``.
    Under expert parallelism they are DTensors sharded ``Shard(0)`` on the ``ep`` mesh
    (``torchtitan_megamoe.parallel.MegaExpertParallel``): each rank keeps its contiguous block of
    experts and the op moves the tokens. ``options``: the op's settings, passed on every call
    (the converter builds one per model from ``[megamoe]``).
    """

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        *,
        options: MegaMoEOptions = MegaMoEOptions(),
    ):
        super().__init__(dim, hidden_dim, num_experts, use_grouped_mm=True)
        self.options = options

    @classmethod
    def from_grouped_experts(
        cls, experts: GroupedExperts, *, options: MegaMoEOptions
    ) -> "MegaExperts":
        """Adopt ``experts``' Parameter objects (no copy, no allocation: works on meta)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.num_experts = experts.num_experts
        # Same registration order as GroupedExperts, so state_dict key order matches stock.
        new.w1 = experts.w1
        new.w2 = experts.w2
        new.w3 = experts.w3
        new.use_grouped_mm = experts.use_grouped_mm  # unused; kept for code that reads it
        new.options = options
        return new

    def _local_weights_and_group(self):
        w1, w2, w3 = self.w1, self.w2, self.w3
        if not isinstance(w1, DTensor):
            return w1, w2, w3, None
        mesh = w1.device_mesh
        names = mesh.mesh_dim_names or ()
        if "ep" not in names or mesh.ndim != 1 or tuple(w1.placements) != (Shard(0),):
            raise RuntimeError(
                "megamoe: routed expert weights must be plain tensors or DTensors sharded "
                f"Shard(0) on a 1-D 'ep' mesh; got placements {w1.placements} on mesh dims "
                f"{names}. Only expert parallelism (no tensor / expert-tensor parallelism) is "
                "supported with the megamoe converter."
            )
        return w1.to_local(), w2.to_local(), w3.to_local(), mesh.get_group("ep")

    def forward(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor | KeepDtype,
    ) -> torch.Tensor:
        """``x`` [T, D] local tokens, ``topk_ids`` [T, K] global expert ids, ``topk_weights``
        [T, K] (a tensor, or a ``KeepDtype`` holding one) -> weighted expert sum [T, D] in x.dtype.
        """
        if isinstance(topk_weights, KeepDtype):
            topk_weights = topk_weights.tensor
        w1, w2, w3, group = self._local_weights_and_group()
        return torchtitan_megamoe.mega_moe(
            x,
            topk_ids,
            topk_weights,
            w1,
            w2,
            w3,
            group=group,
            **self.options.as_kwargs(),
        )

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, options={self.options}"


class MegaMoE(MoE):
    """Stock ``MoE`` semantics (router, load-balance accounting, shared experts) with the routed
    experts run by the fused op. Requires ``score_before_experts=False`` (the op applies the
    routing weights after the experts, as Qwen3 does).

    Build it from args (``MegaMoE(moe_args, dim, hidden_dim, options=MegaMoEOptions(...))``) or
    adopt an existing stock block without copying (``MegaMoE.from_moe(moe, options=...)``, what
    the converter does).
    """

    def __init__(
        self,
        moe_args: MoEArgs,
        dim: int,
        hidden_dim: int,
        *,
        options: MegaMoEOptions = MegaMoEOptions(),
    ):
        if moe_args.score_before_experts:
            raise ValueError(
                "megamoe: score_before_experts=True is not supported (the fused op weights the "
                "expert outputs, i.e. score_before_experts=False). Set "
                "moe_args.score_before_experts=False or do not use the megamoe converter."
            )
        super().__init__(moe_args, dim, hidden_dim)
        # Stateless in stock, and the fused op does its own token ordering.
        del self.reorderer
        # Assigning an existing child keeps its position, so state_dict order matches stock.
        self.experts = MegaExperts.from_grouped_experts(self.experts, options=options)

    @classmethod
    def from_moe(cls, moe: MoE, *, options: MegaMoEOptions) -> "MegaMoE":
        """Take over ``moe``'s modules, parameters and buffers as they are (on meta or not)."""
        if moe.score_before_experts:
            raise ValueError(
                "megamoe: score_before_experts=True is not supported; see MegaMoE."
            )
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        # Child and buffer registration order mirrors MoE.__init__ (state_dict order).
        new.experts = MegaExperts.from_grouped_experts(moe.experts, options=options)
        new.router = moe.router
        new.shared_experts = moe.shared_experts
        new.score_before_experts = moe.score_before_experts
        new.load_balance_coeff = moe.load_balance_coeff
        if moe.expert_bias is not None:
            new.register_buffer("expert_bias", moe.expert_bias, persistent=True)
        else:
            new.expert_bias = None
        new.register_buffer("tokens_per_expert", moe.tokens_per_expert, persistent=False)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [bs, slen, dim] -> [bs, slen, dim], same values as stock ``MoE.forward``."""
        bs, slen, dim = x.shape
        x = x.view(-1, dim)

        # stock's router, with its top-k in one kernel launch on GPUs (router.py)
        top_scores, selected_experts_indices, num_tokens_per_expert = route(
            self.router, x, self.expert_bias
        )
        # Same accounting as stock (the load-balancing hook reads it); double counting under
        # activation-checkpoint recompute is harmless there for the same reason (sign()).
        with torch.no_grad():
            self.tokens_per_expert.add_(num_tokens_per_expert)

        out_experts = self.experts(x, selected_experts_indices, KeepDtype(top_scores))

        if self.shared_experts is None:
            return out_experts.reshape(bs, slen, dim)
        out = self.shared_experts(x)
        return (out + out_experts).reshape(bs, slen, dim)
