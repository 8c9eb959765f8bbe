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


def test_pipeline_by_hand():
    # 8 regions of 0.25 ms; 7 sends of 1/7 ms all arrive before their region is due; the
    # returns queue behind the sends (side stream free at 1 ms), the last ends 1/7 after the
    # compute
    assert ep_model.pipeline(2.0, 1.0, 1.0, 8) == pytest.approx(2.0 + 1 / 7)
    # sends slower than the regions: region k waits for its rows (k * 0.5 ms), the compute
    # ends at 7 * 0.5 + 0.25
    assert ep_model.pipeline(2.0, 3.5, 0.0, 8) == pytest.approx(3.75)
    # EP=2: one peer region after the own one
    assert ep_model.pipeline(2.0, 0.5, 0.5, 2) == pytest.approx(2.0 + 0.5)
    # the backward's: each region's dx goes home before its last quarter (wgrad_dw13): the
    # last return starts at 2.0 - 0.25 * 0.25 and ends 1/7 later
    assert ep_model.pipeline(2.0, 1.0, 1.0, 8, tail=0.25) == pytest.approx(2.0 - 1 / 16 + 1 / 7)
    # returns slower than that: the side stream is the bottleneck either way
    assert ep_model.pipeline(2.0, 1.0, 7.0, 8, tail=0.25) == pytest.approx(
        ep_model.pipeline(2.0, 1.0, 7.0, 8))


def test_predict_runs_forward_and_backward_pipelines():
    p = ep_model.predict(_result("bf16"))
    assert p["fwd_no_overlap_ms"] == pytest.approx(4.0)
    assert p["fwd_overlap_ms"] == pytest.approx(ep_model.pipeline(2.0, 1.0, 1.0, 8))
    assert p["fwdbwd_no_overlap_ms"] == pytest.approx(11.0)
    assert p["fwdbwd_overlap_ms"] == pytest.approx(p["fwd_overlap_ms"]
                                                   + ep_model.pipeline(4.0, 2.0, 1.0, 8,
                                                                       tail=0.25))
    assert p["overlap_vs_compute"] == pytest.approx(p["fwdbwd_overlap_ms"] / 6.0)


def test_cli_prints_the_model_labelled_as_one(tmp_path, capsys):
    path = tmp_path / "lb.json"
    paced = dict(_result("fp8"), link_gbs=326.0)
    path.write_text(json.dumps({"results": [_result("bf16"), _result("fp8"), paced]}))
    assert ep_model.main(["--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Modelled per-GPU layer time at EP=R")
    assert "| Qwen3-30B-A3B | fp8 | 8 | 2.00 / 6.00 | 5.00 |" in out
    assert "30B layer forward 3.9 ms" in out
    # a paced run is a measurement: listed, not modelled again
    assert out.count("| Qwen3-30B-A3B | fp8 | 8 |") == 1
    assert "measured with the link emulated at 326 GB/s (Qwen3-30B-A3B, fp8, EP=8)" in out


def test_predict_takes_the_device_busy_time_where_measured():
    # the loopback's waited time is host-bound (one process issues R ranks): the GPU busy
    # time per rank is the compute
    r = dict(_result("bf16"), per_rank_fwd_busy_ms=1.0, per_rank_fwdbwd_busy_ms=3.0)
    p = ep_model.predict(r)
    assert p["compute_fwd_ms"] == 1.0 and p["compute_fwdbwd_ms"] == 3.0
    assert p["fwd_no_overlap_ms"] == pytest.approx(3.0)


def test_predict_with_the_ep1_compute_leaves_the_ep_machinery_out():
    r = dict(_result("fp8"), ep1_fwd_ms=8.0, ep1_fwdbwd_ms=24.0)  # on R*T tokens: / R
    p = ep_model.predict(r, compute="ep1")
    assert p["compute_fwd_ms"] == 1.0 and p["compute_fwdbwd_ms"] == 3.0
    assert ep_model.rank_compute(_result("fp8"), "fwd", "ep1") is None  # no EP=1 run in it
