"""``python -m torchtitan_megamoe.ops.hopper.cuda`` (``make cuda-cache``): every kernel family's
library built into $MEGAMOE_CUDA_CACHE ahead of time (nvcc, no GPU), e.g. into .cuda_cache to
carry to a GPU machine."""

from torchtitan_megamoe.ops.hopper.cuda.build import FAMILIES, build

for family in FAMILIES:
    print(build(family))
