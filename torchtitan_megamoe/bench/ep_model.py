"""What EP=R on a real node would cost per GPU, MODELLED from a loopback run (bench/ep_loopback.py):
its per-rank compute and its counted bytes per transfer, with the NVLink bandwidth measured on a
2-GPU H200 host (326 GB/s per direction for SM stores into symmetric memory).

    python -m torchtitan_megamoe.bench.ep_model --json loopback.json [--bw-gbs 326]
        [--compute loopback|ep1]

Per transfer, time = bytes / bandwidth. Without overlap a layer's time is its compute plus every
transfer. With the overlap as built (ep_forward.py, ep_backward.py) the forward and the backward
each run as a pipeline (``pipeline``): the own region computes first (at uniform routing each
region is 1/R of the compute); the sends go peer after peer on the side stream (1/(R-1) of the
bytes each) and region k computes once its rows arrived and region k-1 is done; each peer
region's returned rows queue on the same side stream after the sends, in the forward once the
region is done, in the backward once its dx is (before its wgrad_dw13, ``BWD_DX_TAIL``). Every
number this prints is a model, not a measurement of an 8-GPU node.
"""

from __future__ import annotations

import argparse
import json

NVLINK_GBS = 326.0
"""GB/s per direction, SM stores into a peer's symmetric memory, 2x H200 NV18 (measured)."""

REFERENCE_EP8 = {"30b fwd": 3.9, "235b bwd": 24.6}
"""The reference system's per-GPU layer times at EP=8, FP8, 16K tokens per GPU (ms)."""


BWD_DX_TAIL = 0.25
"""The part of a region's backward that runs after its dx is ready: wgrad_dw13, 4 of the 16
R·D·H flop units of a region whose GEMM 1 is recomputed (EP >= 4 keeps no pre-activations;
4 of 12 where they were kept)."""


def pipeline(compute: float, sent: float, returned: float, R: int, tail: float = 0.0) -> float:
    """End time (ms) of one pass: R regions of compute / R each, the own first; the sends
    (``sent`` ms in all, peer after peer) and then each peer region's returned rows
    (``returned`` ms in all) on one side stream, each once its region's compute is done but
    its last ``tail`` part."""
    c, step, back = compute / R, sent / (R - 1), returned / (R - 1)
    t = c  # the own region: its rows are home
    side = sent  # the sends were queued first
    for k in range(1, R):
        t = max(t, k * step) + c  # region k: its rows arrived, region k-1 done
        side = max(side, t - tail * c) + back  # its partial rows go home
    return max(t, side)


COMPUTE = ("loopback", "ep1")
"""Where a rank's compute comes from: ``loopback``, the loopback run's device busy time / R
(its waited time / R where busy was not measured: host-bound, an upper bound); ``ep1``, ours at
EP=1 on the same R*T tokens / R (the EP machinery's own compute left out: a lower bound)."""


def rank_compute(res: dict, tag: str, compute: str = "loopback") -> float | None:
    """ms of a rank's compute for pass ``tag`` ("fwd" or "fwdbwd"), per ``compute``."""
    R = res["ep"]
    if compute == "ep1":
        ep1 = res.get(f"ep1_{tag}_ms")
        return None if ep1 is None else ep1 / R
    return res.get(f"per_rank_{tag}_busy_ms") or res.get(f"per_rank_{tag}_ms")


def predict(res: dict, bw_gbs: float = NVLINK_GBS, compute: str = "loopback") -> dict:
    """The modelled per-GPU times (ms) of one loopback result: compute (``compute``: see
    COMPUTE), each transfer, and the forward / forward + backward without and with the built
    overlap."""
    R = res["ep"]
    fwd = rank_compute(res, "fwd", compute)
    fb = rank_compute(res, "fwdbwd", compute)
    per = {t: b / (bw_gbs * 1e6) for t, b in res["bytes"].items()}  # bytes -> ms

    def moved(t):  # token rows and their metadata
        return per.get(t, 0.0) + per.get(f"{t} meta", 0.0)

    fwd_overlap = pipeline(fwd, moved("dispatch"), moved("combine"), R)
    out = {"compute_fwd_ms": fwd, "transfer_ms": {t: moved(t) for t in
                                                   ("dispatch", "combine", "dispatch dy",
                                                    "dispatch x", "return dx") if t in per},
           "fwd_no_overlap_ms": fwd + moved("dispatch") + moved("combine"),
           "fwd_overlap_ms": fwd_overlap}
    if fb is not None:
        bwd = fb - fwd
        bwd_overlap = pipeline(bwd, moved("dispatch dy") + moved("dispatch x"),
                               moved("return dx"), R, tail=BWD_DX_TAIL)
        out.update(compute_fwdbwd_ms=fb,
                   fwdbwd_no_overlap_ms=fb + sum(out["transfer_ms"].values()),
                   fwdbwd_overlap_ms=fwd_overlap + bwd_overlap)
        out["overlap_vs_compute"] = out["fwdbwd_overlap_ms"] / fb
    return out


def model_table(results: list[dict], bw_gbs: float = NVLINK_GBS, compute: str = "loopback") -> str:
    source = {"loopback": "the loopback run's device busy time per rank",
              "ep1": "ours at EP=1 on the same tokens, per rank"}[compute]
    lines = [f"Modelled per-GPU layer time at EP=R on a node (NVLink {bw_gbs:.0f} GB/s per "
             f"direction; bytes from the loopback run, compute: {source}):", "",
             "| shape | precision | EP | compute fwd / fwd+bwd ms | transfers ms | fwd no overlap "
             "/ overlap ms | fwd+bwd no overlap / overlap ms | overlap / compute |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    paced = [r for r in results if r.get("link_gbs")]
    for r in results:
        if r.get("link_gbs"):
            continue  # its times include the emulated link already: listed below
        p = predict(r, bw_gbs, compute)
        fb = p.get("compute_fwdbwd_ms")
        lines.append(
            f"| {r['shape']} | {r.get('precision', 'bf16')} | {r['ep']} | "
            f"{p['compute_fwd_ms']:.2f} / {fb:.2f} | {sum(p['transfer_ms'].values()):.2f} | "
            f"{p['fwd_no_overlap_ms']:.2f} / {p['fwd_overlap_ms']:.2f} | "
            f"{p['fwdbwd_no_overlap_ms']:.2f} / {p['fwdbwd_overlap_ms']:.2f} | "
            f"{p['overlap_vs_compute']:.2f} |" if fb is not None else
            f"| {r['shape']} | {r.get('precision', 'bf16')} | {r['ep']} | "
            f"{p['compute_fwd_ms']:.2f} / - | {sum(p['transfer_ms'].values()):.2f} | "
            f"{p['fwd_no_overlap_ms']:.2f} / {p['fwd_overlap_ms']:.2f} | - | - |")
    for r in paced:
        lines.append(f"- measured with the link emulated at {r['link_gbs']:.0f} GB/s "
                     f"({r['shape']}, {r.get('precision', 'bf16')}, EP={r['ep']}): per rank fwd "
                     f"{r['per_rank_fwd_ms']:.2f} ms" + (
                         f", fwd+bwd {r['per_rank_fwdbwd_ms']:.2f} ms"
                         if "per_rank_fwdbwd_ms" in r else ""))
    lines += ["", "Reference system, EP=8, FP8, per GPU: 30B layer forward "
              f"{REFERENCE_EP8['30b fwd']} ms, 235B layer backward {REFERENCE_EP8['235b bwd']} ms."]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", nargs="+", required=True,
                   help="JSON of python -m torchtitan_megamoe.bench --ep R --loopback --json")
    p.add_argument("--bw-gbs", type=float, default=NVLINK_GBS)
    p.add_argument("--compute", choices=COMPUTE, default="loopback",
                   help="a rank's compute: the loopback's device busy time / R, or ours at EP=1 "
                        "on the same tokens / R (without the EP machinery's own compute)")
    args = p.parse_args(argv)
    results = []
    for path in args.json:
        with open(path) as f:
            results += [r for r in json.load(f)["results"] if r.get("loopback")]
    print(model_table(results, args.bw_gbs, args.compute))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
