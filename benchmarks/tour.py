"""A tour of functransforms: ``python -m functransforms [--quick]``
(or ``python benchmarks/tour.py``).

Runs four classic workloads with our transforms, checks each against torch.func (the oracle;
the library itself never calls it), and prints median times of ours vs torch.func vs a Python
loop. Exits non-zero if any result disagrees with torch.func.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

import functransforms as ft

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_core import median_time  # noqa: E402  (one timing helper for the suite)


def _median(fn, repeats):
    return median_time(fn, repeats, warmup=1)


def _maxdiff(a, b):
    if isinstance(a, dict):
        return max(_maxdiff(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return max(_maxdiff(x, y) for x, y in zip(a, b))
    return (a - b).abs().max().item()


def per_sample_grads():
    """vmap(grad(loss), in_dims=(None, 0, 0)): one gradient per example of a small MLP."""
    g = torch.Generator().manual_seed(0)
    params = {
        "w0": torch.randn(32, 16, generator=g) / 4,
        "b0": torch.zeros(32),
        "w1": torch.randn(4, 32, generator=g) / 6,
        "b1": torch.zeros(4),
    }
    xs = torch.randn(32, 16, generator=g)  # [N, 16]
    ys = torch.randint(0, 4, (32,), generator=g)  # [N]

    def loss(p, x, y):  # one example: x [16], y []
        h = torch.tanh(F.linear(x, p["w0"], p["b0"]))
        return F.cross_entropy(F.linear(h, p["w1"], p["b1"]).unsqueeze(0), y.unsqueeze(0))

    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}

    def loop():
        return [
            torch.autograd.grad(loss(leaves, xs[i], ys[i]), list(leaves.values()))
            for i in range(32)
        ]

    return (
        "per-sample grads (MLP 16-32-4, N=32)",
        lambda: ft.vmap(ft.grad(loss), in_dims=(None, 0, 0))(params, xs, ys),  # {name: [N, ...]}
        lambda: torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, xs, ys),
        loop,
    )


def jacobian():
    """jacrev of tanh(W x): R^64 -> R^64."""
    g = torch.Generator().manual_seed(1)
    W = torch.randn(64, 64, generator=g) / 8
    x = torch.randn(64, generator=g)
    f = lambda x: torch.tanh(W @ x)  # noqa: E731  [64] -> [64]
    xl = x.clone().requires_grad_()

    def loop():
        y = f(xl)
        return torch.stack([torch.autograd.grad(y[i], xl, retain_graph=True)[0] for i in range(64)])

    return (
        "jacrev of tanh(W x), 64->64",
        lambda: ft.jacrev(f)(x),
        lambda: torch.func.jacrev(f)(x),
        loop,
    )


def hvp():
    """Hessian-vector product, forward-over-reverse: jvp(grad(f), (x,), (v,))."""
    g = torch.Generator().manual_seed(2)
    A = torch.randn(64, 64, generator=g) / 8
    x, v = torch.randn(64, generator=g), torch.randn(64, generator=g)
    f = lambda x: (torch.sin(x) * (A @ x)).sum() + x.pow(3).sum()  # noqa: E731  [64] -> []
    xl = x.clone().requires_grad_()

    def loop():  # the classic eager double-backward hvp
        (gx,) = torch.autograd.grad(f(xl), xl, create_graph=True)
        return torch.autograd.grad(gx, xl, v)[0]

    return (
        "hvp jvp(grad(f)), 64 inputs",
        lambda: ft.jvp(ft.grad(f), (x,), (v,))[1],
        lambda: torch.func.jvp(torch.func.grad(f), (x,), (v,))[1],
        loop,
    )


def complex_grad():
    """grad of a real loss of a complex input: dL/dx + i dL/dy (PyTorch's; docs/complex.md)."""
    g = torch.Generator().manual_seed(3)
    z = torch.randn(64, dtype=torch.complex64, generator=g)
    c = torch.randn(64, dtype=torch.complex64, generator=g)

    def L(z):  # complex [64] -> real []: sum |z^2 - c|^2
        r = z * z - c
        return (r * r.conj()).real.sum()

    zl = z.clone().requires_grad_()
    return (
        "complex grad, real L(z), z in C^64",
        lambda: ft.grad(L)(z),
        lambda: torch.func.grad(L)(z),
        lambda: torch.autograd.grad(L(zl), zl)[0],
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m functransforms", description="A tour of functransforms."
    )
    ap.add_argument("--quick", action="store_true", help="fewer timing repeats")
    ns = ap.parse_args(argv)
    torch.set_num_threads(1)
    repeats = 5 if ns.quick else 25

    print(f"functransforms tour (torch {torch.__version__}, 1 thread, median of {repeats} runs)\n")
    head = (
        f"{'workload':<38} {'max|ours-torch.func|':>20} {'check':>5} "
        f"{'ours ms':>9} {'torch.func ms':>13} {'loop ms':>9}"
    )
    print(head)
    print("-" * len(head))
    failed = False
    for case in (per_sample_grads, jacobian, hvp, complex_grad):
        name, ours, theirs, loop = case()
        err = _maxdiff(ours(), theirs())
        ok = err <= 1e-5
        failed |= not ok
        to, tt, tl = (_median(fn, repeats) * 1e3 for fn in (ours, theirs, loop))
        print(
            f"{name:<38} {err:>20.2e} {'OK' if ok else 'FAIL':>5} {to:>9.3f} {tt:>13.3f} {tl:>9.3f}"
        )
    print("\nFull suite: python benchmarks/bench_core.py (results in docs/performance.md)")
    if failed:
        print("FAIL: some results disagree with torch.func", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
