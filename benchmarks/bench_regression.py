"""Did a change tax the common path? The same workloads, timed against two revisions of the library.

    python benchmarks/bench_regression.py [--baseline 2e1e6e6] [--rounds 5] [--repeats 31]
    python benchmarks/bench_regression.py --baseline REV --harness 2e1e6e6   # a later baseline

The autograd interop and the torch.func parity of vmap must not make the suite's (a)-(e) ratios
(ours / torch.func) more than 5% worse than the code before them (2e1e6e6). The benchmark suite
has changed since, so this runs the BASELINE's own workloads (its benchmarks/bench_core.py cases)
against both library trees: a git worktree of the baseline revision and this checkout. Each
round runs one subprocess per tree (alternating, so machine load hits both alike); a subprocess
times ours and torch.func interleaved, single thread, in thread CPU time (robust to other
processes on a shared machine), and prints ours / torch.func per workload. The report is the
median ratio per tree and their change.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Runs inside a subprocess whose PYTHONPATH puts one library tree first; argv: harness path,
# repeats. Every case of the old harness returns (name, ours, theirs, loop, hand, err, repeats).
_CHILD = r"""
import importlib.util, json, statistics, sys, time
import torch
torch.set_num_threads(1)
spec = importlib.util.spec_from_file_location("harness", sys.argv[1])
h = importlib.util.module_from_spec(spec); spec.loader.exec_module(h)
import functransforms
reps = int(sys.argv[2])
cases = [h.case_per_sample(5), h.case_jac(5, "jacrev"), h.case_jac(5, "jacfwd"),
         h.case_hessian(5), h.case_hvp(5), h.case_pointwise(5)]
out = {"tree": functransforms.__file__}
for name, ours, theirs, *_ in cases:
    for _ in range(3):
        ours(); theirs()
    to, tt = [], []
    for _ in range(reps):
        t0 = time.thread_time(); ours(); to.append(time.thread_time() - t0)
        t0 = time.thread_time(); theirs(); tt.append(time.thread_time() - t0)
    out[name] = statistics.median(to) / statistics.median(tt)
print(json.dumps(out))
"""


def _run(tree, harness, repeats):
    env = dict(os.environ, PYTHONPATH=tree)
    r = subprocess.run(
        [sys.executable, "-c", _CHILD, harness, str(repeats)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tree,
        check=True,
    )
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out.pop("tree").startswith(tree), f"imported the wrong tree from {tree}"
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default="2e1e6e6", help="revision before the change")
    ap.add_argument(
        "--harness",
        default=None,
        help="revision whose bench_core.py workloads run (default: the baseline's; its case "
        "functions must take the signatures of 2e1e6e6's)",
    )
    ap.add_argument("--rounds", type=int, default=5, help="subprocess pairs")
    ap.add_argument("--repeats", type=int, default=31, help="timed calls per workload")
    ns = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        old = os.path.join(tmp, "baseline")
        subprocess.run(
            ["git", "worktree", "add", "-q", "--detach", old, ns.baseline],
            cwd=_ROOT,
            check=True,
        )
        cases = os.path.join(tmp, "harness")
        subprocess.run(
            ["git", "worktree", "add", "-q", "--detach", cases, ns.harness or ns.baseline],
            cwd=_ROOT,
            check=True,
        )
        try:
            harness = os.path.join(cases, "benchmarks", "bench_core.py")
            runs = {"baseline": [], "current": []}
            for _ in range(ns.rounds):
                runs["baseline"].append(_run(old, harness, ns.repeats))
                runs["current"].append(_run(_ROOT, harness, ns.repeats))
        finally:
            for tree in (old, cases):
                remove = ["git", "worktree", "remove", "--force", tree]
                subprocess.run(remove, cwd=_ROOT, check=True)
    cases_of = ns.harness or ns.baseline
    print(f"{cases_of}'s workloads against baseline {ns.baseline}, ours / torch.func (thread CPU")
    print(f"time, medians of {ns.rounds} rounds x {ns.repeats} calls); change = current / baseline")
    print("- 1\n")
    print("| workload | baseline | current | change |")
    print("|---|---:|---:|---:|")
    for name in runs["baseline"][0]:
        b = statistics.median(r[name] for r in runs["baseline"])
        c = statistics.median(r[name] for r in runs["current"])
        print(f"| {name} | {b:.2f} | {c:.2f} | {100 * (c / b - 1):+.0f}% |")


if __name__ == "__main__":
    main()
