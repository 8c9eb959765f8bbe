"""Checkpoints move freely between stock and converted models (README, "Using it in a
TorchTitan config").

Both directions, three ways: a plain ``state_dict`` with ``strict=True``, a
``torch.distributed.checkpoint`` save/load (what TorchTitan's checkpointer does), and the Qwen3
HF state-dict adapter (what HF import/export goes through). After each load the two models must
compute the same function.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from torchtitan.models.qwen3 import Qwen3StateDictAdapter

from moe_testing import build_converted, build_stock, cpu_histc, rel_err, tiny_args


@pytest.fixture(autouse=True)
def _histc():
    with cpu_histc():
        yield


ARGS = tiny_args(num_shared_experts=1)


def _tokens():
    return torch.randint(0, ARGS.vocab_size, (2, 16), generator=torch.Generator().manual_seed(9))


def _same_function(a, b):
    with torch.no_grad():
        return rel_err(a(_tokens()), b(_tokens())) < 1e-6


def _perturb_buffers(model):
    # Non-trivial persistent buffer values, so a load that skipped them would be visible.
    for block in model.layers.values():
        torch.nn.init.uniform_(block.moe.expert_bias, -0.3, 0.3)


def _directions():
    # (source builder, destination builder); source seed 1, destination seed 2 (differs).
    return {
        "stock_to_converted": (build_stock, build_converted),
        "converted_to_stock": (build_converted, build_stock),
    }


@pytest.mark.parametrize("direction", sorted(_directions()))
def test_state_dict_strict_load(direction):
    make_src, make_dst = _directions()[direction]
    src, dst = make_src(ARGS, seed=1), make_dst(ARGS, seed=2)
    _perturb_buffers(src)
    assert not _same_function(src, dst)
    result = dst.load_state_dict(src.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert _same_function(src, dst)


@pytest.mark.parametrize("direction", sorted(_directions()))
def test_dcp_save_load(direction, tmp_path):
    make_src, make_dst = _directions()[direction]
    src, dst = make_src(ARGS, seed=1), make_dst(ARGS, seed=2)
    _perturb_buffers(src)
    dcp.save(src.state_dict(), checkpoint_id=str(tmp_path))
    state = dst.state_dict()
    dcp.load(state, checkpoint_id=str(tmp_path))
    dst.load_state_dict(state, strict=True)
    assert _same_function(src, dst)


@pytest.mark.parametrize("direction", sorted(_directions()))
def test_hf_adapter_round_trip(direction):
    # HF Qwen3-MoE has no shared experts, and neither has the adapter's key map.
    args = tiny_args()
    make_src, make_dst = _directions()[direction]
    src, dst = make_src(args, seed=1), make_dst(args, seed=2)
    adapter = Qwen3StateDictAdapter(args, hf_assets_path=None)
    hf = adapter.to_hf(src.state_dict())
    # The HF key set does not depend on which side produced it.
    assert sorted(hf) == sorted(adapter.to_hf(dst.state_dict()))
    native = adapter.from_hf(hf)
    # The adapter does not carry expert_bias (HF Qwen3 has none); load it beside the weights.
    missing = set(dst.state_dict()) - set(native)
    assert missing and all(k.endswith("moe.expert_bias") for k in missing), missing
    dst.load_state_dict(native, strict=False)
    assert _same_function(src, dst)
