"""vmap of view ops: ours against torch.func (issue 10: views instead of copies).

    python benchmarks/bench_views.py [--quick]

Each row maps a view op over 64 examples of [512, 256] float32 (32 MB in all), so a copy costs
milliseconds and a view microseconds. Single thread, ours and torch.func interleaved in one
run, medians. Run it on an older commit to compare (the command in docs/performance.md).
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
    "unbind[0]": lambda t: t.unbind(0)[0],
    "reshape": lambda t: t.reshape(256, 512),
}


def _median(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    repeats = 11 if args.quick else 51
    torch.set_num_threads(1)
    x = torch.randn(64, 512, 256)
    print("| view op under vmap | ours (us) | torch.func (us) | ratio | ours is a view of x |")
    print("|---|---|---|---|---|")
    for name, f in CASES.items():
        ours, theirs = ft.vmap(f), tf.vmap(f)
        torch.testing.assert_close(ours(x), theirs(x))
        rounds = [
            (_median(lambda f=ours: f(x), repeats), _median(lambda f=theirs: f(x), repeats))
            for _ in range(3)
        ]
        t_ours = statistics.median(r[0] for r in rounds)
        t_theirs = statistics.median(r[1] for r in rounds)
        out = ours(x)
        is_view = out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        print(
            f"| {name} | {t_ours * 1e6:.1f} | {t_theirs * 1e6:.1f} | {t_ours / t_theirs:.2f} "
            f"| {'yes' if is_view else 'no (copy)'} |"
        )


if __name__ == "__main__":
    main()
