"""Named axes and pmap benchmark (issue 14).

    python benchmarks/bench_distributed.py [--quick]

(a) ``vmap`` of a per-example normalisation that uses ``pmean``/``psum`` over a batch of 256,
    against the same computation hand-written on the batched tensor: ours / hand.
(b) one DP-SGD step (per-sample gradients of the MLP 784-128-128-10 of bench_core, clipped to
    norm 1, averaged over the global batch of 256) in one process, and over 2 and 4 local gloo
    processes with ``pmap(vmap(grad))`` and with hand-written DDP-style code (``vmap(grad)``
    locally, then ``all_reduce`` of the summed clipped gradients): pmap / hand-written.
Single-threaded processes; medians over repeats, each repeat starting at a barrier.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import functransforms as ft

GLOBAL_BATCH = 256


def _median(fn, repeats, sync=None):
    fn()
    times = []
    for _ in range(repeats):
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# -- (a) collectives under vmap ----------------------------------------------------------------
def bench_vmap_collectives(repeats):
    torch.set_num_threads(1)
    x = torch.randn(GLOBAL_BATCH, 1024)

    def normalise(t):
        return (t - ft.pmean(t, "i")) / ft.psum(t.abs(), "i")

    ours = ft.vmap(normalise, axis_name="i")

    def hand():
        return (x - x.mean(0)) / x.abs().sum(0)

    torch.testing.assert_close(ours(x), hand())
    rows = []
    for _ in range(3):  # interleaved rounds
        rows.append((_median(lambda: ours(x), repeats), _median(hand, repeats)))
    t_ours = statistics.median(r[0] for r in rows)
    t_hand = statistics.median(r[1] for r in rows)
    return t_ours, t_hand


# -- (b) DP-SGD --------------------------------------------------------------------------------
SIZES = [784, 128, 128, 10]


def _params():
    g = torch.Generator().manual_seed(0)
    p = {}
    for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:])):
        p[f"w{i}"] = torch.randn(b, a, generator=g) / a**0.5
        p[f"b{i}"] = torch.zeros(b)
    return p


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(GLOBAL_BATCH, 784, generator=g), torch.randint(
        0, 10, (GLOBAL_BATCH,), generator=g
    )


def loss(p, x, y):
    h = F.relu(F.linear(x, p["w0"], p["b0"]))
    h = F.relu(F.linear(h, p["w1"], p["b1"]))
    return F.cross_entropy(F.linear(h, p["w2"], p["b2"]).unsqueeze(0), y.unsqueeze(0))


def clipped(p, x, y):
    g = ft.grad(loss)(p, x, y)
    norm = torch.sqrt(sum((v**2).sum() for v in g.values()))
    scale = 1.0 / torch.clamp(norm, min=1.0)
    return {k: v * scale for k, v in g.items()}


def dp_sgd_pmap(p, xs, ys):
    def averaged(p, x, y):
        return ft.pmean(clipped(p, x, y), ("devices", "batch"))

    per = ft.vmap(averaged, in_dims=(None, 0, 0), axis_name="batch")(p, xs, ys)
    return {k: v[0] for k, v in per.items()}


def dp_sgd_hand(p, xs, ys):
    per = ft.vmap(clipped, in_dims=(None, 0, 0))(p, xs, ys)
    flat = torch.cat([v.sum(0).flatten() for v in per.values()])
    if dist.is_initialized():
        dist.all_reduce(flat)
    flat = flat / GLOBAL_BATCH
    out, i = {}, 0
    for k, v in per.items():
        n = v[0].numel()
        out[k] = flat[i : i + n].view_as(v[0])
        i += n
    return out


def dp_sgd_worker(repeats):
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    p = _params()
    xs, ys = _data()
    xs = xs.reshape(world, -1, 784)[rank : rank + 1]
    ys = ys.reshape(world, -1)[rank : rank + 1]
    step = ft.pmap(dp_sgd_pmap, "devices", in_dims=(None, 0, 0))
    ours = step(p, xs, ys)
    hand = dp_sgd_hand(p, xs[0], ys[0])
    for k in hand:
        torch.testing.assert_close(ours[k][0], hand[k])
    rows = []
    for _ in range(3):
        rows.append(
            (
                _median(lambda: step(p, xs, ys), repeats, dist.barrier),
                _median(lambda: dp_sgd_hand(p, xs[0], ys[0]), repeats, dist.barrier),
            )
        )
    return statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)


def bench_dp_sgd_single(repeats):
    torch.set_num_threads(1)
    p = _params()
    xs, ys = _data()
    return _median(lambda: dp_sgd_hand(p, xs, ys), repeats)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    repeats = 5 if args.quick else 20
    t_ours, t_hand = bench_vmap_collectives(repeats * 5)
    print("| workload | ours (ms) | reference (ms) | ratio |")
    print("|---|---|---|---|")
    print(
        f"| (a) vmap normalise with pmean/psum, batch {GLOBAL_BATCH}x1024 vs hand-written batched "
        f"| {t_ours * 1e3:.3f} | {t_hand * 1e3:.3f} | {t_ours / t_hand:.2f} |"
    )
    single = bench_dp_sgd_single(repeats)
    print(f"| (b) DP-SGD step, 1 process, global batch {GLOBAL_BATCH} | {single * 1e3:.1f} | | |")
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    import bench_distributed as me  # spawned workers import the function by module name

    for world in (2, 4):
        results = ft.distributed.launch(me.dp_sgd_worker, world, repeats, timeout=300)
        t_pmap = max(r[0] for r in results)  # a step ends when the slowest process ends
        t_hand = max(r[1] for r in results)
        print(
            f"| (b) DP-SGD step, pmap over {world} gloo processes vs hand-written all_reduce "
            f"| {t_pmap * 1e3:.1f} | {t_hand * 1e3:.1f} | {t_pmap / t_hand:.2f} |"
        )
        speedup = single / t_pmap
        print(f"|     speed-up of pmap over 1 process, {world} processes | {speedup:.2f}x | | |")


if __name__ == "__main__":
    main()
