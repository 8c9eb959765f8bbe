"""FSDP2 all-gathers the routed experts' weights as their FP8 copies (precision ``fp8``).

Under FSDP each rank keeps a shard of every expert weight: whole experts (dim 0), so each
128 x 128 block lies in one rank's shard. FSDP2's all-gather extension (a tensor subclass whose
``fsdp_pre_all_gather`` says what each rank contributes and whose ``fsdp_post_all_gather`` builds
the gathered parameter from it: the mechanism torchao's float8 training uses for its weights)
lets the all-gather move the shard's FP8 copy instead of its bf16 values:

    at rest      w1, w2, w3 are ``ExpertWeight`` tensors (the fp32 or bf16 shard, unchanged for
                 the optimizer, checkpoints and init: every op runs on the plain tensor inside)
    all-gather   ``fsdp_pre_all_gather``: the shard's e4m3 blocks and scales, which the module
                 (moe.MegaExperts) made once per optimizer step and re-makes only if the shard
                 changed since (identity, version counter, storage); half of bf16's bytes
    gathered     ``Fp8Gathered``: shape and dtype of the bf16 weight, holding the gathered e4m3
                 copy and its scales; MegaExperts hands them to the op and gives the op
                 zero-stride stand-ins whose gradients reach the gathered parameter, which FSDP
                 reduce-scatters as usual (bf16 gradients)
    backward     FSDP gathers the same FP8 copy again; the transposed copies are made from it
                 (a byte transpose, fp8_weights.w2_transposed / w13_transposed)

The converter installs it (``install``) for precision ``fp8`` with ``fp8_weight_cache`` on when
FSDP shards the experts evenly (a rank's experts divisible by their FSDP degree: FSDP's extension
takes no padding for inputs shaped unlike the parameter). Under expert parallelism FSDP shards
each rank's local experts over the ranks EP leaves; where that is one rank FSDP2 moves a single
input, so q and s then travel as one byte buffer. Elsewhere under FSDP the weights are gathered
in bf16 and quantized on every call (``fp8_bwd``'s bf16 forward needs them).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

aten = torch.ops.aten

# ops whose output is the shard in another form: still an ExpertWeight, so fully_shard's
# chunk / pad / narrow, to_empty and the checkpoint's detach keep the extension. Views share
# the writes counter of what they view; copies and new buffers start their own.
_VIEWS = {
    aten.alias.default, aten.detach.default, aten.view.default, aten._unsafe_view.default,
    aten.slice.Tensor, aten.split.Tensor, aten.split_with_sizes.default, aten.narrow.default,
    aten.as_strided.default, aten.chunk.default,
}
_COPIES = {
    aten.clone.default, aten._to_copy.default, aten.empty_like.default, aten.new_zeros.default,
    aten.new_empty.default, aten.new_empty_strided.default, aten._pin_memory.default,
}
# not zeros_like: the optimizer's state (made by it) stays plain, as checkpoints need


class ExpertWeight(torch.Tensor):
    """A routed expert weight (``role``: w1, w2 or w3) whose FSDP all-gather moves its FP8 copy.
    Everything else sees the plain tensor inside (``_data``). ``writes``: how many in-place
    writes reached its storage through any ExpertWeight viewing it (the version counters of
    the tensors inside do not move below autograd, where those writes run)."""

    _data: torch.Tensor
    _role: str
    _writes: list

    @staticmethod
    def __new__(cls, data: torch.Tensor, role: str, writes: list | None = None):
        t = torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), storage_offset=data.storage_offset(),
            dtype=data.dtype, layout=data.layout, device=data.device,
            requires_grad=data.requires_grad)
        t._data = data
        t._role = role
        t._writes = [0] if writes is None else writes
        return t

    @property
    def writes(self) -> int:
        return self._writes[0]

    def __repr__(self):
        return f"ExpertWeight({self._role}, {self._data!r})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        src = next(a for a in _flat(args, kwargs) if isinstance(a, ExpertWeight))
        out = func(*tree_map_only(ExpertWeight, lambda t: t._data, args),
                   **tree_map_only(ExpertWeight, lambda t: t._data, kwargs or {}))
        if func._schema.is_mutable:
            # the optimizer's foreach updates, copy_ (a checkpoint load), init: counted here,
            # since the FP8 copy of the shard is keyed on it
            for w in _written(func, args, kwargs):
                w._writes[0] += 1
            if args and isinstance(args[0], ExpertWeight):
                return args[0]  # in place: the wrapper is the result, as for a plain tensor
        if func in _VIEWS:
            return tree_map_only(torch.Tensor,
                                 lambda t: ExpertWeight(t, src._role, src._writes), out)
        if func in _COPIES:
            return tree_map_only(torch.Tensor, lambda t: ExpertWeight(t, src._role), out)
        return out

    def __tensor_flatten__(self):
        return ["_data"], (self._role,)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return ExpertWeight(inner["_data"], *meta)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        dtype = mp_policy.param_dtype or self.dtype
        q, s = module.fp8_shard(self._role, self, dtype)
        if mesh.size() > 1:
            return (q.view(torch.uint8), s), (dtype, None)
        # one rank (EP over all of FSDP's ranks): FSDP2 then moves one input only, so q and s
        # go as the one byte buffer they were made in
        from torchtitan_megamoe.ops.hopper.fp8_weights import shard_bytes

        return (shard_bytes(q, s),), (dtype, (q.shape, s.shape))

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        dtype, packed = metadata
        if packed is None:
            q, s = all_gather_outputs
        else:
            (buf,), (q_shape, s_shape) = all_gather_outputs, packed
            n = q_shape.numel()
            q, s = buf[:n].view(q_shape), buf[n:].view(torch.float32).view(s_shape)
        if out is not None:
            # the second gather refills the same buffers (FSDP reallocates them in place); at
            # EP > 1 FSDP hands the parameter as the experts' DTensor on the ep mesh
            got = out.to_local() if isinstance(out, DTensor) else out
            assert got._q.data_ptr() == q.data_ptr(), "FP8 gather buffers moved"
            return None
        return Fp8Gathered(q.view(torch.float8_e4m3fn), s, dtype), ()


def _written(func, args, kwargs):
    """The ExpertWeights that ``func`` writes (its schema's mutable arguments)."""
    kwargs = kwargs or {}
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        for t in (value if isinstance(value, (list, tuple)) else (value,)):
            if isinstance(t, ExpertWeight):
                yield t


def _flat(args, kwargs):
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a
    yield from (kwargs or {}).values()


class Fp8Gathered(torch.Tensor):
    """The gathered expert weight under the FP8 all-gather: shape and dtype of the bf16
    weight, values only in ``_q`` (e4m3 [E, N, K]) and ``_s`` (fp32 [E, N/128, K/128] block
    scales). Only MegaExperts reads it; FSDP re-wraps it (as_strided, detach)."""

    _q: torch.Tensor
    _s: torch.Tensor

    @staticmethod
    def __new__(cls, q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype,
                requires_grad: bool = False):
        t = torch.Tensor._make_wrapper_subclass(
            cls, q.shape, dtype=dtype, device=q.device, requires_grad=requires_grad)
        t._q, t._s = q, s
        return t

    def __repr__(self):
        return f"Fp8Gathered(shape={tuple(self.shape)}, dtype={self.dtype})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        me = args[0]
        if func in (aten.detach.default, aten.alias.default) or (
                func in (aten.as_strided.default, aten.view.default)
                and tuple(args[1]) == tuple(me.shape)):
            return Fp8Gathered(me._q, me._s, me.dtype)
        if func in (aten.empty_like.default, aten.zeros_like.default,
                    aten.new_empty_strided.default, aten.new_zeros.default):
            # a buffer shaped like the weight (autograd's gradient layout): a plain tensor
            return func(torch.empty(me.shape, dtype=me.dtype, device=me.device), *args[1:],
                        **kwargs)
        raise NotImplementedError(
            f"megamoe: {func} on an expert weight gathered as FP8 (only MegaExperts reads it: "
            "set [megamoe] fp8_weight_cache = false to gather bf16 weights)")

    def __tensor_flatten__(self):
        return ["_q", "_s"], (self.dtype,)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Fp8Gathered(inner["_q"], inner["_s"], *meta)


def plain_state_dict(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    """State-dict post-hook of MegaExperts: its weights as plain tensors (DTensors of plain
    local tensors) aliasing the ExpertWeights' storage, so checkpoints hold stock's tensors and
    load back in place (a write through them moves the inner tensor's version counter, which
    the shard's FP8 copy is keyed on too)."""
    from torch.distributed.tensor import DTensor

    for role in ("w1", "w2", "w3"):
        key = prefix + role
        value = state_dict.get(key)
        if isinstance(value, DTensor) and isinstance(value._local_tensor, ExpertWeight):
            state_dict[key] = DTensor.from_local(
                value._local_tensor._data.detach(), value.device_mesh, value.placements,
                run_check=False, shape=value.shape, stride=value.stride())
        elif isinstance(value, ExpertWeight):
            state_dict[key] = value._data.detach()


def install(experts: nn.Module) -> None:
    """Make ``experts``' w1, w2, w3 ExpertWeights (before fully_shard: on meta is fine)."""
    for role in ("w1", "w2", "w3"):
        p = getattr(experts, role)
        if isinstance(p, ExpertWeight):
            continue
        setattr(experts, role, nn.Parameter(ExpertWeight(p.detach(), role),
                                            requires_grad=p.requires_grad))


def installed(experts: nn.Module) -> bool:
    w = experts.w1
    local = getattr(w, "_local_tensor", w)
    return isinstance(local, ExpertWeight) or isinstance(w, (ExpertWeight, Fp8Gathered))
