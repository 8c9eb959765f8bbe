"""Opt-in shims that let stock TorchTitan 0.2.2 train on a CPU-only machine.

TorchTitan 0.2.2 assumes an accelerator: with no GPU it still picks ``cuda`` as its device type,
calls ``torch.cuda`` memory APIs, runs a Triton kernel in the MoE token permutation, and uses
collectives that the gloo backend lacks. The shims below fix exactly those spots, so that the
stock trainer (``torchrun -m torchtitan.train``) runs unchanged on CPU: the tiny smoke configs,
the CPU A/B (stock vs converter) and the CI training tests rely on it.

They are opt-in: nothing is patched unless ``MEGAMOE_CPU=1`` is set AND no CUDA device is
visible. ``torchtitan_megamoe.config`` imports this module, and TorchTitan imports that while it
parses the TOML (in every rank, before it builds the device, meshes or model), so the shims are
in place in time; the stock and the converter runs get the same shims. TP does not work on CPU
(not shimmed).
"""

from __future__ import annotations

import os
import platform
import warnings

import torch

from torchtitan_megamoe import settings

ENV_VAR = settings.CPU
"""Set to ``1`` to apply the shims (only honoured when CUDA is not available)."""

_applied = False


def requested() -> bool:
    """True when the user asked for the CPU shims through ``MEGAMOE_CPU``."""
    return settings.cpu_shims()


def applied() -> bool:
    return _applied


# --------------------------------------------------------------------------------------------
# A stand-in for ``torch.cuda`` as TorchTitan's "device module".


def _read_proc_status_kib(key: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def _peak_rss_bytes() -> int:
    # VmHWM is the peak resident set size since the last reset (see reset_peak_memory_stats).
    kib = _read_proc_status_kib("VmHWM")
    if kib < 0:
        import resource

        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib * 1024


def _total_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 40


class _CpuProperties:
    def __init__(self) -> None:
        self.total_memory = _total_memory_bytes()
        self.name = _cpu_name()


def _cpu_name() -> str:
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


class CpuDeviceModule:
    """What TorchTitan calls on its device module (``torch.cuda`` on GPUs), answered for CPU.

    Memory is the process's peak resident set size (``VmHWM``): the CPU allocator keeps no
    statistics, and RSS is what an out-of-memory kill looks at. It includes the Python/PyTorch
    baseline (a few hundred MiB), so compare it between runs rather than read it as tensor memory.
    Anything not defined here falls through to ``torch.cpu``.
    """

    def set_device(self, device) -> None:
        # One CPU "device" per process; torch.device("cpu:<rank>") tensors live on the CPU anyway.
        pass

    def current_device(self) -> int:
        # An int (torch.cpu.current_device() returns the string "cpu"), because TorchTitan passes
        # it to barrier(device_ids=[...]), which builds torch.device("cpu", <id>) from it.
        return 0

    def device_count(self) -> int:
        return 1

    def is_available(self) -> bool:
        return True

    def synchronize(self, device=None) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_name(self, device=None) -> str:
        return _cpu_name()

    def get_device_properties(self, device=None) -> _CpuProperties:
        return _CpuProperties()

    def reset_peak_memory_stats(self, device=None) -> None:
        # Writing "5" to clear_refs resets VmHWM to the current RSS (Linux >= 4.0), so each logged
        # step reports its own peak as on GPU. Elsewhere the peak is the process-lifetime peak.
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass

    def memory_stats(self, device=None) -> dict[str, int]:
        peak = _peak_rss_bytes()
        return {
            "active_bytes.all.peak": peak,
            "reserved_bytes.all.peak": peak,
            "num_alloc_retries": 0,
            "num_ooms": 0,
        }

    def __getattr__(self, name: str):
        return getattr(torch.cpu, name)


# --------------------------------------------------------------------------------------------
# The individual shims.


def _rebind_device_type(device_module: CpuDeviceModule) -> None:
    # TorchTitan computes (device_type, device_module) once at import time from
    # torch._utils._get_available_device_type() or "cuda": without a GPU that is "cuda", so
    # set_device/to_empty/meshes would all target CUDA. Several modules copied the two names at
    # import (`from torchtitan.tools.utils import device_type`), so each copy is rebound; train.py
    # and validate.py read `utils.device_type` at run time and see the rebinding.
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.profiling as profiling
    import torchtitan.tools.utils as tt_utils

    for mod in (tt_utils, metrics, dist_utils, profiling, parallel_dims):
        if hasattr(mod, "device_type"):
            mod.device_type = "cpu"
        if hasattr(mod, "device_module"):
            mod.device_module = device_module


def _patch_histc() -> None:
    # The MoE router and TokenReorderer count tokens per expert with torch.histc on the int64
    # expert ids; the CPU kernel is not implemented for integer dtypes ("histogram_cpu" not
    # implemented for 'Long'). Integer CPU inputs are counted in float32 (exact below 2**24) and
    # returned in the input dtype, as the CUDA kernel does; every other call is untouched.
    original = torch.histc
    if getattr(original, "_megamoe_cpu_shim", False):
        return

    def histc(input, bins=100, min=0, max=0, *, out=None):  # noqa: A002 - torch's signature
        if (
            out is None
            and isinstance(input, torch.Tensor)
            and input.device.type == "cpu"
            and not input.is_floating_point()
            and not input.is_complex()
        ):
            return original(input.float(), bins=bins, min=min, max=max).to(input.dtype)
        if out is None:
            return original(input, bins=bins, min=min, max=max)
        return original(input, bins=bins, min=min, max=max, out=out)

    histc._megamoe_cpu_shim = True
    histc.__doc__ = original.__doc__
    torch.histc = histc


def _patch_permute_indices() -> None:
    # MoE token permutation (grouped-mm padding and expert-parallel dispatch) builds its index
    # vector with a Triton kernel, which cannot run on CPU tensors; TorchTitan ships a pure
    # PyTorch version behind `use_cpu=True`. moe/utils.py imported the function by name, so the
    # name there is rebound.
    import torchtitan.models.moe.kernels as kernels
    import torchtitan.models.moe.utils as moe_utils

    original = kernels.generate_permute_indices

    def generate_permute_indices(tokens_per_expert_group, *args, use_cpu: bool = False, **kw):
        use_cpu = use_cpu or tokens_per_expert_group.device.type == "cpu"
        return original(tokens_per_expert_group, *args, use_cpu=use_cpu, **kw)

    moe_utils.generate_permute_indices = generate_permute_indices


def _patch_fsdp_sum_reduction() -> None:
    # FSDP2 reduce-scatters gradients with ReduceOp.AVG (or PREMUL_SUM when a divide factor is
    # set, as TorchTitan does with EP); gloo implements neither. Forcing sum reduction makes FSDP
    # divide before/after the collective itself, which gloo supports (same math, fp32).
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as coll

    original = coll._get_gradient_divide_factors
    if getattr(original, "_megamoe_cpu_shim", False):
        return
    import inspect

    params = inspect.signature(original).parameters
    if "force_sum_reduction_for_comms" not in params:
        raise RuntimeError(
            "torchtitan_megamoe.cpu: this PyTorch's FSDP2 has no force_sum_reduction_for_comms; "
            "the gloo shim needs torch>=2.9. Upgrade torch or unset MEGAMOE_CPU."
        )
    names = list(params)

    def _get_gradient_divide_factors(*args, **kwargs):
        bound = dict(zip(names, args))
        bound.update(kwargs)
        bound["force_sum_reduction_for_comms"] = True
        return original(**bound)

    _get_gradient_divide_factors._megamoe_cpu_shim = True
    coll._get_gradient_divide_factors = _get_gradient_divide_factors


def apply() -> None:
    """Apply all CPU shims (idempotent). Call :func:`maybe_apply` instead unless testing."""
    global _applied
    if _applied:
        return
    device_module = CpuDeviceModule()
    _rebind_device_type(device_module)
    _patch_histc()
    _patch_permute_indices()
    _patch_fsdp_sum_reduction()
    _applied = True


def maybe_apply() -> bool:
    """Apply the shims if ``MEGAMOE_CPU=1`` and no CUDA device is visible; return whether on."""
    if not requested():
        return False
    if torch.cuda.is_available():
        warnings.warn(
            f"{ENV_VAR}=1 is ignored because a CUDA device is available; TorchTitan trains on "
            f"the GPU. Unset {ENV_VAR}, or hide the GPUs (CUDA_VISIBLE_DEVICES=) to train on CPU.",
            stacklevel=2,
        )
        return False
    apply()
    return True


maybe_apply()
