"""The megamoe converter on real (tiny) TorchTitan Qwen3-MoE models, CPU, reference backend.

Stock and converted models are built the way TorchTitan's trainer builds them (meta device,
convert, to_empty, init_weights) and compared: state-dict layout, init values, forward values,
gradients, load-balance accounting; then every validation error; then TorchTitan's
parallelize-time hooks (EP routing, SAC save list, compile wrapping).
"""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from torch import nn

from torchtitan.config import ConfigManager
from torchtitan.models.moe.moe import GroupedExperts, MoE
from torchtitan.models.qwen3 import Qwen3Model
from torchtitan.protocols.model_converter import (
    _registry_model_converter_cls,
    build_model_converters,
)

from torchtitan_megamoe.converter import MegaMoEConverter
from torchtitan_megamoe.moe import KeepDtype, MegaExperts, MegaMoE
from torchtitan_megamoe.ops.options import MegaMoEOptions
from torchtitan_megamoe.ops.recipe import RECIPES
from torchtitan_megamoe.ops.shapes import hopper_multiple, shape_error
from torchtitan_megamoe.parallel import install_ep_routing

from moe_testing import (
    build_converted,
    build_stock,
    cpu_histc,
    init_gloo,
    job_config,
    rel_err,
    tiny_args,
    with_parallelism,
)


@pytest.fixture(autouse=True)
def _histc():
    with cpu_histc():
        yield


VARIANTS = {
    "qwen3": {},
    "shared_sigmoid_bias": dict(
        num_shared_experts=1, score_func="sigmoid", route_norm=False, route_scale=2.5
    ),
    "node_limited": dict(num_expert_groups=4, num_limited_groups=2, top_k=3),
    "no_load_balance": dict(load_balance_coeff=None),
}


# --------------------------------------------------------------------------- registration


def test_toml_section_and_registration():
    jc = ConfigManager().parse_args(
        [
            "--job.custom_config_module",
            "torchtitan_megamoe.config",
            "--model.converters",
            "megamoe",
            "--megamoe.backend",
            "reference",
            "--megamoe.precision",
            "fp8_bwd",
        ]
    )
    assert _registry_model_converter_cls["megamoe"] is MegaMoEConverter
    assert (jc.megamoe.backend, jc.megamoe.precision) == ("reference", "fp8_bwd")
    with torch.device("meta"):
        model = Qwen3Model(tiny_args(dim=128, moe_inter_dim=128))  # fp8 needs 128-multiples
    build_model_converters(jc, None).convert(model)
    moes = [b.moe for b in model.layers.values()]
    assert all(type(m) is MegaMoE for m in moes)
    assert all(
        (m.experts.options.backend, m.experts.options.precision) == ("reference", "fp8_bwd")
        for m in moes
    )


# --------------------------------------------------------------------------- layout and init


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_state_dict_layout_matches_stock(variant):
    args = tiny_args(**VARIANTS[variant])
    with torch.device("meta"):
        stock, converted = Qwen3Model(args), Qwen3Model(args)
    MegaMoEConverter(job_config(), None).convert(converted)

    def layout(m):
        sd = m.state_dict()
        return [(k, tuple(v.shape), v.dtype) for k, v in sd.items()]

    assert layout(converted) == layout(stock)
    # Non-persistent buffers too (tokens_per_expert is read by the load-balancing hook).
    assert [(n, b.dtype) for n, b in converted.named_buffers()] == [
        (n, b.dtype) for n, b in stock.named_buffers()
    ]
    moe = converted.layers["0"].moe
    assert isinstance(moe, MoE) and isinstance(moe.experts, GroupedExperts)
    assert type(moe.router.gate) is nn.Linear  # op-level SAC looks the router gate up by type


def test_convert_on_meta_reuses_parameters_and_allocates_nothing():
    # Real Qwen3-30B-A3B layer shapes: one real copy of one layer's experts would be 2.4 GB.
    from torchtitan.models.qwen3 import qwen3_args

    args = copy.deepcopy(qwen3_args["30B-A3B"])
    args.n_layers = 2
    with torch.device("meta"):
        model = Qwen3Model(args)
    before = {n: p for n, p in model.named_parameters()}
    before_buffers = {n: b for n, b in model.named_buffers()}

    seen_devices = set()

    class RecordDevices(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    seen_devices.add(t.device.type)
            return out

    with RecordDevices():
        MegaMoEConverter(job_config(backend="auto"), None).convert(model)

    assert seen_devices <= {"meta"}, f"convert() created tensors on {seen_devices}"
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    assert all(after[n] is before[n] for n in before), "parameters must be reused, not copied"
    assert all(p.is_meta for p in after.values())
    after_buffers = dict(model.named_buffers())
    assert all(after_buffers[n] is before_buffers[n] for n in before_buffers)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_init_weights_match_stock(variant):
    args = tiny_args(**VARIANTS[variant])
    stock, converted = build_stock(args, seed=3), build_converted(args, seed=3)
    sd_s, sd_c = stock.state_dict(), converted.state_dict()
    assert list(sd_s) == list(sd_c)
    for k in sd_s:
        assert torch.equal(sd_s[k], sd_c[k]), k
    # A different seed must give different weights (the comparison above can fail).
    other = build_converted(args, seed=4).state_dict()
    assert not torch.equal(other["layers.0.moe.experts.w1"], sd_s["layers.0.moe.experts.w1"])


# --------------------------------------------------------------------------- numerics


def _fwd_bwd(model, tokens, seed=11):
    out = model(tokens)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    (out * g).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_forward_backward_match_stock_fp32(variant):
    args = tiny_args(**VARIANTS[variant])
    stock, converted = build_stock(args, seed=1), build_converted(args, seed=1)
    # A non-zero expert_bias changes routing: both must honour it identically.
    for block_s, block_c in zip(stock.layers.values(), converted.layers.values()):
        if block_s.moe.expert_bias is not None:
            bias = torch.linspace(-0.2, 0.2, block_s.moe.expert_bias.numel())
            block_s.moe.expert_bias.copy_(bias)
            block_c.moe.expert_bias.copy_(bias)
    tokens = torch.randint(0, args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(5))

    out_s, grads_s = _fwd_bwd(stock, tokens)
    out_c, grads_c = _fwd_bwd(converted, tokens)

    assert out_c.dtype == out_s.dtype and out_c.shape == out_s.shape
    assert rel_err(out_c, out_s) < 1e-6
    assert grads_c.keys() == grads_s.keys()
    for n in grads_s:
        assert rel_err(grads_c[n], grads_s[n]) < 1e-5, n
    for (n, b_s), (_, b_c) in zip(stock.named_buffers(), converted.named_buffers()):
        assert torch.equal(b_s, b_c), n
    counts = converted.layers["0"].moe.tokens_per_expert
    assert counts.sum().item() == tokens.numel() * args.moe_args.top_k


def test_bf16_model_output_dtype_and_closeness():
    args = tiny_args()
    stock = build_stock(args, seed=2).to(torch.bfloat16)
    converted = build_converted(args, seed=2).to(torch.bfloat16)
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out_s, out_c = stock(tokens), converted(tokens)
    assert out_c.dtype == out_s.dtype == torch.bfloat16
    # Stock rounds each expert output to bf16 before combining; the op accumulates in fp32.
    assert rel_err(out_c, out_s) < 3e-2


def test_moe_block_calls_op_through_experts_call():
    # FSDP's unshard/reduce-scatter hooks sit on moe.experts.__call__; the op must run there.
    args = tiny_args(n_layers=1)
    model = build_converted(args)
    experts = model.layers["0"].moe.experts
    calls = []
    experts.register_forward_pre_hook(lambda mod, inp: calls.append(inp))
    x = torch.randn(2, 5, args.dim)
    model.layers["0"].moe(x)
    assert len(calls) == 1
    xs, ids, w = calls[0]
    assert xs.shape == (10, args.dim) and ids.shape == (10, 2)
    assert isinstance(w, KeepDtype) and w.tensor.dtype == torch.float32


def test_routing_weights_survive_fsdp_input_cast():
    # FSDP (mixed precision) casts every floating tensor argument of moe.experts to bf16;
    # stock applies fp32 routing weights outside the experts, so ours must stay fp32.
    from torch.distributed.utils import _apply_to_tensors

    x = torch.randn(3, 4)
    w = torch.rand(3, 2)
    cast = _apply_to_tensors(lambda t: t.to(torch.bfloat16), (x, KeepDtype(w)))
    assert cast[0].dtype == torch.bfloat16
    assert cast[1].tensor is w


# --------------------------------------------------------------------------- validation


def _meta_model(args=None):
    with torch.device("meta"):
        return Qwen3Model(args or tiny_args())


BAD_SETTINGS = [
    # (settings, exception, message): each [megamoe] field with a wrong value and a wrong type
    (dict(backend="cuda"), ValueError, r"\[megamoe\] backend='cuda' is not one of 'auto', "),
    (dict(backend="triton"), ValueError, r"backend='triton' is not one of"),  # former name
    (dict(backend=1), TypeError, r"backend=1 is an int, expected a str: one of 'auto'"),
    (dict(precision="fp16"), ValueError, r"precision='fp16' is not one of"),
    (dict(precision=None), TypeError, r"precision=None is a NoneType, expected a str"),
    (dict(precision="fp8", fp8_weight_cache="false"), TypeError,
     r"\[megamoe\] fp8_weight_cache='false' is a str, expected a bool \(true or false\)"),
    (dict(precision="fp8", fp8_weight_cache=1), TypeError,
     r"fp8_weight_cache=1 is an int, expected a bool"),
    (dict(save_activations="always"), ValueError, r"save_activations='always' is not one of"),
    (dict(save_activations="sometimes"), ValueError, r"'auto', 'keep', 'never'"),
    (dict(save_activations=True), TypeError, r"save_activations=True is a bool, expected a str"),
    (dict(max_tokens_per_rank=-1), ValueError, r"max_tokens_per_rank=-1 must be >= 0"),
    (dict(max_tokens_per_rank="lots"), TypeError,
     r"\[megamoe\] max_tokens_per_rank='lots' is a str, expected an int \(a count >= 0\)"),
    (dict(max_tokens_per_rank=1.5), TypeError,
     r"max_tokens_per_rank=1.5 is a float, expected an int"),
    (dict(max_tokens_per_rank=4096.0), TypeError, r"max_tokens_per_rank=4096.0 is a float"),
    (dict(max_tokens_per_rank=True), TypeError, r"max_tokens_per_rank=True is a bool"),
]


@pytest.mark.parametrize("settings, exc, match", BAD_SETTINGS)
def test_rejects_bad_settings(settings, exc, match):
    # raised when the section is built (TorchTitan builds it from the TOML while parsing)...
    with pytest.raises(exc, match=match):
        job_config(**settings)
    # ...and by the converter, for values assigned to a built section
    jc = job_config()
    for name, value in settings.items():
        setattr(jc.megamoe, name, value)
    with pytest.raises(exc, match=match):
        MegaMoEConverter(jc, None)


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value)  # a TOML string, integer or float alike


@pytest.mark.parametrize("settings, exc, match",
                         [b for b in BAD_SETTINGS if None not in b[0].values()])  # no TOML null
def test_bad_toml_values_fail_at_config_parse(settings, exc, match, tmp_path):
    """A new user's TOML, parsed by TorchTitan's ConfigManager: the error names the field, the
    value and the expected type before anything is built."""
    lines = ["[job]", 'custom_config_module = "torchtitan_megamoe.config"', "[megamoe]"]
    lines += [f"{name} = {_toml(value)}" for name, value in settings.items()]
    path = tmp_path / "bad.toml"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(exc, match=match):
        ConfigManager().parse_args(["--job.config_file", str(path)])


def test_cli_overrides_are_checked_like_the_toml():
    args = ["--job.custom_config_module", "torchtitan_megamoe.config", "--megamoe.precision",
            "fp8", "--megamoe.fp8_weight_cache", "--megamoe.max_tokens_per_rank", "4096"]
    jc = ConfigManager().parse_args(args)
    assert (jc.megamoe.fp8_weight_cache, jc.megamoe.max_tokens_per_rank) == (True, 4096)
    off = ConfigManager().parse_args(args[:4] + ["--megamoe.no_fp8_weight_cache"])
    assert off.megamoe.fp8_weight_cache is False
    with pytest.raises(SystemExit):  # tyro refuses a word for an int, naming the option
        ConfigManager().parse_args(args[:-1] + ["lots"])


@pytest.mark.parametrize("precision", ["fp8", "fp8_bwd"])
def test_fp8_accepted_on_the_hopper_kernels_and_under_ep(precision):
    MegaMoEConverter(job_config(precision=precision, backend="auto"), None)
    MegaMoEConverter(job_config(precision=precision, backend="hopper"), None)
    for ep in (2, 8):  # the exchange moves e4m3 rows (tests/hopper/test_ep_loopback.py)
        cfg = job_config(precision=precision, backend="hopper")
        cfg.parallelism.expert_parallel_degree = ep
        assert MegaMoEConverter(cfg, None).ep_degree == ep
    # the module-owned FP8 weights (the default) hold under FSDP and under autocast alike
    for shard, param_dtype in ((2, "bfloat16"), (1, "bfloat16"), (1, "float32")):
        cfg = job_config(precision=precision, fp8_weight_cache=True)
        cfg.parallelism.data_parallel_shard_degree = shard
        cfg.training.mixed_precision_param = param_dtype
        assert MegaMoEConverter(cfg, None).options.fp8_weight_cache


def test_settings_reach_the_backend_as_one_options_object(monkeypatch):
    """[megamoe] becomes one MegaMoEOptions at conversion, carried by every converted block
    and handed to the backend on each call: no process-wide state."""
    from torchtitan_megamoe.ops import reference

    jc = job_config(precision="fp8_bwd", save_activations="never", max_tokens_per_rank=4096,
                    fp8_weight_cache=False)
    converter = MegaMoEConverter(jc, None)
    expected = MegaMoEOptions(backend="reference", precision="fp8_bwd",
                              save_activations="never", max_tokens_per_rank=4096,
                              fp8_weight_cache=False)
    assert converter.options == expected
    args = tiny_args(dim=128, moe_inter_dim=128)
    with torch.device("meta"):
        model = Qwen3Model(args)
    converter.convert(model)
    assert all(b.moe.experts.options is converter.options for b in model.layers.values())
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    seen = []
    original = reference.forward
    monkeypatch.setattr(reference, "forward",
                        lambda *a, **k: seen.append(a[7]) or original(*a, **k))
    model(torch.randint(0, args.vocab_size, (1, 8)))
    assert seen == [expected] * args.n_layers


@pytest.mark.parametrize(
    "setting, ac_mode, ac_option, expected",
    [
        ("auto", "selective", "op", "never"),  # stock's per-op SAC keeps no expert activations
        ("auto", "selective", "2", "keep"),  # per-layer SAC: the layer is recomputed whole
        ("auto", "full", "op", "keep"),
        ("auto", "none", "op", "keep"),
        ("keep", "selective", "op", "keep"),  # explicit: memory for speed
        ("never", "full", "op", "never"),
    ],
)
def test_save_activations_auto_follows_activation_checkpointing(
        setting, ac_mode, ac_option, expected):
    jc = job_config(save_activations=setting)
    jc.activation_checkpoint.mode = ac_mode
    jc.activation_checkpoint.selective_ac_option = ac_option
    assert MegaMoEConverter(jc, None).options.save_activations == expected


@pytest.mark.parametrize(
    "degrees, match",
    [
        (dict(tensor_parallel_degree=2), r"tensor_parallel_degree=2 is not supported"),
        (
            dict(expert_parallel_degree=2, expert_tensor_parallel_degree=2),
            r"expert_tensor_parallel_degree=2 is not supported",
        ),
        (dict(pipeline_parallel_degree=2), r"pipeline_parallel_degree=2 is not supported"),
        (dict(context_parallel_degree=2), r"context_parallel_degree=2 is not supported"),
        (dict(expert_parallel_comm_backend="deepep"), r"'deepep' \(DeepEP MoE\)"),
    ],
)
def test_rejects_unsupported_parallelism(degrees, match):
    with pytest.raises(NotImplementedError, match=match):
        MegaMoEConverter(with_parallelism(job_config(), **degrees), None)


def test_rejects_grouped_mm_quantization_converter():
    jc = job_config(converters=("quantize.grouped_mm.float8", "megamoe"))
    with pytest.raises(NotImplementedError, match=r"'quantize.grouped_mm.float8'.*precision"):
        MegaMoEConverter(jc, None)


def test_parallel_dims_take_precedence_over_job_config():
    from torchtitan.distributed import ParallelDims

    pd = ParallelDims(
        dp_replicate=1, dp_shard=1, cp=1, tp=2, pp=1, ep=1, etp=1, world_size=2
    )
    with pytest.raises(NotImplementedError, match=r"tensor_parallel_degree=2"):
        MegaMoEConverter(job_config(), pd)


@pytest.mark.parametrize(
    "args, jc, exc, match",
    [
        (
            tiny_args(score_before_experts=True),
            job_config(),
            NotImplementedError,
            r"layers.0.moe' has score_before_experts=True.*score_before_experts=False",
        ),
        (
            tiny_args(),
            with_parallelism(job_config(), expert_parallel_degree=3),
            ValueError,
            r"num_experts=8 is not divisible by expert_parallel_degree=3",
        ),
        (
            tiny_args(moe_inter_dim=40),
            job_config(backend="hopper"),
            ValueError,
            r"backend='hopper' cannot run this shape: the hopper kernels need dim and hidden to "
            r"be multiples of (16|64) \(their narrowest tile\), got dim=64, hidden=40",
        ),
        (
            tiny_args(),
            job_config(precision="fp8"),
            ValueError,
            r"'layers.0.moe' \(dim=64, moe_inter_dim=32\): mega_moe: precision='fp8' uses "
            r"128-wide scaling blocks and needs dim and hidden % 128 == 0",
        ),
    ],
)
def test_rejects_unsupported_moe(args, jc, exc, match):
    model = _meta_model(args)
    with pytest.raises(exc, match=match):
        MegaMoEConverter(jc, None).convert(model)
    # Validation runs before any swap: a rejected model is left stock.
    assert all(type(b.moe) is MoE for b in model.layers.values())


def test_one_shape_rule_per_backend_and_recipe():
    """ops/shapes.py: an FP8 recipe's scale blocks on every backend, the hopper kernels' tiles
    on that backend only."""
    for recipe in RECIPES.values():
        for backend in ("hopper", "reference"):
            assert shape_error(2048, 768, recipe, backend) is None
            assert shape_error(4096, 1536, recipe, backend) is None
    m = hopper_multiple()
    bf16, fp8 = RECIPES["bf16"], RECIPES["fp8"]
    assert shape_error(m, 3 * m, bf16, "hopper") is None
    assert f"multiples of {m}" in shape_error(m, m + 8, bf16, "hopper")
    assert shape_error(m, m + 8, bf16, "reference") is None
    for backend in ("hopper", "reference"):
        assert "needs dim and hidden % 128 == 0" in shape_error(128, 192, fp8, backend)
    model = _meta_model(tiny_args(dim=128, moe_inter_dim=128))
    MegaMoEConverter(job_config(backend="hopper"), None).convert(model)
    assert all(type(b.moe) is MegaMoE for b in model.layers.values())


def test_rejects_non_grouped_experts():
    class MyExperts(GroupedExperts):
        pass

    model = _meta_model()
    old = model.layers["1"].moe.experts
    with torch.device("meta"):
        model.layers["1"].moe.experts = MyExperts(64, 32, 8, use_grouped_mm=False)
    with pytest.raises(NotImplementedError, match=r"layers.1.moe' has experts of type MyExperts"):
        MegaMoEConverter(job_config(), None).convert(model)
    assert type(model.layers["0"].moe) is MoE and old is not None


def test_rejects_moe_subclasses():
    class OtherMoE(MoE):  # e.g. DeepEPMoE
        pass

    model = _meta_model()
    with torch.device("meta"):
        model.layers["0"].moe = OtherMoE(tiny_args().moe_args, dim=64, hidden_dim=32)
    with pytest.raises(NotImplementedError, match=r"is a OtherMoE, not a stock torchtitan MoE"):
        MegaMoEConverter(job_config(), None).convert(model)


def test_rejects_dense_model_and_is_idempotent():
    dense = dataclasses.replace(tiny_args(), moe_enabled=False)
    with pytest.raises(ValueError, match=r"no torchtitan MoE blocks to convert"):
        MegaMoEConverter(job_config(), None).convert(_meta_model(dense))
    model = _meta_model()
    converter = MegaMoEConverter(job_config(), None)
    converter.convert(model)
    first = [b.moe for b in model.layers.values()]
    converter.convert(model)
    assert [b.moe for b in model.layers.values()] == first


def test_megamoe_direct_construction_rejects_score_before_experts():
    with pytest.raises(ValueError, match=r"score_before_experts=True is not supported"):
        MegaMoE(tiny_args(score_before_experts=True).moe_args, dim=64, hidden_dim=32)
    moe = MegaMoE(tiny_args().moe_args, dim=64, hidden_dim=32,
                  options=MegaMoEOptions(backend="reference"))
    assert moe.experts.options.backend == "reference"
    assert isinstance(moe.experts, MegaExperts) and not hasattr(moe, "reorderer")


# --------------------------------------------------------------------------- TorchTitan hooks


def test_sac_save_list_and_ep_routing_installed():
    import torchtitan.models.llama4.infra.parallelize as llama4_par
    import torchtitan.models.qwen3.infra.parallelize as qwen3_par

    MegaMoEConverter(job_config(), None).convert(_meta_model())
    op = torch.ops.megamoe.mega_moe.default
    assert op in qwen3_par._op_sac_save_list
    assert op in llama4_par._op_sac_save_list
    wrapped = qwen3_par.apply_moe_ep_tp
    assert hasattr(wrapped, "_megamoe_stock")
    # Idempotent: a second install neither re-wraps nor reports anything patched.
    assert install_ep_routing() == []
    assert qwen3_par.apply_moe_ep_tp is wrapped
    assert not hasattr(wrapped._megamoe_stock, "_megamoe_stock")


def test_ep_routing_rejects_tp_for_converted_blocks():
    import torchtitan.models.qwen3.infra.parallelize as qwen3_par

    model = _meta_model()
    MegaMoEConverter(job_config(), None).convert(model)
    with pytest.raises(NotImplementedError, match=r"tensor parallelism / expert tensor"):
        qwen3_par.apply_moe_ep_tp(
            model, tp_mesh=object(), ep_mesh=None, etp_mesh=None, ep_etp_mesh=None
        )


def test_stock_apply_compile_wraps_router_not_experts(monkeypatch):
    from torchtitan.config.job_config import Compile
    from torchtitan.models.llama4.infra.parallelize import apply_compile
    from torchtitan.models.moe import moe as moe_module

    # apply_compile patches these process-wide; restore them for the tests that follow.
    monkeypatch.setattr(moe_module, "_run_experts_grouped_mm", moe_module._run_experts_grouped_mm)
    monkeypatch.setattr(torch._dynamo.config, "capture_scalar_outputs", False)

    args = tiny_args(num_shared_experts=1)
    converted = build_converted(args, seed=0)
    reference = build_converted(args, seed=0)
    apply_compile(converted, Compile(enable=True, backend="eager"), ep_enabled=False)
    moe = converted.layers["0"].moe
    assert isinstance(moe.router, torch._dynamo.eval_frame.OptimizedModule)
    assert isinstance(moe.shared_experts, torch._dynamo.eval_frame.OptimizedModule)
    assert type(moe.experts) is MegaExperts  # left eager: FSDP hooks live on its __call__
    tokens = torch.randint(0, args.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel_err(converted(tokens), reference(tokens)) < 1e-6



@pytest.mark.parametrize("saved", [True, False])
def test_per_op_sac_saves_the_fused_op(saved, monkeypatch, tmp_path):
    # With the op on the save list, the checkpointed recompute must not run it again (with EP
    # that would repeat its communication); without it, it is recomputed (the check can fail).
    import torchtitan.models.qwen3.infra.parallelize as qwen3_par
    from torchtitan.config.job_config import ActivationCheckpoint
    from torchtitan.distributed.activation_checkpoint import apply_ac
    from torchtitan_megamoe.ops import reference

    args = tiny_args()
    model = build_converted(args, seed=0)
    save_list = set(qwen3_par._op_sac_save_list)
    op = torch.ops.megamoe.mega_moe.default
    assert op in save_list
    if not saved:
        save_list.discard(op)
    apply_ac(
        model,
        ActivationCheckpoint(mode="selective", selective_ac_option="op"),
        model_compile_enabled=False,
        op_sac_save_list=save_list,
        base_folder=str(tmp_path),
    )
    calls = []
    original = reference.forward
    monkeypatch.setattr(
        reference, "forward", lambda *a, **k: calls.append(1) or original(*a, **k)
    )
    tokens = torch.randint(0, args.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    out = model(tokens)
    assert len(calls) == args.n_layers
    out.float().pow(2).mean().backward()
    assert len(calls) == (args.n_layers if saved else 2 * args.n_layers)

# --------------------------------------------------------------------------- EP=2 (gloo, 2 ranks)
# Workers run under torch.multiprocessing.spawn (gloo, CPU). Each raises on a mismatch, which
# spawn re-raises in the test process.


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out = {}
    for n, p in model.named_parameters():
        g = p.grad
        out[n] = g.full_tensor() if isinstance(g, DTensor) else g
    return out


def _check_close(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    err = rel_err(got, want)
    if not err < tol:
        raise AssertionError(f"{name}: relative error {err:.3e} >= {tol:.0e}")


def _ep_worker_experts_only(rank: int, world: int, init_file: str) -> None:
    """Stock EP (ExpertParallel, all-to-all hooks) vs converted EP (MegaExpertParallel + op with
    the ep group), both applied through the (wrapped) stock ``apply_moe_ep_tp``; no FSDP."""
    import torch.distributed as dist
    import torchtitan.models.moe.utils as moe_utils
    import torchtitan.models.qwen3.infra.parallelize as qwen3_par
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from torchtitan_megamoe.moe import MegaExperts

    init_gloo(rank, world, init_file)
    # Stock EP builds its permutation with a Triton kernel unless told to use the CPU version.
    original = moe_utils.generate_permute_indices
    moe_utils.generate_permute_indices = lambda *a, **k: original(*a, **{**k, "use_cpu": True})
    try:
        with cpu_histc():
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
            args = tiny_args(num_shared_experts=1)
            full = build_stock(args, seed=0)  # same weights on every rank
            stock = build_stock(args, seed=0)
            jc = with_parallelism(job_config(), expert_parallel_degree=world)
            converted = build_converted(args, seed=0, jc=jc)
            for model in (stock, converted):
                qwen3_par.apply_moe_ep_tp(
                    model, tp_mesh=None, ep_mesh=mesh, etp_mesh=None, ep_etp_mesh=None,
                    dual_pipe_v=False,
                )
            experts = converted.layers["0"].moe.experts
            assert isinstance(experts, MegaExperts)
            assert isinstance(experts.w1, DTensor) and experts.w1.placements == (Shard(0),)
            assert experts.w1.to_local().shape[0] == args.moe_args.num_experts // world
            # No dispatch hooks on ours; stock's ExpertParallel installed its all-to-all hooks.
            assert not experts._forward_pre_hooks and not experts._forward_hooks
            assert stock.layers["0"].moe.experts._forward_pre_hooks

            gen = torch.Generator().manual_seed(100 + rank)  # different tokens per rank
            tokens = torch.randint(0, args.vocab_size, (2, 16), generator=gen)
            gout = torch.randn(2, 16, args.vocab_size, generator=gen)
            outs = {}
            for name, model in (("full", full), ("stock", stock), ("converted", converted)):
                out = model(tokens)
                (out * gout).sum().backward()
                outs[name] = (out.detach(), _grads(model))
            _check_close("stock EP vs single-rank output", outs["stock"][0], outs["full"][0], 1e-6)
            _check_close(
                "converted EP vs stock EP output", outs["converted"][0], outs["stock"][0], 1e-6
            )
            g_s, g_c = outs["stock"][1], outs["converted"][1]
            assert g_s.keys() == g_c.keys()
            for n in g_s:
                _check_close(f"grad {n}", g_c[n], g_s[n], 1e-5)
            for n, b in stock.named_buffers():
                assert torch.equal(b, dict(converted.named_buffers())[n]), n
    finally:
        moe_utils.generate_permute_indices = original
        dist.destroy_process_group()


def _ep_worker_parallelize_qwen3(rank: int, world: int, init_file: str) -> None:
    """TorchTitan's own path: meta build -> (convert) -> parallelize_qwen3 with EP=2 + FSDP +
    activation checkpointing -> to_empty -> load the same full weights; stock vs converted loss and
    gradients on one step. A fused op that bypassed moe.experts.__call__ (FSDP's unshard hook)
    or mis-assigned expert shards would show here."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, StateDictOptions

    import torchtitan_megamoe.cpu as cpu
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.qwen3 import parallelize_qwen3

    cpu.apply()  # this process only: device type cpu, histc, permute indices, gloo FSDP sums
    init_gloo(rank, world, init_file)
    try:
        pd = ParallelDims(
            dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=world, etp=1, world_size=world
        )
        pd.build_mesh()
        args = tiny_args()
        full_sd = build_stock(args, seed=0).state_dict()

        def build(convert: bool):
            jc = job_config(converters=("megamoe",) if convert else ())
            jc.parallelism = dataclasses.replace(jc.parallelism, expert_parallel_degree=world)
            jc.training = dataclasses.replace(
                jc.training, seq_len=16, mixed_precision_param="float32"
            )
            # Converted: per-op SAC, with the fused op on the save list (not recomputed). Stock:
            # full AC (same numerics), because stock + per-op SAC + EP + FSDP trips torch
            # 2.13's SAC recompute check ("record_function_enter_new invocation index ... not
            # found in storage": FSDP's hooks on moe.experts run more record_function ops in
            # the recompute than in the forward). Ours trips it too when shared experts
            # follow the routed experts, hence Qwen3's num_shared_experts=0 here.
            ac = dict(mode="selective", selective_ac_option="op") if convert else dict(mode="full")
            jc.activation_checkpoint = dataclasses.replace(jc.activation_checkpoint, **ac)
            with torch.device("meta"):
                model = Qwen3Model(copy.deepcopy(args))
            if convert:
                MegaMoEConverter(jc, pd).convert(model)
            model = parallelize_qwen3(model, pd, jc)
            model.to_empty(device="cpu")
            with torch.no_grad():
                model.init_weights(buffer_device=torch.device("cpu"))
            set_model_state_dict(model, full_sd, options=StateDictOptions(full_state_dict=True))
            return model

        stock, converted = build(False), build(True)
        assert any(isinstance(m, MegaExperts) for m in converted.modules())

        gen = torch.Generator().manual_seed(200 + rank)
        tokens = torch.randint(0, args.vocab_size, (2, 16), generator=gen)
        labels = torch.randint(0, args.vocab_size, (2, 16), generator=gen)
        results = {}
        for name, model in (("stock", stock), ("converted", converted)):
            logits = model(tokens)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
            loss.backward()
            results[name] = (loss.detach(), _grads(model))
        _check_close("loss", results["converted"][0], results["stock"][0], 1e-6)
        g_s, g_c = results["stock"][1], results["converted"][1]
        assert g_s.keys() == g_c.keys()
        for n in g_s:
            _check_close(f"grad {n}", g_c[n], g_s[n], 1e-5)
    finally:
        dist.destroy_process_group()


def _ep_worker(rank: int, world: int, init_file: str, result_file: str) -> None:
    """Both EP checks in one spawn (process start-up and imports dominate their cost); the
    second applies the process-wide CPU shims, so it runs last. A saved result marks a rank
    that finished them (gloo may abort a process in its teardown after that: run_ranks)."""
    _ep_worker_experts_only(rank, world, init_file)
    _ep_worker_parallelize_qwen3(rank, world, init_file + ".2")
    torch.save(True, f"{result_file}.{rank}")


def test_ep2_matches_stock_ep2():
    """Two gloo ranks, EP=2: (1) stock apply_moe_ep_tp (ExpertParallel) vs converted
    (MegaExpertParallel + the op with the ep group), outputs and gradients, plus stock EP vs the
    single-rank model; (2) TorchTitan's parallelize_qwen3 with EP=2 + FSDP + AC (per-op SAC for
    ours), stock vs converted loss and gradients (see _ep_worker*)."""
    from moe_testing import run_ranks

    assert run_ranks(_ep_worker, 2, 2) == [True, True]
