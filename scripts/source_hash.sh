#!/usr/bin/env bash
# sha256 (first 16 hex digits) of the package's and scripts' sources (Python, CUDA, shell), in
# path order: what a GPU log's "sources" line names, to match a run to a commit (run this on
# a checkout of it). Not git's view: a copied working tree's .git can lag its files.
cd "$(dirname "$0")/.." && find torchtitan_megamoe csrc scripts -type f \
  \( -name '*.py' -o -name '*.cu' -o -name '*.cuh' -o -name '*.sh' \) -not -path '*/__pycache__/*' \
  | LC_ALL=C sort | xargs cat | sha256sum | cut -c1-16
