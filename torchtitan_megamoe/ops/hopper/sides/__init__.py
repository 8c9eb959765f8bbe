"""Each stage's table of implementations ("sides"): which configs fit a problem, which runs
untuned, and how each side launches. table.py holds the table type, configs.py the typed
configs; one module per stage (or family of stages sharing a kernel) builds its table.
kernels/ holds the Triton kernels, cuda/ the csrc/ wrappers, deepgemm.py DeepGEMM's."""
