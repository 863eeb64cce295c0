"""Costs of functransforms.deterministic (docs/determinism.md, docs/performance.md "Determinism").

    PYTHONPATH=$PWD python benchmarks/bench_determinism.py [--quick]

Single-threaded CPU (torch.set_num_threads(1)); medians over repeats; ratios within one run.
(a) audit and check_deterministic on the per-sample-gradient workload of bench_core (a), B=64;
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
from bench_core import case_per_sample  # noqa: E402

aten = torch.ops.aten


def paired(fa, fb, reps):
    """Medians of ``fa`` and ``fb`` timed alternately (the machine's load drifts: a ratio of
    interleaved runs is steadier than one of two separate series)."""
    import statistics
    import time

    for _ in range(2):
        fa(), fb()
    ta, tb = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        fa()
        t1 = time.perf_counter()
        fb()
        t2 = time.perf_counter()
        ta.append(t1 - t0)
        tb.append(t2 - t1)
    return statistics.median(ta), statistics.median(tb)


def _in_mode(fn, **kw):
    def run():
        with ft.deterministic.enabled(**kw):
            return fn()

    return run


def per_sample(reps):
    c = case_per_sample(64)  # B=64, the batch this benchmark was written with
    fn, args = c["ours_fn"], c["args"]
    ours = lambda: fn(*args)  # noqa: E731
    runs = 3
    p1, a = paired(ours, lambda: ft.deterministic.audit(ours), reps)
    p2, c = paired(ours, lambda: ft.deterministic.check_deterministic(ours, runs=runs), reps)
    p3, m = paired(ours, _in_mode(ours), reps)
    p4, t = paired(ours, _in_mode(ours, level="threads"), reps)
    return (p1, a), (p2, c / runs), (p3, m), (p4, t)


def index_put(reps):
    g = torch.Generator().manual_seed(0)
    S, N = 64_000, 1_000_000
    idx = torch.randint(0, S, (N,), generator=g)
    v = torch.randn(N, generator=g)
    z = torch.zeros(S)
    kernel = lambda: aten.index_put.default(z, [idx], v, True)  # noqa: E731
    ours = _in_mode(lambda: det_ops.det_call(aten.index_put.default, z, [idx], v, True))
    return paired(kernel, ours, reps)


def embedding(reps):
    g = torch.Generator().manual_seed(0)
    V, D, N = 50_000, 64, 200_000
    W = torch.randn(V, D, generator=g)
    idx = torch.randint(0, V, (N,), generator=g)

    def loss(W):
        return F.embedding(idx, W).tanh().sum()

    f = lambda: ft.grad(loss)(W)  # noqa: E731
    return paired(f, _in_mode(f), reps), paired(f, _in_mode(f, level="threads"), reps)


def big_sum(reps):
    x = torch.randn(10_000_000, generator=torch.Generator().manual_seed(0))
    return paired(lambda: x.sum(), _in_mode(lambda: x.sum(), level="threads"), reps)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ns = ap.parse_args(argv)
    torch.set_num_threads(1)
    r = 5 if ns.quick else 15
    ms = lambda t: f"{t * 1e3:.2f}"  # noqa: E731

    rows = []
    (p, a), (p2, c), (p3, m), (p4, t) = per_sample(r)
    rows.append(("(a) audit, per-sample grads (bench_core a)", p, a, "<= 2"))
    rows.append(("(a) check_deterministic, per run (runs=3)", p2, c, "<= 3"))
    rows.append(("(a) enabled(), per-sample grads", p3, m, "-"))
    rows.append(("(a) enabled(level='threads'), per-sample grads", p4, t, "-"))
    k, o = index_put(r)
    rows.append(("(b) index_put(accumulate=True), 1M values -> 64k slots", k, o, "<= 3"))
    (b, em), (b2, et) = embedding(max(3, r // 3))
    rows.append(("(c) grad of embedding: 200k lookups in 50k x 64, enabled()", b, em, "-"))
    rows.append(("(c) same, enabled(level='threads')", b2, et, "-"))
    s0, s1 = big_sum(r)
    rows.append(("(d) sum of 10M float32, enabled(level='threads')", s0, s1, "-"))
    print("| workload | without (ms) | with (ms) | ratio | target |")
    print("|---|---:|---:|---:|---|")
    for name, x, y, target in rows:
        print(f"| {name} | {ms(x)} | {ms(y)} | {y / x:.2f} | {target} |", flush=True)


if __name__ == "__main__":
    main()
