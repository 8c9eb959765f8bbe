"""bench/ep_model.py: the modelled per-GPU EP layer time from a loopback result, by hand."""

import json

import pytest

from torchtitan_megamoe.bench import ep_model

MB326 = 326e6  # 1 ms at the default 326 GB/s


def _result(precision):
    return {"shape": "Qwen3-30B-A3B", "ep": 8, "loopback": True, "precision": precision,
            "per_rank_fwd_ms": 2.0, "per_rank_fwdbwd_ms": 6.0,
            "bytes": {"dispatch": MB326, "dispatch meta": 0, "combine": MB326,
                      "dispatch dy": MB326, "dispatch x": MB326, "return dx": MB326}}


def test_predict_adds_only_what_the_compute_beside_a_transfer_cannot_hide():
    p = ep_model.predict(_result("bf16"))
    # forward (2 ms, 0.25 per region): dispatch 1 ms under the own region (0.25 hidden); the
    # combine's 7 regions of 1/7 ms each under the next region's 0.25 ms (hidden), the last
    # one exposed
    assert p["fwd_no_overlap_ms"] == pytest.approx(4.0)
    assert p["fwd_overlap_ms"] == pytest.approx(2.0 + 0.75 + 1 / 7)
    # backward (4 ms, 0.5 per region): dy + x 2 ms under the own region (0.5 hidden); dx's
    # regions hidden but the last
    assert p["fwdbwd_no_overlap_ms"] == pytest.approx(11.0)
    assert p["fwdbwd_overlap_ms"] == pytest.approx(p["fwd_overlap_ms"] + 4.0 + 1.5 + 1 / 7)
    assert p["overlap_vs_compute"] == pytest.approx(p["fwdbwd_overlap_ms"] / 6.0)
    # a return slower than the regions beside it shows its excess per region
    slow = dict(_result("bf16"), per_rank_fwd_ms=0.8)
    each = 1 / 7
    assert ep_model.predict(slow)["fwd_overlap_ms"] == pytest.approx(
        0.8 + (1 - 0.1) + 6 * (each - 0.1) + each)


def test_cli_prints_the_model_labelled_as_one(tmp_path, capsys):
    path = tmp_path / "lb.json"
    path.write_text(json.dumps({"results": [_result("bf16"), _result("fp8")]}))
    assert ep_model.main(["--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Modelled per-GPU layer time at EP=R")
    assert "| Qwen3-30B-A3B | fp8 | 8 | 2.00 / 6.00 | 5.00 |" in out
    assert "30B layer forward 3.9 ms" in out
