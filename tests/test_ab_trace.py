"""torchtitan_megamoe.ab.trace on a small hand-written Chrome trace: categories by kernel name
(ours before the dense-GEMM pattern), the step window, the union of overlapping kernels."""

import json

import pytest

from torchtitan_megamoe.ab import trace


def _kernel(name, ts, dur, stream=7):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "tid": stream}


TRACE = {"traceEvents": [
    {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "ts": 0, "dur": 900},
    {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#2", "ts": -1000, "dur": 900},
    _kernel("void megamoe::grouped::grouped_gemm_kernel<1, 1>(...)", 100, 200),
    _kernel("_wgrad_kernel", 300, 100),
    _kernel("flash_fwd_kernel", 400, 150),
    _kernel("ncclDevKernel_ReduceScatter_Sum_f32", 450, 300, stream=9),  # overlaps the attention
    _kernel("sm90_xmma_gemm_bf16bf16_bf16f32", 800, 250),  # runs past the step's CPU span
    _kernel("triton_poi_fused_add_0", 1050, 10),
    _kernel("_wgrad_kernel", -900, 50),  # the step before: not counted
    {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 10, "dur": 5},
]}


def test_categories_step_window_and_union():
    p = trace.summarize(TRACE)
    assert p.by_category == {
        "NCCL": 0.3, "dense GEMMs": 0.25, "megamoe sm90 GEMMs": 0.2, "attention": 0.15,
        "megamoe Triton kernels": 0.1, "torch.compile Triton kernels": 0.01}
    assert abs(p.step_ms - 1.06) < 1e-9  # from the step's start to the last kernel's end
    # busy: [100, 750) and [800, 1060): the overlapping NCCL kernel counts once
    assert abs(p.busy_ms - (0.65 + 0.26)) < 1e-9
    assert p.top[0] == ("ncclDevKernel_ReduceScatter_Sum_f32", 1, 0.3)
    assert trace.category("_topk_gate_bwd_kernel") == "megamoe Triton kernels"
    # every kernel of ours by its name, not by the dense-GEMM or copy patterns it may match
    for name in ("_quant_weight_kernel", "_fp8_wgrad_kernel", "_sum_partials_kernel"):
        assert trace.category(name) == "megamoe Triton kernels", name
    # the EP exchange's row copies are the link's transfers
    assert trace.category("_copy_rows_kernel") == "copies and fills"
    assert trace.category("void megamoe::fp8::fp8_gemm_kernel<1>(CUtensorMap_st, ...)") == \
        "megamoe sm90 GEMMs"
    assert trace.category("void deep_gemm::sm90_fp8_gemm_1d2d_impl<0u, 128u>(...)") == \
        "DeepGEMM (FP8 GEMMs)"
    assert trace.category("cutlass_grouped_mm_kernel") == "grouped GEMMs (stock experts)"
    assert trace.category("_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9x"
                          "INS_4gemm6kernel13GemmUniversalINS5_16GroupProblemShapeE") == \
        "grouped GEMMs (stock experts)"
    assert trace.category("unrelated") == "other"
    assert trace.category("c10d::symmetric_memory::barrier_kernel(unsigned int**, int)") == \
        "symmetric-memory barriers (EP sync)"
    assert trace.category("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<"
                          ">") == "optimizer (multi-tensor apply)"
    assert trace.category("void at::native::detail::chunk_cat_cuda_kernel<float>") == \
        "FSDP packing (chunk_cat, split)"


def test_report_and_cli(tmp_path, capsys):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(TRACE))
    assert trace.main([f"stock={path}", f"megamoe={path}"]) == 0
    out = capsys.readouterr().out
    assert "| step wall ms | 1.1 | 1.1 |" in out and "| NCCL (summed kernel ms) | 0.3 | 0.3 |" in out
    assert "Top kernels, megamoe:" in out
    assert trace.main([str(path)]) == 2  # not name=path


def test_profile_args_and_missing_traces(tmp_path):
    assert trace.profile_args(8) == ["--profiling.enable_profiling", "--profiling.profile_freq",
                                     "8"]
    with pytest.raises(ValueError, match=">= 4"):
        trace.profile_args(3)
    assert "No trace" in trace.ab_profile(str(tmp_path), 8)


def test_run_ab_with_a_profiled_step(tmp_path, monkeypatch):
    """run_ab(profile_step=N) passes the profiler arguments to both runs and appends the two
    traces' comparison to report.md and profile.md (runs faked: TorchTitan's profiler needs a
    GPU)."""
    from torchtitan_megamoe.ab import driver
    from moe_testing import fake_ab_run

    seen = []
    trace = {"profile_traces/iteration_5/rank0_trace.json": json.dumps(TRACE).encode()}
    monkeypatch.setattr(driver, "run_one", fake_ab_run(seen, trace))
    res = driver.run_ab("train_configs/qwen3_moe_tiny_cpu.toml", 1, str(tmp_path / "ab"),
                        ["--training.steps", "5"], profile_step=5)
    assert res.exit_code == 0
    assert all(c[-3:] == ["--profiling.enable_profiling", "--profiling.profile_freq", "5"]
               for c in seen) and len(seen) == 2
    report = (tmp_path / "ab" / "report.md").read_text()
    assert "## Where step 5's GPU time goes" in report and "| NCCL (summed kernel ms) |" in report
    assert (tmp_path / "ab" / "profile.md").read_text() in report


def test_idle_gaps_are_charged_to_the_host_op_that_issued_the_next_kernel():
    """Two gaps: one ended by a kernel the megamoe op launched late (its innermost op
    aten::empty, its outermost the op), one during which a cudaFree held the host."""
    def kernel(name, ts, dur, corr):
        return {**_kernel(name, ts, dur), "args": {"correlation": corr}}

    def call(name, ts, dur, corr=None, tid=1):
        return {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts, "dur": dur,
                "tid": tid, "args": {} if corr is None else {"correlation": corr}}

    def op(name, ts, dur, tid=1):
        return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": tid}

    t = {"traceEvents": [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#4", "ts": 0, "dur": 1000},
        kernel("a", 0, 100, 1), kernel("b", 300, 100, 2), kernel("c", 400, 50, 3),
        kernel("d", 900, 100, 4),
        call("cudaLaunchKernel", 0, 2, 1), call("cudaLaunchKernel", 290, 5, 2),
        call("cudaLaunchKernel", 295, 5, 3), call("cudaLaunchKernel", 880, 5, 4),
        call("cudaFree", 500, 300),
        op("megamoe::mega_moe", 50, 300), op("aten::empty", 280, 20),
        op("Optimizer.step", 450, 500), op("aten::_foreach_add_", 870, 30),
        op("aten::mm", 290, 5, tid=2),  # another thread: not around the launch
    ]}
    p = trace.summarize(t)
    assert abs(p.step_ms - p.busy_ms - 0.65) < 1e-9  # gaps [100, 300) and [450, 900)
    assert p.idle_inner == [("aten::_foreach_add_", 1, 0.45), ("aten::empty", 1, 0.2)]
    assert p.idle_outer == [("Optimizer.step", 1, 0.45), ("megamoe::mega_moe", 1, 0.2)]
    assert p.blocking == [("cudaFree", 1, 0.3)]  # [500, 800) lies in the second gap
    assert p.launch_us == 5  # the median of the step's launch calls (2, 5, 5, 5)
    text = trace.report({"x": p})
    assert "| GPU idle ms (no kernel running) | 0.7 |" in text
    assert "| kernel launch call, median µs (the host's speed) | 5.0 |" in text
    assert "| `aten::empty` | 1 | 0.20 |" in text and "| `cudaFree` | 1 | 0.30 |" in text
