"""The plan kernels (ops/hopper/kernels/plan_kernels.py) at the real shapes, CUDA-event medians of 50:
EP=1 (16384 tokens x top-8 over 128 experts) and one region of the EP=8 forward (16384
received tokens x top-8, 16 of the 128 experts local). OTHER=path/to/plan_kernels.py also
times another version of the module (e.g. the previous commit's, from git show) in the same
process and checks that both give the same tensors:

    OTHER=/tmp/old_plan_kernels.py python3 experiments/plan_variants.py
"""

import importlib.util
import os

import torch

from torchtitan_megamoe.ops.hopper.kernels import plan_kernels
from torchtitan_megamoe.ops.hopper.plan import max_rows
from torchtitan_megamoe.timing import back_to_back_ms, median_ms

from routing import uniform_routing  # experiments/routing.py


def _module(path):
    spec = importlib.util.spec_from_file_location("other_plan_kernels", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    mods = {"this": plan_kernels}
    if os.environ.get("OTHER"):
        mods["other"] = _module(os.environ["OTHER"])
    torch.manual_seed(0)
    cases = []
    T, K, E = 16384, 8, 128
    ids = uniform_routing(E, K, T)
    cases.append(("EP=1 30B", ids, E, 1, None, max_rows(T * K, E, 128)))
    El = E // 8
    ids2 = uniform_routing(E, K, T)
    ids2 = torch.where(ids2 < El, ids2, -1)  # the other ranks' experts: not here
    cases.append(("EP=8 region", ids2, El, max_rows(T * K, El, 128)))
    # waited: each call's latency, host included; back to back: the GPU's time once the host
    # runs ahead (what the layer sees when a big kernel precedes)
    print("| plan | " + " | ".join(f"{m} waited / b2b ms" for m in mods) + " | same tensors |")
    print("| --- | " + " | ".join("---" for _ in mods) + " | --- |")
    for name, i, e, r in cases:
        outs, times = [], []
        for mod in mods.values():
            def run(mod=mod):
                return mod.plan_tensors(i, e, 128, 0, r, id_limit=e)
            outs.append([t for t in run()[:5] if t is not None])
            times.append((median_ms(run, 50, 5), back_to_back_ms(run, 200, 5)))
        same = all(all(torch.equal(a, b) for a, b in zip(outs[0], o)) for o in outs[1:])
        print(f"| {name} | " + " | ".join(f"{a:.4f} / {b:.4f}" for a, b in times) + f" | {same} |")


if __name__ == "__main__":
    main()
