"""Hand-written Hopper (sm_90a) CUDA kernels: sources in csrc/, built with
nvcc on first use on a GPU machine (build.py) and called through ctypes. CPU installs never
build them; every kernel here is also a candidate next to its Triton twin, so the tuner keeps
whichever runs faster."""
