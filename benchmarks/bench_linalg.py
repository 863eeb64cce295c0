"""Benchmark: functransforms.linalg against dense torch, hand-written structured torch code and
linear_operator (when installed; a benchmark-only extra).

float64, one thread, medians over repeats, every operator rebuilt inside each timed call.

    python benchmarks/bench_linalg.py                 # prints the table
    python benchmarks/bench_linalg.py --write         # and writes docs/performance-linalg.md

Problems: (a) solve with A ⊗ B (64 x 64 SPD each, N = 4096); (b) logdet of it; (c) matmul of
low-rank(16) + diagonal (N = 4096) with a 4096 x 8 matrix; (d) solve with (c)'s operator;
(e) gradient of logdet(A ⊗ B) with respect to A and B. Plus the cold start: in a fresh process,
after `import torch`, the time to import the library and finish the first structured solve.
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import random
import statistics
import subprocess
import sys
import tempfile
import time

import torch

torch.set_num_threads(1)
DT = torch.float64
N1 = 64
NLR, RANK, K = 4096, 16, 8


def median_time(fn, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def make_inputs():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(N1, N1, generator=g, dtype=DT)
    Y = torch.randn(N1, N1, generator=g, dtype=DT)
    A = X @ X.mT / N1 + torch.eye(N1, dtype=DT)
    B = Y @ Y.mT / N1 + torch.eye(N1, dtype=DT)
    b = torch.randn(N1 * N1, generator=g, dtype=DT)
    U = torch.randn(NLR, RANK, generator=g, dtype=DT) / RANK**0.5
    d = torch.rand(NLR, generator=g, dtype=DT) + 0.5
    Xr = torch.randn(NLR, K, generator=g, dtype=DT)
    return A, B, b, U, d, Xr


# ------------------------------------------------------------------ implementations
def ours(A, B, b, U, d, Xr):
    import functransforms.linalg as L

    def kron():
        return L.KroneckerOperator(A, B, positive_definite=True)

    def lrd():
        return L.LowRankPlusDiagonalOperator(U, d, positive_definite=True)

    grad_label, grad_fn = _our_grad(L, A, B)
    return {
        "a": lambda: torch.linalg.solve(kron(), b),
        "b": lambda: torch.logdet(kron()),
        "c": lambda: lrd() @ Xr,
        "d": lambda: torch.linalg.solve(lrd(), Xr),
        "e": grad_fn,
    }, grad_label


def _our_grad(L, A, B):
    import functransforms as ft

    def f(A, B):
        return torch.logdet(L.KroneckerOperator(A, B, positive_definite=True))

    grad = ft.grad(f, argnums=(0, 1))  # built once, as user code does
    return "functransforms.grad", lambda: grad(A, B)


def dense(A, B, b, U, d, Xr):
    def kron_chol():
        return torch.linalg.cholesky(torch.kron(A, B))

    def dense_lrd():
        return torch.diag(d) + U @ U.mT

    def grad():
        Ar, Br = A.detach().requires_grad_(True), B.detach().requires_grad_(True)
        return torch.autograd.grad(torch.logdet(torch.kron(Ar, Br)), (Ar, Br))

    return {
        "a": lambda: torch.cholesky_solve(b[:, None], kron_chol())[:, 0],
        "b": lambda: 2 * kron_chol().diagonal().log().sum(),
        "c": lambda: dense_lrd() @ Xr,
        "d": lambda: torch.cholesky_solve(Xr, torch.linalg.cholesky(dense_lrd())),
        "e": grad,
    }


def hand_written(A, B, b, U, d, Xr):
    def kron_solve():
        # (A ⊗ B)^{-1} vec(X) = vec(A^{-1} X B^{-1}), A, B SPD
        La, Lb = torch.linalg.cholesky(A), torch.linalg.cholesky(B)
        Xm = b.reshape(N1, N1)
        Y = torch.cholesky_solve(Xm, La)
        return torch.cholesky_solve(Y.mT, Lb).mT.reshape(-1)

    def kron_logdet(A, B):
        La, Lb = torch.linalg.cholesky(A), torch.linalg.cholesky(B)
        return 2 * N1 * (La.diagonal().log().sum() + Lb.diagonal().log().sum())

    def woodbury():
        DinvU = U / d[:, None]
        C = torch.eye(RANK, dtype=DT) + U.mT @ DinvU
        Lc = torch.linalg.cholesky(C)
        DinvX = Xr / d[:, None]
        return DinvX - DinvU @ torch.cholesky_solve(U.mT @ DinvX, Lc)

    def grad():
        Ar, Br = A.detach().requires_grad_(True), B.detach().requires_grad_(True)
        return torch.autograd.grad(kron_logdet(Ar, Br), (Ar, Br))

    return {
        "a": kron_solve,
        "b": lambda: kron_logdet(A, B),
        "c": lambda: d[:, None] * Xr + U @ (U.mT @ Xr),
        "d": woodbury,
        "e": grad,
    }


def linear_operator_impl(A, B, b, U, d, Xr):
    try:
        import linear_operator  # noqa: F401
        from linear_operator.operators import (
            DenseLinearOperator,
            DiagLinearOperator,
            KroneckerProductLinearOperator,
            LowRankRootAddedDiagLinearOperator,
            LowRankRootLinearOperator,
        )
    except ImportError:
        return None

    def kron(A=A, B=B):
        return KroneckerProductLinearOperator(DenseLinearOperator(A), DenseLinearOperator(B))

    def lrd():
        return LowRankRootAddedDiagLinearOperator(
            LowRankRootLinearOperator(U), DiagLinearOperator(d)
        )

    def grad():
        Ar, Br = A.detach().requires_grad_(True), B.detach().requires_grad_(True)
        return torch.autograd.grad(kron(Ar, Br).logdet(), (Ar, Br))

    return {
        "a": lambda: kron().solve(b[:, None])[:, 0],
        "b": lambda: kron().logdet(),
        "c": lambda: lrd() @ Xr,
        "d": lambda: lrd().solve(Xr),
        "e": grad,
    }


# ------------------------------------------------------------------ checks and cold start
def check_agreement(impls):
    """Every implementation computes the same numbers (else the timing is meaningless)."""
    ref = impls["hand-written"]
    for name, impl in impls.items():
        for key in "abcde":
            got, exp = impl[key](), ref[key]()
            if isinstance(exp, tuple):
                # gradients: compare on symmetric perturbations (a Cholesky reads one triangle)
                got = tuple(g + g.mT for g in got)
                exp = tuple(e + e.mT for e in exp)
                ok = all(torch.allclose(x, y, rtol=1e-6, atol=1e-8) for x, y in zip(got, exp))
            else:
                ok = torch.allclose(got, exp, rtol=1e-6, atol=1e-8)
            if not ok:
                raise AssertionError(f"{name} disagrees with hand-written code on ({key})")


COLD_OURS = """
import time, torch
torch.set_num_threads(1)
A = torch.eye(64, dtype=torch.float64) * 2; b = torch.ones(4096, dtype=torch.float64)
t0 = time.perf_counter()
import functransforms
t1 = time.perf_counter()
import functransforms.linalg as L
t2 = time.perf_counter()
x = torch.linalg.solve(L.KroneckerOperator(A, A, positive_definite=True), b)
t3 = time.perf_counter()
print(t3 - t0, t1 - t0, t2 - t1, t3 - t2)
"""

COLD_LO = """
import time, torch
torch.set_num_threads(1)
A = torch.eye(64, dtype=torch.float64) * 2; b = torch.ones(4096, 1, dtype=torch.float64)
t0 = time.perf_counter()
from linear_operator.operators import KroneckerProductLinearOperator, DenseLinearOperator
x = KroneckerProductLinearOperator(DenseLinearOperator(A), DenseLinearOperator(A)).solve(b)
print(time.perf_counter() - t0)
"""


def cold_start(script: str, runs: int, bytecode: bool) -> list[float]:
    """Median of each printed number over fresh processes.

    ``bytecode=True``: as installed, modules load from .pyc files (kept in a private cache
    directory, written by one untimed run). ``False``: our modules are compiled from source at
    every import (PYTHONDONTWRITEBYTECODE=1, the setting of this development machine).
    """
    env = dict(os.environ)
    if bytecode:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(pathlib.Path(tempfile.gettempdir()) / "bench_linalg_pyc")
        subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, check=True)
    else:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    rows = []
    for _ in range(runs):
        out = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
        )
        rows.append([float(x) for x in out.stdout.strip().splitlines()[-1].split()])
    return [statistics.median(col) for col in zip(*rows)]


PROBLEMS = {
    "a": "(a) solve A⊗B (64², N=4096)",
    "b": "(b) logdet A⊗B",
    "c": "(c) matmul LR(16)+diag @ 4096×8",
    "d": "(d) solve LR(16)+diag, 8 rhs",
    "e": "(e) grad logdet A⊗B wrt A, B",
}


def fmt(t):
    if t is None or (isinstance(t, float) and math.isnan(t)):
        return "n/a"
    return f"{t * 1e3:.3f} ms" if t < 1 else f"{t:.2f} s"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=300)
    p.add_argument("--dense-repeats", type=int, default=3)
    p.add_argument("--cold-runs", type=int, default=7)
    p.add_argument("--write", action="store_true", help="write docs/performance-linalg.md")
    args = p.parse_args()

    inputs = make_inputs()
    ours_impl, grad_label = ours(*inputs)
    impls = {
        "ours": ours_impl,
        "dense torch": dense(*inputs),
        "hand-written": hand_written(*inputs),
    }
    lo = linear_operator_impl(*inputs)
    if lo is not None:
        impls["linear_operator"] = lo
    check_agreement(impls)

    results = {name: {} for name in impls}
    for key in PROBLEMS:
        # The fast implementations are timed round-robin (one call each per round, in a
        # shuffled order), so that drifts in machine load and cache effects hit them alike; the
        # O(N^3) dense rows separately.
        fast = [n for n in impls if not (n == "dense torch" and key in "abde")]
        results.update({n: {**results[n], key: 0.0} for n in fast})
        for n in fast:
            for _ in range(3):
                impls[n][key]()
        times = {n: [] for n in fast}
        rng = random.Random(0)
        for _ in range(args.repeats):
            order = list(fast)
            rng.shuffle(order)  # no implementation always runs right after another one
            for n in order:
                t0 = time.perf_counter()
                impls[n][key]()
                times[n].append(time.perf_counter() - t0)
        for n in fast:
            results[n][key] = statistics.median(times[n])
        for n in set(impls) - set(fast):
            results[n][key] = median_time(impls[n][key], args.dense_repeats, warmup=1)

    cols = list(impls)
    header = "| problem | " + " | ".join(cols) + " | ours / hand-written |"
    if lo is not None:
        header += " linear_operator / ours |"
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for key, label in PROBLEMS.items():
        row = [label] + [fmt(results[c][key]) for c in cols]
        row.append(f"{results['ours'][key] / results['hand-written'][key]:.2f}")
        if lo is not None:
            row.append(f"{results['linear_operator'][key] / results['ours'][key]:.1f}x")
        lines.append("| " + " | ".join(row) + " |")
    table = "\n".join(lines)

    import platform

    versions = f"torch {torch.__version__}"
    if lo is not None:
        import linear_operator

        versions += f", linear_operator {linear_operator.__version__}"
    cmd = "python benchmarks/bench_linalg.py " + " ".join(sys.argv[1:])
    cold_rows = [
        f"| cold start, fresh process, after `import torch` (median of {args.cold_runs}) "
        "| ours total | of which: core import, linalg import, first solve | linear_operator |",
        "|---|---|---|---|",
    ]
    for bytecode, label in (
        (True, "bytecode cached (as installed)"),
        (False, "compiled from source"),
    ):
        total, core, lin, first = cold_start(COLD_OURS, args.cold_runs, bytecode)
        lo_t = cold_start(COLD_LO, args.cold_runs, bytecode)[0] if lo is not None else None
        cold_rows.append(
            f"| {label} | {fmt(total)} | {fmt(core)}, {fmt(lin)}, {fmt(first)} | {fmt(lo_t)} |"
        )
    targets = []
    for key in PROBLEMS:
        r = results["ours"][key] / results["hand-written"][key]
        targets.append(
            f"({key}) ours/hand-written {r:.2f} {'met' if r <= 1.5 else 'MISSED'} (<= 1.5)"
        )
    if lo is not None:
        for key in "abe":
            r = results["linear_operator"][key] / results["ours"][key]
            targets.append(
                f"({key}) {r:.1f}x faster than linear_operator {'met' if r >= 2 else 'MISSED'}"
            )
    report = "\n".join(
        [
            table,
            "",
            *cold_rows,
            "",
            f"(e) ours: {grad_label}. Dense torch, hand-written code and linear_operator are "
            "differentiated by torch.autograd.",
            "",
            "Targets: " + "; ".join(targets),
        ]
    )
    print(report)
    if args.write:
        doc = pathlib.Path(__file__).resolve().parents[1] / "docs" / "performance-linalg.md"
        doc.write_text(
            "# functransforms.linalg: performance\n\n"
            f"Command: `{cmd.strip()}` (float64, `torch.set_num_threads(1)`, medians over "
            f"{args.repeats} repeats ({args.dense_repeats} for the dense O(N³) rows), "
            "every operator "
            "rebuilt inside each timed call; all implementations checked to agree first).\n"
            f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
            f"{versions}.\n\n"
            "Hand-written = the minimal structured torch code a user would write for that one "
            "problem "
            "(per-factor Cholesky, Woodbury); linear_operator = the engine of GPyTorch, default "
            "settings, called as its users would.\n\n"
            f"{report}\n"
            "Targets: ours / hand-written <= 1.5 on each problem; ours >= 2x faster than "
            "linear_operator on (a), (b), (e); cold start < 50 ms (bytecode cached).\n\n"
            "Notes. (1) The machine is a shared 2-core VM: ratios move by about +-0.2 between "
            "runs, and (b), a ~0.1 ms problem where our Python layers (operator construction, "
            "`__torch_function__` routing: ~30-40 us) weigh most, is the tightest; an earlier run "
            "with a fixed (unshuffled) call order measured it at 1.60. (2) (e) is our "
            "`functransforms.grad`, the others torch.autograd. The PD log-determinant is one "
            "custom function whose derivative is one `cholesky_inverse` per factor and one tape "
            "node for the whole weighted sum (Note [Differentiating log det] in linalg/_dense.py)"
            ", rather than differentiating Cholesky, diagonal, log and sum op by op: each of our "
            "eager grad level's ops costs ~50-70 us (vs ~20 us for torch.autograd), so fewer, "
            "larger nodes is what makes a Python-level grad fast. (3) The core import dominates "
            "the cold start; this machine sets PYTHONDONTWRITEBYTECODE, hence the two cold-start "
            "rows.\n"
        )


if __name__ == "__main__":
    main()
