"""Each stage's table of implementations ("sides"): which configs fit a problem, which runs
untuned, and how each side launches. table.py holds the table type (the typed configs are
../configs.py, which heuristics.py's Triton lists use too); one module per stage (or family of stages sharing a kernel) builds its table.
kernels/ holds the Triton kernels, cuda/ the csrc/ wrappers, deepgemm.py DeepGEMM's."""
