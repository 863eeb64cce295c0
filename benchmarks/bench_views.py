"""vmap of view ops: ours against torch.func (views instead of copies).

    python benchmarks/bench_views.py [--quick]

Each row maps a view op over 64 examples of [512, 256] (float32 for real rows, complex64 for
the conj rows), so a copy costs milliseconds and a view microseconds. The many-views rows
(unbind, split, chunk, tensor_split) make 512 pieces per call. Single thread, CPU time of this
thread (``time.thread_time``: the machine is shared), ours and torch.func interleaved call by
call, medians. Run it on an older commit to compare (the command in docs/performance.md).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import functransforms as ft

tf = torch.func

CASES = {
    "t[1:]": lambda t: t[1:],
    "narrow": lambda t: t.narrow(0, 8, 256),
    "select": lambda t: t.select(1, 3),
    "transpose": lambda t: t.transpose(0, 1),
    "diagonal": lambda t: t.diagonal(),
    "reshape": lambda t: t.reshape(256, 512),
    "unbind(0)[0] (512 pieces)": lambda t: t.unbind(0)[0],
    "unbind(1)[0] (256 pieces)": lambda t: t.unbind(1)[0],
    "split(1)[0] (512 pieces)": lambda t: t.split(1)[0],
    "chunk(512)[0]": lambda t: t.chunk(512)[0],
    "tensor_split(512)[0]": lambda t: t.tensor_split(512)[0],
    "split(100)[-1] (6 pieces)": lambda t: t.split(100)[-1],
    "unbind(0) all 512 returned": lambda t: t.unbind(0),
    "conj()[1:]": lambda t: t.conj()[1:],
    "conj().transpose(0, 1)": lambda t: t.conj().transpose(0, 1),
    "conj().unbind(0)[0]": lambda t: t.conj().unbind(0)[0],
}
COMPLEX = {name for name in CASES if name.startswith("conj")}


def _cpu(fn, x):
    t0 = time.thread_time()
    fn(x)
    return time.thread_time() - t0


def _shares_memory(out, x):
    outs = out if isinstance(out, tuple) else (out,)
    return all(o.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for o in outs)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    repeats = 31 if args.quick else 101
    torch.set_num_threads(1)
    xs = {False: torch.randn(64, 512, 256), True: torch.randn(64, 512, 256, dtype=torch.cfloat)}
    print("| view op under vmap | ours (us) | torch.func (us) | ours / torch.func | view of x |")
    print("|---|---|---|---|---|")
    for name, f in CASES.items():
        x = xs[name in COMPLEX]
        ours, theirs = ft.vmap(f), tf.vmap(f)
        a, b = ours(x), theirs(x)
        torch.testing.assert_close(a, b)
        for fn in (ours, theirs):  # warm up
            fn(x)
        t_ours, t_theirs = [], []
        for _ in range(repeats):  # interleaved: both see the same load
            t_ours.append(_cpu(ours, x))
            t_theirs.append(_cpu(theirs, x))
        mo, mt = statistics.median(t_ours), statistics.median(t_theirs)
        view = "yes" if _shares_memory(a, x) else "no (copy)"
        if isinstance(a, torch.Tensor) and a.is_conj():
            view += ", is_conj"
        print(f"| {name} | {mo * 1e6:.1f} | {mt * 1e6:.1f} | {mo / mt:.2f} | {view} |")


if __name__ == "__main__":
    main()
