"""Convolutional workloads: functransforms vs torch.func, in the same run.

    python benchmarks/bench_surface.py [--repeats 15] [--quick]

(a) per-sample gradients of torch.func's tutorial CNN (two conv layers, two linear layers,
batch 64 of 1x28x28), with the peak memory of one call; (b) reverse mode (grad w.r.t. the
parameters and the input) of a ResNet basic block (conv-bn-relu-conv-bn + skip, batch 16 of
16x32x32, batch norm in training mode); (c) forward mode (jvp) of the same block; (d) a
Hessian-vector product (jvp of grad) through a small conv net; (e) per-problem gradients
(vmap of grad) through QR and through linalg.lstsq, 32 problems of 64x32.

Single thread (torch.set_num_threads(1)), float32. Timings are interleaved (ours, torch.func,
ours, ...: load changes on a shared machine hit both alike) and reported as medians. Peak
memory: each library runs the call in 3 fresh subprocesses, after a warm-up at batch 2; the
number is every byte the call held at its high point: the peak resident set (VmHWM, reset
through /proc/self/clear_refs just before the call) minus the resident set before it. Large
tensors are mmap-ed and returned to the OS, so the resident set follows live tensors.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import functransforms as ft

tf = torch.func


class SimpleCNN(nn.Module):
    """torch.func's per-sample-gradients tutorial model."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        return F.log_softmax(self.fc2(x), dim=1)


class BasicBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)
        for bn in (self.bn1, self.bn2):
            bn.num_batches_tracked = None  # torch.func refuses its Python-side add_

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + x)


def per_sample_case(batch=64):
    torch.manual_seed(0)
    model = SimpleCNN()
    params = {k: v.detach() for k, v in model.named_parameters()}
    data = torch.randn(batch, 1, 28, 28)
    targets = torch.randint(10, (batch,))

    def make(lib):
        def loss(p, x, t):
            out = lib.functional_call(model, p, (x.unsqueeze(0),))
            return F.nll_loss(out, t.unsqueeze(0))

        return lambda: lib.vmap(lib.grad(loss), in_dims=(None, 0, 0))(params, data, targets)

    return make(ft), make(tf)


def _block_case():
    torch.manual_seed(0)
    block = BasicBlock(16)
    params = {k: v.detach() for k, v in block.named_parameters()}
    x = torch.randn(16, 16, 32, 32)
    blocks = {ft: block, tf: copy.deepcopy(block)}

    def loss(lib):
        return lambda p, x: (lib.functional_call(blocks[lib], p, (x,)) ** 2).mean()

    tangents = ({k: torch.randn_like(v) for k, v in params.items()}, torch.randn_like(x))
    return params, x, loss, tangents


def block_grad_case():
    params, x, loss, _ = _block_case()
    return (
        lambda: ft.grad(loss(ft), (0, 1))(params, x),
        lambda: tf.grad(loss(tf), (0, 1))(params, x),
    )


def block_jvp_case():
    params, x, loss, tangents = _block_case()
    return (
        lambda: ft.jvp(loss(ft), (params, x), tangents),
        lambda: tf.jvp(loss(tf), (params, x), tangents),
    )


def hvp_case():
    torch.manual_seed(0)
    p = {
        "w1": torch.randn(8, 3, 3, 3) / 5,
        "w2": torch.randn(8, 8, 3, 3) / 8,
        "fc": torch.randn(10, 8) / 3,
    }
    x = torch.randn(8, 3, 16, 16)
    v = {k: torch.randn_like(t) for k, t in p.items()}

    def loss(p):
        h = torch.tanh(F.conv2d(x, p["w1"], padding=1))
        h = torch.tanh(F.conv2d(h, p["w2"], padding=1, stride=2))
        return (F.adaptive_avg_pool2d(h, 1).flatten(1) @ p["fc"].T).logsumexp(1).mean()

    return (
        lambda: ft.jvp(ft.grad(loss), (p,), (v,))[1],
        lambda: tf.jvp(tf.grad(loss), (p,), (v,))[1],
    )


def _qr_lstsq_data():
    torch.manual_seed(0)
    return torch.randn(32, 64, 32), torch.randn(32, 64, 2)  # torch.func fails on vector b


def qr_grad_case():
    """(e) per-problem gradient through QR: vmap(grad(f)) over 32 problems, A 64x32."""
    A, b = _qr_lstsq_data()

    def loss(A, b):
        Q, R = torch.linalg.qr(A)
        return (Q.mT @ b).square().sum() + R.diagonal().abs().log().sum()

    return (
        lambda: ft.vmap(ft.grad(loss))(A, b),
        lambda: tf.vmap(tf.grad(loss))(A, b),
    )


def qr_baseline_case():
    """(e) the QR row's loss with the decomposition replaced by views (Q, R = A, A[:32]): the
    cost of the loss's own ops, to read the QR row against."""
    A, b = _qr_lstsq_data()

    def loss(A, b):
        Q, R = A, A[..., :32, :]
        return (Q.mT @ b).square().sum() + R.diagonal().abs().log().sum()

    return (
        lambda: ft.vmap(ft.grad(loss))(A, b),
        lambda: tf.vmap(tf.grad(loss))(A, b),
    )


def lstsq_grad_case():
    """(e) per-problem gradient through least squares: vmap(grad(f)), A 64x32, B 64x2."""
    A, b = _qr_lstsq_data()

    def loss(A, b):
        return torch.linalg.lstsq(A, b).solution.square().sum()

    return (
        lambda: ft.vmap(ft.grad(loss))(A, b),
        lambda: tf.vmap(tf.grad(loss))(A, b),
    )


CASES = {
    "(a) per-sample grads, tutorial CNN, B=64, 1x28x28": per_sample_case,
    "(b) grad of a ResNet basic block, B=16, 16x32x32": block_grad_case,
    "(c) jvp of a ResNet basic block, B=16, 16x32x32": block_jvp_case,
    "(d) hvp jvp(grad(f)), small conv net, B=8, 3x16x16": hvp_case,
    "(e) vmap(grad) through QR, 32 problems, 64x32": qr_grad_case,
    "(e) baseline: the QR row's loss without the QR": qr_baseline_case,
    "(e) vmap(grad) through linalg.lstsq, 32 problems, 64x32": lstsq_grad_case,
}


def max_abs_err(a, b):
    la, lb = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    return max(float((x - y).abs().max()) for x, y in zip(la, lb))


def interleaved(ours, theirs, repeats, clock=time.perf_counter):
    for _ in range(2):  # warm-up
        ours()
        theirs()
    to, tt = [], []
    for i in range(repeats):
        pair = ((ours, to), (theirs, tt)) if i % 2 == 0 else ((theirs, tt), (ours, to))
        for fn, acc in pair:
            t0 = clock()
            fn()
            acc.append(clock() - t0)
    return statistics.median(to), statistics.median(tt)


_MEM_CHILD = """
import sys, torch
torch.set_num_threads(1)
sys.path.insert(0, {root!r})
import bench_surface as b
which = {which!r}
warm = b.per_sample_case(batch=2)[0 if which == 'ours' else 1]
warm()
run = b.per_sample_case(batch=64)[0 if which == 'ours' else 1]
def status(key):
    for line in open('/proc/self/status'):
        if line.startswith(key + ':'):
            return int(line.split()[1])
with open('/proc/self/clear_refs', 'w') as f:
    f.write('5')  # reset the peak resident set (VmHWM) to the current one
before = status('VmRSS')
run()
print((status('VmHWM') - before) / 1024)
"""


def peak_memory_mb(which):
    import os

    root = os.path.dirname(os.path.abspath(__file__))
    code = _MEM_CHILD.format(root=root, which=which)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--quick", action="store_true", help="3 repeats, no memory measurement")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON too")
    ap.add_argument("--only", default="", help="run the rows whose name starts with this")
    ap.add_argument(
        "--cpu-time",
        action="store_true",
        help="time with the thread's CPU clock: on a loaded machine, wall time also counts the "
        "time the process waits to be scheduled, which grows with a call's length",
    )
    ns = ap.parse_args(argv)
    torch.set_num_threads(1)
    repeats = 3 if ns.quick else ns.repeats
    rows = []
    for name, case in CASES.items():
        if not name.startswith(ns.only):
            continue
        ours, theirs = case()
        err = max_abs_err(ours(), theirs())
        clock = time.thread_time if ns.cpu_time else time.perf_counter
        to, tt = interleaved(ours, theirs, repeats, clock)
        rows.append((name, to * 1e3, tt * 1e3, to / tt, err))
    mem = None
    if not ns.quick and "(a)".startswith(
        ns.only
    ):  # 3 fresh processes each, interleaved: the allocator's noise is ~1 MB
        runs = {"ours": [], "torch.func": []}
        for _ in range(3):
            for which in runs:
                runs[which].append(peak_memory_mb(which))
        mem = tuple(statistics.median(runs[w]) for w in runs) + tuple(
            (min(runs[w]), max(runs[w])) for w in runs
        )
    load = open("/proc/loadavg").read().split()[0] if platform.system() == "Linux" else "?"
    print(
        f"torch {torch.__version__}, CPython {platform.python_version()}, 1 thread, float32, "
        f"{'thread CPU time' if ns.cpu_time else 'wall time'}, "
        f"median of {repeats} interleaved repeats, load average at the end {load}\n"
    )
    print("| workload | ours (ms) | torch.func (ms) | ours / torch.func | target <= 1.2 ", end="")
    print("| max abs err |")
    print("|---|---:|---:|---:|---|---:|")
    for name, to, tt, r, err in rows:
        met = "met" if r <= 1.2 else "MISSED"
        print(f"| {name} | {to:.1f} | {tt:.1f} | {r:.2f} | {met} | {err:.1e} |")
    if mem is not None:
        met = "met" if mem[0] <= mem[1] else "MISSED"
        print(
            "\nPeak memory of one call of (a) (peak resident set over the call, fresh process, "
            f"median of 3 [range]): ours {mem[0]:.1f} MB [{mem[2][0]:.1f}-{mem[2][1]:.1f}], "
            f"torch.func {mem[1]:.1f} MB [{mem[3][0]:.1f}-{mem[3][1]:.1f}], ratio "
            f"{mem[0] / mem[1]:.3f} (target <= 1.0: {met})"
        )
    if ns.json:
        print(json.dumps({"rows": rows, "memory_mb": mem}))


if __name__ == "__main__":
    main()
