"""Benchmarks runnable from the installed package (`k3 bench NAME`): each module exposes `main(argv) -> int`.

`kda.py`: KDA ops on CPU against the matmul limit, the log-space baseline, fla-core's naive loop and softmax
attention (issue #3). Benchmarks may import `openk3.ops` and `openk3.utils` only.
"""
