"""Hand-written Hopper (sm_90a) CUDA kernels, built with nvcc on first use on a GPU machine and
called through ctypes. CPU installs never build them; every kernel here is also a candidate
next to its Triton twin, so the tuner keeps whichever runs faster.

One module per kernel family, each with its bf16 and FP8 entry points: gemm1_swiglu.py,
gemm_rows.py (gemm2, dgrad1), dgrad2_swiglu.py, wgrad.py, over csrc/<family>.cu. They share
sm90.py (where the kernels may run, the typed libraries, the launch, the input checks),
params.py (the launch structs, mirroring csrc/include/launch_params.h) and build.py (the nvcc
build and its cache).
"""
