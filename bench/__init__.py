"""lmserver's benchmark harness: workloads against the physical limit and against peers.

Run ``python -m bench run --help``; see bench/README.md for what the figures mean.
"""
