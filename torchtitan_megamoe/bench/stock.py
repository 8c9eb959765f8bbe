"""The stock baselines besides eager: TorchTitan's MoE block under ``torch.compile`` as
``--compile.enable`` compiles it, the whole block under one ``torch.compile``, and stock +
torchao's rowwise FP8 grouped GEMMs as TorchTitan's ``quantize.grouped_mm.float8`` converter
applies them; and how a row that cannot run is named.

Compile (TorchTitan 0.2.2, ``apply_compile`` in torchtitan/models/llama4/infra/parallelize.py,
which qwen3's parallelize imports): for a MoE block, every child of the ``MoE`` module except
``experts`` (the router and the token reorderer; Qwen3 has no shared experts) is wrapped in
``torch.compile(child, backend=..., fullgraph=True)``; ``MoE.forward`` itself (gather, unpermute,
combine) and ``GroupedExperts.forward`` (index padding; under EP the ExpertParallel hooks) stay
eager; the module-level ``torchtitan.models.moe.moe._run_experts_grouped_mm`` (the three grouped
GEMMs and SwiGLU) is replaced by its ``torch.compile(..., fullgraph=True)``, and under EP by a
wrapper that marks the token dim of ``x`` dynamic first. ``capture_scalar_outputs`` is set, as
there. The benchmark adds ``dynamic=False`` (fixed shapes: no recompile on a second shape of
the same call) and resets dynamo per compiled layer, so that the recompile limit is never hit.

Unlike TorchTitan, which patches once for the process, ``CompiledStock.active()`` swaps the
compiled pieces in only inside its ``with``: the same module then also runs eager.

Block-compiled (``BlockCompiledStock``, a stronger baseline than TorchTitan's own compile): the
whole ``MoE.forward`` under one ``torch.compile(moe, fullgraph=True, dynamic=False)``: router,
token reorder, the gather, GroupedExperts' index padding (``generate_permute_indices``), the
three grouped GEMMs with SwiGLU, the unpermute and the score-weighted combine (Qwen3 has no
shared expert; one would be inside too), forward and backward. At EP=1 on a GPU that path has
no host sync: the index padding's Triton kernel takes the token counts as a device tensor and
``torch._grouped_mm`` its offsets as one. Where fullgraph does not trace (on CPU the padding
runs TorchTitan's ``fill_indices_cpu``, which reads every count with ``.item()`` and branches on
it: "data-dependent branching"), the module is compiled again with ``fullgraph=False`` (graph
breaks allowed) and the fullgraph error is kept; the number of graphs dynamo compiled for the
first forward is counted (graph breaks = graphs - 1, as ``torch._dynamo.explain`` counts them,
without its extra trace), with the breaks' reasons from dynamo's counters.

FP8 (TorchTitan 0.2.2's ``Float8GroupedMMConverter``): ``set_token_group_alignment_size_m(16)``,
then ``quantize_(model, MoETrainingConfig(), filter_fn=<fqn filter>)``. torchao 0.18 renamed the
config to ``torchao.prototype.moe_training.config.Float8TrainingOpConfig`` (TorchTitan 0.2.2's
import fails there), so it is driven directly here: ``quantize_`` with that config and a filter
that selects the ``GroupedExperts`` module swaps its w1/w2/w3 for torchao's weight wrapper
tensors, whose ``torch._grouped_mm`` quantizes both operands rowwise to float8 and runs
``torch._scaled_grouped_mm``, forward and backward.
"""

from __future__ import annotations

import contextlib
import sys
import traceback

import torch

FP8_TOKEN_GROUP_ALIGNMENT = 16
"""torchtitan.components.quantization.FP8_GROUP_ALIGNMENT_SIZE: the FP8 grouped GEMM needs every
expert's row count padded to 16 (16 bytes of e4m3)."""


class Unavailable(RuntimeError):
    """A row that this machine or this install cannot run (reported, not raised)."""


def note_for(err: BaseException) -> str:
    """What a table prints in place of a number: ``not available: ...`` for
    NotImplementedError (a backend without that precision yet) and Unavailable, else
    ``failed: Type: ...`` (its traceback goes to stderr)."""
    msg = " ".join(str(err).split())
    if isinstance(err, (NotImplementedError, Unavailable)):
        return f"not available: {msg}"
    traceback.print_exception(type(err), err, err.__traceback__, file=sys.stderr)
    return f"failed: {type(err).__name__}: {msg}"


def _moe_module():
    import torchtitan.models.moe.moe as moe_module

    return moe_module


_EAGER_GROUPED_MM = None


def _eager_grouped_mm():
    """TorchTitan's own _run_experts_grouped_mm (captured once, before anything patches it)."""
    global _EAGER_GROUPED_MM
    if _EAGER_GROUPED_MM is None:
        fn = _moe_module()._run_experts_grouped_mm
        _EAGER_GROUPED_MM = getattr(fn, "_megamoe_eager", fn)
    return _EAGER_GROUPED_MM


def graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process so far (to check that timing recompiles
    nothing); -1 where this torch keeps no such counter."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001 - a diagnostic only
        return -1


class CompiledStock:
    """One stock ``MoE`` block compiled the way TorchTitan's ``--compile.enable`` compiles it
    (see the module docstring); ``ep=True`` as with expert parallelism on. Compilation happens
    on the first calls inside ``active()``."""

    def __init__(self, moe, ep: bool = False, backend: str = "inductor"):
        torch._dynamo.reset()  # every compiled layer starts with empty caches and counts
        torch._dynamo.config.capture_scalar_outputs = True  # as apply_compile sets it
        self.moe = moe
        self.eager_children = {n: c for n, c in moe.named_children() if n != "experts"}
        self.compiled_children = {
            n: torch.compile(c, backend=backend, fullgraph=True, dynamic=False)
            for n, c in self.eager_children.items()
        }
        eager = _eager_grouped_mm()
        compiled = torch.compile(eager, backend=backend, fullgraph=True, dynamic=False)
        if ep:
            def compiled_ep(w1, w2, w3, x, num_tokens_per_expert):
                # as TorchTitan's _run_experts_grouped_mm_dynamic: the rows an EP rank
                # receives vary from step to step
                torch._dynamo.mark_dynamic(x, 0)
                return compiled(w1, w2, w3, x, num_tokens_per_expert)

            self.grouped_mm = compiled_ep
        else:
            self.grouped_mm = compiled
        self.grouped_mm._megamoe_eager = eager

    @contextlib.contextmanager
    def active(self):
        """Inside: ``moe(x)`` runs compiled; outside (and on errors) eager again."""
        module = _moe_module()
        for name, child in self.compiled_children.items():
            setattr(self.moe, name, child)
        module._run_experts_grouped_mm = self.grouped_mm
        try:
            yield self.moe
        finally:
            for name, child in self.eager_children.items():
                setattr(self.moe, name, child)
            module._run_experts_grouped_mm = _eager_grouped_mm()

    def __call__(self, x):
        with self.active():
            return self.moe(x)


def _dynamo_break_reasons() -> dict:
    """Dynamo's graph-break reason counts so far in this process ({} where it keeps none)."""
    try:
        from torch._dynamo.utils import counters

        out = {}
        for category in ("graph_break", "unimplemented"):
            for reason, n in counters[category].items():
                out[reason] = out.get(reason, 0) + int(n)
        return out
    except Exception:  # noqa: BLE001 - a diagnostic only
        return {}


def _first_line(msg: str, width: int = 200) -> str:
    line = next((ln.strip() for ln in str(msg).splitlines() if ln.strip()), "")
    return line if len(line) <= width else line[: width - 3] + "..."


def _fullgraph_error(err: BaseException) -> str:
    """A fullgraph failure in one line: its type, its first line and dynamo's "Caused by"
    line (the source line that broke the graph) where it gives one."""
    msg = str(err)
    caused = next((ln.strip() for ln in msg.splitlines() if ln.strip().startswith("Caused by")),
                  "")
    return f"{type(err).__name__}: {_first_line(msg)}" + (f" [{caused}]" if caused else "")


class BlockCompiledStock:
    """The whole stock ``MoE`` block under one ``torch.compile`` (see the module docstring):
    ``fullgraph=True`` first; if dynamo cannot trace it as one graph, ``fullgraph=False``
    (graph breaks allowed). Calls compile on first use per grad mode. After the first call:
    ``mode`` ("fullgraph" or "default"), ``fullgraph_error`` (why fullgraph failed, or None),
    ``graphs`` (graphs compiled by the first call), ``graph_breaks`` (graphs - 1) and
    ``break_reasons`` (dynamo's first line of each new reason, with its count)."""

    FULLGRAPH = "fullgraph"
    DEFAULT = "default (graph breaks allowed)"

    def __init__(self, moe, backend: str = "inductor"):
        torch._dynamo.reset()  # empty caches and counts, as CompiledStock
        # as apply_compile sets it: .item()/.tolist() of counts become unbacked symbols
        torch._dynamo.config.capture_scalar_outputs = True
        self.moe = moe
        self.backend = backend
        self.mode = self.FULLGRAPH
        self.fullgraph_error: str | None = None
        self.graphs: int | None = None
        self.graph_breaks: int | None = None
        self.break_reasons: dict[str, int] = {}
        self._fn = torch.compile(moe, backend=backend, fullgraph=True, dynamic=False)

    def _fallback(self, err: BaseException) -> None:
        self.mode = self.DEFAULT
        self.fullgraph_error = _fullgraph_error(err)
        self._fn = torch.compile(self.moe, backend=self.backend, fullgraph=False, dynamic=False)

    def __call__(self, x):
        first = self.graphs is None
        if first:
            graphs0, reasons0 = graphs_compiled(), _dynamo_break_reasons()
        try:
            out = self._fn(x)
        except torch._dynamo.exc.BackendCompilerFailed:
            raise  # the backend failed on a traced graph: not a tracing limit, no fallback
        except Exception as err:  # noqa: BLE001 - Unsupported, UserError (data-dependent), ...
            if self.mode != self.FULLGRAPH:
                raise
            self._fallback(err)
            if first:
                graphs0, reasons0 = graphs_compiled(), _dynamo_break_reasons()
            out = self._fn(x)
        if first:
            graphs = graphs_compiled()
            if graphs >= 0 and graphs0 >= 0:
                self.graphs = graphs - graphs0
                self.graph_breaks = max(self.graphs - 1, 0)
            else:
                self.graphs = -1
            reasons = _dynamo_break_reasons()
            for reason, n in reasons.items():
                new = n - reasons0.get(reason, 0)
                if new > 0:
                    key = _first_line(reason, 120)
                    self.break_reasons[key] = self.break_reasons.get(key, 0) + new
        return out

    def describe(self) -> dict:
        """What the bench records of it (keys without the result prefix)."""
        d = {"mode": self.mode}
        if self.fullgraph_error:
            d["fullgraph_error"] = self.fullgraph_error
        if self.graphs is not None and self.graphs >= 0:
            d["graphs"] = self.graphs
            d["graph_breaks"] = self.graph_breaks
        if self.break_reasons:
            d["break_reasons"] = dict(self.break_reasons)
        return d


@contextlib.contextmanager
def token_group_alignment(m: int):
    """TorchTitan's per-expert row padding set to ``m`` inside (its FP8 converter sets 16 for
    the process), restored after."""
    from torchtitan.models.moe import utils as moe_utils

    old = moe_utils.TOKEN_GROUP_ALIGN_SIZE_M
    moe_utils.set_token_group_alignment_size_m(m)
    try:
        yield
    finally:
        moe_utils.TOKEN_GROUP_ALIGN_SIZE_M = old


def torchao_version() -> str | None:
    try:
        import importlib.metadata as md

        return md.version("torchao")
    except Exception:  # noqa: BLE001 - not installed
        return None


def convert_torchao_fp8(moe) -> None:
    """Swap ``moe``'s expert weights for torchao's FP8 training tensors, in place, as
    TorchTitan's float8 MoE converter does (run it inside ``token_group_alignment(16)``).
    Raises Unavailable when torchao cannot be imported or the experts do not use
    ``torch._grouped_mm`` (stock's for-loop path, which the CPU runs take)."""
    try:
        from torchao.prototype.moe_training.config import Float8TrainingOpConfig
        from torchao.quantization import quantize_
    except Exception as err:  # noqa: BLE001 - ImportError, or a torchao built for another torch
        raise Unavailable(
            f"torchao not installed or not importable ({type(err).__name__}: {err}); "
            "pip install torchao==0.18.0 (its Float8TrainingOpConfig)") from err
    from torchtitan.models.moe.moe import GroupedExperts

    if not moe.experts.use_grouped_mm:
        raise Unavailable("stock's experts run the for-loop path (no torch._grouped_mm for "
                          "torchao to replace; the CPU smoke runs take it)")

    def only_grouped_experts(mod, fqn: str) -> bool:
        return isinstance(mod, GroupedExperts)

    quantize_(moe, config=Float8TrainingOpConfig(), filter_fn=only_grouped_experts)


def plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached, unwrapped from torchao's weight wrapper tensor where it is one."""
    t = t.detach()
    inner = getattr(t, "_data", None)
    return inner if isinstance(inner, torch.Tensor) else t
