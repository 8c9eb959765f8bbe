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

FP8 weights. With an FP8 recipe on the hopper backend and ``fp8_weight_cache`` on (the
default), ``MegaExperts`` owns its weights' FP8 copies (ops/fp8_weights.py): it has the backend
make them from its parameters (ops/hopper/fp8_weights.py) once per optimizer step and before any
call that finds a parameter changed since (identity, version counter, storage: a checkpoint
load, a copy_), and passes them to the op, so no quantization runs in the step's backward. With
``fp8_free_after_backward`` (the default) it frees them once the layer's backward has read them
(``_FreeAfterBackward``) and the next forward makes them again: the end of the step's backward,
where every weight gradient is alive, holds one layer's copies instead of every layer's. With it
off it keeps them from one call to the next and re-makes them after each optimizer step
(``refresh_weight_copies``, the converter's post-optimizer hook). Where the recipe reads the
weights only through the copies (``Recipe.stand_ins``: ``fp8``) the op then gets zero-stride
stand-ins for the weights (``_StandIns``): no per-call cast under autocast, and the gradients
reach the parameters through them.

bf16 casts. Where the op's bf16 forward would cast fp32 weights itself (a bf16 autocast over
fp32 parameters: TorchTitan on one GPU without FSDP) and ``bf16_weight_cache`` is on (the
default), ``MegaExperts`` casts them once per step instead (``weight_casts``: at the start of the
model's forward, the converter's pre-hook), passes the casts to the op and frees them once its
backward has read them: one cast per weight and step, not one per forward and recompute.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from torchtitan.models.moe.moe import GroupedExperts, MoE, MoEArgs

import torchtitan_megamoe
from torchtitan_megamoe.fp8_allgather import ExpertWeight, Fp8Gathered, plain_state_dict
from torchtitan_megamoe.ops.api import (
    backend_casts_weights, backend_module, compute_dtype, resolved_backend,
)
from torchtitan_megamoe.ops.fp8_weights import ForwardWeights, Fp8Weights
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


class _StandIns(torch.autograd.Function):
    """Zero-stride stand-ins, each in its weight's dtype, for weights the op reads only through
    their FP8 copies (precision fp8): the op sees their shapes, writes their gradients in that
    dtype (an fp32 parameter's in fp32, no cast pass afterwards), and the gradients reach the
    parameters through them."""

    @staticmethod
    def forward(ctx, *weights):
        return tuple(_zero(w.dtype, w.device).expand(w.shape) for w in weights)

    @staticmethod
    def backward(ctx, *grads):
        return grads


_ZEROS: dict = {}
"""(dtype, device) -> a 0-d zero the stand-ins expand: made once, not a fill kernel per weight
and call (host time before the host-bound forward's next kernel)."""


def _zero(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    z = _ZEROS.get((dtype, device))
    if z is None:
        with torch.no_grad(), torch.inference_mode(False):
            z = _ZEROS[(dtype, device)] = torch.zeros((), dtype=dtype, device=device)
    return z


class _FreeAfterBackward(torch.autograd.Function):
    """Identity on one of the op's inputs that needs a gradient. It sits upstream of the op, so
    its backward runs after the op's backward, the last read of the layer's weight copies in
    the step; it frees the module's references (release_after_backward; the op's own, saved
    for its backward, are gone by then). Under activation checkpointing the recompute's copy
    of this node never runs."""

    @staticmethod
    def forward(ctx, owner, t):
        ctx.owner = owner
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        ctx.owner.release_after_backward()
        return None, grad


class MegaExperts(GroupedExperts):
    """Routed experts computed by the fused op; same ``w1``/``w2``/``w3`` and init as stock.

    ``w1``, ``w3``: ``[num_experts, hidden_dim, dim]``; ``w2``: ``[num_experts, dim, hidden_dim]``.
    Under expert parallelism they are DTensors sharded ``Shard(0)`` on the ``ep`` mesh
    (``torchtitan_megamoe.parallel.MegaExpertParallel``): each rank keeps its contiguous block of
    experts and the op moves the tokens. ``options``: the op's settings, passed on every call
    (the converter builds one per model from ``[megamoe]``); its recipe says which FP8 copies
    the module keeps (module docstring), ``options.fp8_keep_transposed`` whether the transposed
    ones too (False: 3·E·H·D bytes less per layer, the backward makes them from the forward
    copies by a byte transpose per call, no quantization), ``options.fp8_free_after_backward``
    whether they are freed after each backward (module docstring).
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
        self._init_fp8()

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
        new._init_fp8()
        return new

    def _init_fp8(self) -> None:
        self._fp8 = None  # fp8_weights.Fp8Weights of this layer, or None
        self._fp8_from = None  # what they were made from (_source_of)
        self.fp8_weights_made = 0  # how many times this module made its FP8 copies
        # under the FP8 all-gather (fp8_allgather.py): role -> (source, q, s) of the local
        # shard's FP8 copy, and how many times one was made
        self._fp8_shards = {}
        self.fp8_shards_made = 0
        self.register_state_dict_post_hook(plain_state_dict)
        # FSDP swaps the registered weights through setattr (a sharded DTensor at rest, the
        # gathered tensor in forward and backward); the gathered ones are refilled in place with
        # their version counter kept, so copies made from them could go stale unseen
        self._fsdp_managed = False
        self._casts = None  # the bf16 casts of the weights (bf16_weight_cache), or None
        self._casts_from = None  # what they were cast from (_source_of)
        self.weight_casts_made = 0

    def __setattr__(self, name, value):
        if name in ("w1", "w2", "w3") and isinstance(value, DTensor):
            # expert parallelism registers its DTensors with register_parameter; this is FSDP
            self.__dict__["_fsdp_managed"] = True
        super().__setattr__(name, value)

    def _source_of(self, weights, dtype) -> tuple:
        """What the FP8 copies of ``weights`` in ``dtype`` depend on: each tensor's identity,
        version counter (every in-place write through PyTorch moves it: the optimizer, copy_,
        a checkpoint load), storage and shape, and the recipe."""
        return (dtype, self.options.recipe, self.options.fp8_keep_transposed) + tuple(
            (id(w), w._version, w.data_ptr(), tuple(w.shape), w.dtype, w.device) for w in weights)

    def _fp8_applies(self, x: torch.Tensor, group) -> bool:
        """Whether this call takes module-owned FP8 copies: an FP8 recipe on the hopper
        backend with the cache on, one rank's experts, weights FSDP does not rewrite."""
        o = self.options
        return (o.recipe.fp8 and o.fp8_weight_cache and group is None
                and not self._fsdp_managed and resolved_backend(x, group, o.backend) == "hopper")

    def _casts_apply(self, x: torch.Tensor, group, weights) -> bool:
        """Whether this call takes module-owned bf16 casts: the op's hopper bf16 forward would
        cast these fp32 weights itself (api.backend_casts_weights), and the cache is on."""
        o = self.options
        # the cheap tests first: an FP8 forward (its host time is the step's bound) stops here
        if not (o.bf16_weight_cache and not o.recipe.fp8_forward and group is None
                and not self._fsdp_managed and torch.is_autocast_enabled(x.device.type)):
            return False
        probe = x.new_empty((0, x.shape[-1]), dtype=compute_dtype(x))  # x as the op casts it
        return backend_casts_weights(probe, weights, group, o)

    def weight_casts(self, weights, dtype) -> tuple:
        """This layer's bf16 casts of ``weights`` (the fp32 parameters), made again first if
        anything they depend on changed (_source_of)."""
        source = self._source_of(weights, dtype)
        if self._casts is None or source != self._casts_from:
            self._casts = None  # the old casts go before the new ones are made
            with torch.no_grad(), torch.inference_mode(False):
                self._casts = tuple(w.detach().to(dtype) for w in weights)
            self._casts_from = source
            self.weight_casts_made += 1
        return self._casts

    def _make_fp8(self, weights, dtype, source) -> None:
        self._fp8 = None  # the old copies go before the new ones are made
        # normal tensors even inside inference_mode (a later training call saves them)
        with torch.no_grad(), torch.inference_mode(False):
            w1, w2, w3 = (w.detach() for w in weights)
            forward, transposed = self.options.recipe.kept_copies(
                self.options.fp8_keep_transposed)
            self._fp8 = _copies_maker().make_fp8_weights(w1, w2, w3, forward=forward,
                                                         transposed=transposed, dtype=dtype)
        self._fp8_from = source
        self.fp8_weights_made += 1

    def fp8_weights(self, weights, dtype):
        """This layer's FP8 copies of ``weights`` (the parameters) for a call computing in
        ``dtype``, re-made first if anything they depend on changed (_source_of)."""
        source = self._source_of(weights, dtype)
        if self._fp8 is None or source != self._fp8_from:
            self._make_fp8(weights, dtype, source)
        return self._fp8

    def fp8_shard(self, role: str, local: torch.Tensor, dtype: torch.dtype):
        """(q, s): the FP8 copy of this rank's shard of weight ``role`` (an
        fp8_allgather.ExpertWeight), what its FSDP all-gather moves; re-made first if the shard
        changed since (identity, version counters, storage) or the dtype differs."""
        data = local._data
        # writes through ExpertWeights (fp8_allgather: the optimizer's, copy_) and through
        # plain aliases of the shard (a checkpoint loading into its state dict's tensors)
        source = (dtype, id(local), local.writes, data._version, data.data_ptr(),
                  tuple(data.shape))
        entry = self._fp8_shards.get(role)
        if entry is None or entry[0] != source:
            self._fp8_shards.pop(role, None)
            with torch.no_grad(), torch.inference_mode(False):
                q, s = _copies_maker().quantize_weight(data.detach().to(dtype))
            entry = self._fp8_shards[role] = (source, q, s)
            self.fp8_shards_made += 1
        return entry[1], entry[2]

    def make_weight_copies_ahead(self) -> bool:
        """Make the copies (FP8, or bf16 casts) this layer's next training forward will take,
        now (the converter's model pre-hook, before the first layer runs: the step's forward is
        host-bound, and its GPU still works through the queue then); returns whether any
        apply. The dtype is the one the layer will compute in (the autocast's, else its
        weights'), so its call finds them current."""
        if self._fsdp_managed:  # sharded at rest: FSDP's own hooks gather them at the call
            return False
        w1, w2, w3, group = self._local_weights_and_group()
        if isinstance(w1, Fp8Gathered):
            return False
        probe = w1.new_empty((0, w1.shape[2]))  # the layer's input as far as dtypes go
        made = False
        if self._fp8_applies(probe, group):
            self.fp8_weights((w1, w2, w3), compute_dtype(probe))
            made = True
        if self._casts_apply(probe, group, (w1, w2, w3)):
            self.weight_casts((w1, w2, w3), compute_dtype(probe))
            made = True
        return made

    def release_after_backward(self) -> None:
        """The layer's backward has read its copies (_FreeAfterBackward): free the bf16 casts,
        and the FP8 copies with ``fp8_free_after_backward``."""
        self.drop_weight_casts()
        if self.options.fp8_free_after_backward:
            self.drop_fp8_weights()

    def refresh_weight_copies(self) -> None:
        """After an optimizer step (the converter's post-optimizer hook): re-make the FP8 copies
        now, once, so that the step's calls find them current, and free the bf16 casts (the
        next forward makes them). Unconditionally: a fused optimizer (torch's fused AdamW,
        TorchTitan's default on GPUs) writes the weights without moving their version
        counters, so _source_of cannot see its step."""
        self.drop_weight_casts()
        for role, (source, _q, _s) in list(self._fp8_shards.items()):
            w = getattr(self, role)
            local = w._local_tensor if isinstance(w, DTensor) else None
            if isinstance(local, ExpertWeight):  # at rest (sharded): its all-gather comes next
                self._fp8_shards.pop(role)
                self.fp8_shard(role, local, source[0])
        if self._fp8 is None or self._fsdp_managed:
            return
        dtype = self._fp8_from[0]
        weights = (self.w1, self.w2, self.w3)
        self._make_fp8(weights, dtype, self._source_of(weights, dtype))

    def drop_fp8_weights(self) -> None:
        """Free the FP8 copies (they are made again on the next call that needs them)."""
        self._fp8 = self._fp8_from = None

    def drop_weight_casts(self) -> None:
        """Free the bf16 casts (they are made again on the next call that needs them)."""
        self._casts = self._casts_from = None

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
        fp8 = None
        if isinstance(w1, Fp8Gathered):
            # FSDP gathered the FP8 copies (fp8_allgather.py); the op reads only those
            if not self.options.recipe.stand_ins:
                raise RuntimeError(
                    "megamoe: FSDP gathers these expert weights as FP8 (a recipe that reads "
                    "the weights only through their FP8 copies, at conversion) but the layer now "
                    f"runs precision={self.options.precision!r}; convert the model again with "
                    "the precision it trains in")

            fp8 = Fp8Weights(ForwardWeights(w1._q, w1._s, w3._q, w3._s, w2._q, w2._s))
            w1, w2, w3 = _StandIns.apply(w1, w2, w3)
        elif self._fp8_applies(x, group):
            fp8 = self.fp8_weights((w1, w2, w3), compute_dtype(x))
            if self.options.recipe.stand_ins:
                w1, w2, w3 = _StandIns.apply(w1, w2, w3)
        elif self._fp8 is not None:
            self.drop_fp8_weights()  # no longer used (the settings or the parallelism changed)
        casts = None
        if self._casts_apply(x, group, (w1, w2, w3)):
            casts = self.weight_casts((w1, w2, w3), compute_dtype(x))
        elif self._casts is not None:
            self.drop_weight_casts()  # no longer used
        frees = casts is not None or (
            fp8 is not None and fp8 is self._fp8 and self.options.fp8_free_after_backward)
        if frees and torch.is_grad_enabled():
            if x.requires_grad:
                x = _FreeAfterBackward.apply(self, x)
            elif w1.requires_grad:
                w1 = _FreeAfterBackward.apply(self, w1)
        return torchtitan_megamoe.mega_moe(
            x,
            topk_ids,
            topk_weights,
            w1,
            w2,
            w3,
            group=group,
            fp8_weights=fp8,
            weight_casts=casts,
            **self.options.as_kwargs(),
        )

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, options={self.options}"


def _copies_maker():
    """The backend that makes the module-owned FP8 copies: the one that reads them (module
    docstring), imported only once a layer needs copies."""
    return backend_module("hopper")


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
