"""Accuracy and CPU time of the structured algorithms of the Kronecker-sum, circulant,
tridiagonal, block and kernel operators against dense torch.linalg on the same matrix.

float64, one thread, CPU-time medians, ratios within one run.

    python benchmarks/bench_linalg_operators.py
"""

from __future__ import annotations

import statistics
import time

import functransforms.linalg as L
import torch

torch.set_num_threads(1)
DT = torch.float64


def cpu_median(fn, repeats=5):
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return statistics.median(times)


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def problems():
    g = torch.Generator().manual_seed(0)
    n = 48
    lap = 2 * torch.eye(n, dtype=DT) - torch.diag(torch.ones(n - 1, dtype=DT), 1)
    lap = lap - torch.diag(torch.ones(n - 1, dtype=DT), -1)
    yield (
        "Kronecker sum 48^2 (2-D Laplacian) solve",
        L.KroneckerSumOperator(lap, lap, positive_definite=True),
        "solve",
    )
    yield (
        "Kronecker sum 48^2 logdet",
        L.KroneckerSumOperator(lap, lap, positive_definite=True),
        "logdet",
    )
    c = torch.randn(2048, generator=g, dtype=DT) / 2048**0.5
    c[0] += 3
    yield "circulant n=2048 solve (FFT)", L.CirculantOperator(c), "solve"
    yield "circulant n=2048 slogdet", L.CirculantOperator(c), "slogdet"
    m = 2048
    T = L.TridiagonalOperator(  # diagonally dominant: the PCR / cyclic-reduction path
        2 * torch.rand(m - 1, generator=g, dtype=DT) - 1,
        torch.rand(m, generator=g, dtype=DT) + 3,
        2 * torch.rand(m - 1, generator=g, dtype=DT) - 1,
    )
    yield "tridiagonal n=2048 solve (PCR)", T, "solve"
    yield "tridiagonal n=2048 slogdet (cyclic reduction)", T, "slogdet"
    A = torch.randn(1000, 1000, generator=g, dtype=DT) / 1000**0.5 + 2 * torch.eye(1000, dtype=DT)
    B = L.BlockOperator(
        [
            [A, None],
            [torch.randn(1000, 1000, generator=g, dtype=DT), L.TriangularOperator(A.tril())],
        ]
    )
    yield "block lower 2x(1000) solve (substitution)", B, "solve"


def main():
    print(f"{'problem':48s} {'rel. error':>10s} {'ours ms':>9s} {'dense ms':>9s} {'ratio':>6s}")
    for name, op, what in problems():
        D = op.to_dense()
        b = torch.randn(D.shape[-1], dtype=DT, generator=torch.Generator().manual_seed(1))
        if what == "solve":
            ours = lambda op=op, b=b: torch.linalg.solve(op, b)  # noqa: E731
            dense = lambda D=D, b=b: torch.linalg.solve(D, b)  # noqa: E731
        elif what == "logdet":
            ours = lambda op=op: torch.logdet(op)  # noqa: E731
            dense = lambda D=D: torch.logdet(D)  # noqa: E731
        else:
            ours = lambda op=op: torch.linalg.slogdet(op)[1]  # noqa: E731
            dense = lambda D=D: torch.linalg.slogdet(D)[1]  # noqa: E731
        err = rel(ours(), dense())
        t1, t2 = cpu_median(ours), cpu_median(dense)
        print(f"{name:48s} {err:10.1e} {1e3 * t1:9.2f} {1e3 * t2:9.2f} {t1 / t2:6.3f}")


if __name__ == "__main__":
    main()
