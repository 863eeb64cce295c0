"""Costs of functransforms.deterministic (docs/determinism.md, docs/performance.md "Determinism").

    PYTHONPATH=$PWD python benchmarks/bench_determinism.py [--quick]

Single-threaded CPU (torch.set_num_threads(1)); medians over repeats; ratios within one run.
(a) audit and check_deterministic on the per-sample-gradient workload of bench_core (a);
(b) the deterministic mode's accumulation vs the accumulate kernel, index_put(accumulate=True)
    with 1M values into 64k slots; (c) an embedding-backward-heavy workload under grad, default
    vs deterministic mode (both levels); (d) level="threads" on a 10M float32 sum.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

import functransforms as ft
from functransforms.deterministic import _ops as det_ops

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_core import case_per_sample, median_time  # noqa: E402

aten = torch.ops.aten


def per_sample(reps):
    _, ours, *_ = case_per_sample(reps)
    t_plain = median_time(ours, reps)
    t_audit = median_time(lambda: ft.deterministic.audit(ours), reps)
    runs = 3
    t_check = median_time(lambda: ft.deterministic.check_deterministic(ours, runs=runs), reps) / runs
    with ft.deterministic.enabled():
        t_mode = median_time(ours, reps)
    with ft.deterministic.enabled(level="threads"):
        t_threads = median_time(ours, reps)
    return t_plain, t_audit, t_check, t_mode, t_threads


def index_put(reps):
    g = torch.Generator().manual_seed(0)
    S, N = 64_000, 1_000_000
    idx = torch.randint(0, S, (N,), generator=g)
    v = torch.randn(N, generator=g)
    z = torch.zeros(S)
    kernel = median_time(lambda: aten.index_put.default(z, [idx], v, True), reps)
    with ft.deterministic.enabled():
        ours = median_time(lambda: det_ops.det_call(aten.index_put.default, z, [idx], v, True), reps)
    return kernel, ours


def embedding(reps):
    g = torch.Generator().manual_seed(0)
    V, D, N = 50_000, 64, 200_000
    W = torch.randn(V, D, generator=g)
    idx = torch.randint(0, V, (N,), generator=g)

    def loss(W):
        return F.embedding(idx, W).tanh().sum()

    f = ft.grad(loss)
    base = median_time(lambda: f(W), reps)
    with ft.deterministic.enabled():
        mode = median_time(lambda: f(W), reps)
    with ft.deterministic.enabled(level="threads"):
        threads = median_time(lambda: f(W), reps)
    return base, mode, threads


def big_sum(reps):
    x = torch.randn(10_000_000, generator=torch.Generator().manual_seed(0))
    base = median_time(lambda: x.sum(), reps)
    with ft.deterministic.enabled(level="threads"):
        ours = median_time(lambda: x.sum(), reps)
    return base, ours


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ns = ap.parse_args(argv)
    torch.set_num_threads(1)
    r = 5 if ns.quick else 15
    ms = lambda t: f"{t * 1e3:.2f}"  # noqa: E731

    p, a, c, m, t = per_sample(r)
    print("| workload | plain (ms) | with it (ms) | ratio | target |")
    print("|---|---:|---:|---:|---|")
    print(f"| (a) audit, per-sample grads (bench_core a) | {ms(p)} | {ms(a)} | {a / p:.2f} | <= 2 |")
    print(
        f"| (a) check_deterministic per run (runs=3) | {ms(p)} | {ms(c)} | {c / p:.2f} | <= 3 |"
    )
    print(f"| (a) deterministic mode, per-sample grads | {ms(p)} | {ms(m)} | {m / p:.2f} | - |")
    print(f"| (a) level='threads', per-sample grads | {ms(p)} | {ms(t)} | {t / p:.2f} | - |")
    k, o = index_put(r)
    print(f"| (b) index_put accumulate 1M -> 64k | {ms(k)} | {ms(o)} | {o / k:.2f} | <= 3 |")
    b, em, et = embedding(r)
    print(f"| (c) grad of embedding, 200k lookups of 50k x 64 | {ms(b)} | {ms(em)} | {em / b:.2f} | - |")
    print(f"| (c) same, level='threads' | {ms(b)} | {ms(et)} | {et / b:.2f} | - |")
    s0, s1 = big_sum(r)
    print(f"| (d) 10M float32 sum, level='threads' | {ms(s0)} | {ms(s1)} | {s1 / s0:.2f} | - |")


if __name__ == "__main__":
    main()
