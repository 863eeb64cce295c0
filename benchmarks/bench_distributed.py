"""Named axes and pmap benchmark.

    python benchmarks/bench_distributed.py [--quick] [--procs 1,2,4] [--allocator default]
                                           [--runs 3]
    python benchmarks/bench_distributed.py --breakdown [--quick]   # where (a)'s time goes

(a) ``vmap`` of a per-example normalisation that uses ``pmean``/``psum`` over a batch of 256
    (x 1024 features), against the same computation hand-written on the batched tensor: ours /
    hand. Timed by thread CPU time, one call of each per round (interleaved), medians. glibc
    either reuses freed 1 MB buffers (fast kernels: the hand-written code takes ~0.15 ms) or
    maps fresh pages for each (page faults: ~0.9 ms), and which one a process gets depends on
    its allocation history, so the ratio was bimodal (1.2-5.8) from one run to the next. Both
    regimes are measured, pinned with ``mallopt`` (where glibc is present). A third row isolates
    what a collective costs: one call of ``psum`` against one of ``sum(0)`` under vmap (a
    small batch; four calls in one vmapped function, minus the function without them).
(b) one DP-SGD step (per-sample gradients of the MLP 784-128-128-10 of bench_core, clipped to
    norm 1, averaged over the global batch of 256) over 1, 2 and 4 local gloo processes, with
    ``pmap(vmap(grad))`` and with hand-written DDP-style code (``vmap(grad)`` locally, then one
    ``all_reduce`` of the summed clipped gradients), one call of each per round, each call
    starting at a barrier. CPU time per process (``process_time``: the process's work, including
    gloo's threads, not the time it waits for a core) and wall time (the slowest process). With
    more processes than cores the wall times measure the scheduler; compare CPU times there.
    The workers' allocator is pinned to reuse freed buffers (``--allocator``): by default each
    process gets 0 to 15000 page faults a step at 4 processes (25 MB per-sample gradients, near
    glibc's dynamic threshold), which moved a process's CPU time by up to 60%.
Single-threaded processes. The ratios are the numbers to read; the load average is printed.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import functransforms as ft

GLOBAL_BATCH = 256


def _load():
    return f"{os.getloadavg()[0]:.1f}"


def _interleaved(fns, rounds, clock=time.thread_time, sync=None):
    """Median time of each of ``fns`` (name -> fn), one call of each per round."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            if sync is not None:
                sync()
            t0 = clock()
            fn()
            times[name].append(clock() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


# -- (a) collectives under vmap ----------------------------------------------------------------
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: the allocator's regime is not pinned
        return None


# name -> (mmap threshold, trim threshold). Fresh pages first: once the heap holds free 1 MB
# chunks, a lower threshold no longer forces new mappings.
REGIMES = {
    "fresh pages per buffer": (128 << 10, 128 << 10),
    "freed buffers reused": (256 << 20, 512 << 20),
}


def normalise(t):  # t: [D], one example
    return (t - ft.pmean(t, "i")) / ft.psum(t.abs(), "i")


def bench_vmap_collectives(rounds, runs=1):
    """Rows of (a): (label, ours seconds, reference seconds). Each allocator regime runs in a
    fresh process, pinned from its start by glibc's environment variables: pinned later, a
    heap that already holds free 1 MB chunks keeps serving them. With ``runs`` > 1 each regime
    runs in that many processes and the row is the one of median ratio (on a loaded machine
    one process's ratio moves by 0.1-0.2 with what the other cores run meanwhile)."""
    import json
    import subprocess

    rows = []
    for regime, (mmap_at, trim_at) in REGIMES.items() if _libc() else [("default", (0, 0))]:
        env = dict(os.environ)
        if mmap_at:
            env.update(MALLOC_MMAP_THRESHOLD_=str(mmap_at), MALLOC_TRIM_THRESHOLD_=str(trim_at))
        child = [sys.executable, os.path.abspath(__file__), "--normalise-only", str(rounds)]
        times = []
        for _ in range(runs):
            out = subprocess.run(child, env=env, check=True, capture_output=True).stdout
            times.append(json.loads(out))
        t = sorted(times, key=lambda t: t["ours"] / t["hand"])[len(times) // 2]
        label = f"(a) vmap normalise with pmean/psum, {GLOBAL_BATCH}x1024, allocator: {regime}"
        if runs > 1:
            ratios = ", ".join(f"{t['ours'] / t['hand']:.2f}" for t in times)
            label += f" (median of {runs} processes: {ratios})"
        rows.append((label, t["ours"], t["hand"]))

    # the cost of one call: four calls in one vmapped function, minus the function without them
    torch.set_num_threads(1)
    small = torch.randn(GLOBAL_BATCH, 16)
    fns = {
        "none": lambda t: t,
        "psum": lambda t: [ft.psum(t, "i") for _ in range(4)] and t,
        "sum": lambda t: [t.sum(0) for _ in range(4)] and t,
    }
    fns = {k: ft.vmap(f, axis_name="i") for k, f in fns.items()}
    t = _interleaved({k: (lambda f=f: f(small)) for k, f in fns.items()}, rounds * 5)
    label = f"(a) one call of psum vs of sum(0) (per example), under vmap, {GLOBAL_BATCH}x16"
    rows.append((label, (t["psum"] - t["none"]) / 4, (t["sum"] - t["none"]) / 4))
    return rows


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


def _pin_allocator(regime):
    """Pin glibc's allocator to ``regime`` (a key of REGIMES); False where it cannot be."""
    libc = _libc()
    if libc is None or regime not in REGIMES:
        return False
    mmap_at, trim_at = REGIMES[regime]
    libc.mallopt(_M_MMAP_THRESHOLD, mmap_at)
    libc.mallopt(_M_TRIM_THRESHOLD, trim_at)
    libc.malloc_trim(0)
    return True


def dp_sgd_worker(rounds, allocator):
    """One process's medians: {(pmap|hand, cpu|wall): seconds}."""
    torch.set_num_threads(1)
    _pin_allocator(allocator)
    rank, world = dist.get_rank(), dist.get_world_size()
    p = _params()
    xs, ys = _data()
    xs = xs.reshape(world, -1, 784)[rank : rank + 1]  # JAX's layout: one device example
    ys = ys.reshape(world, -1)[rank : rank + 1]
    step = ft.pmap(dp_sgd_pmap, "devices", in_dims=(None, 0, 0))
    ours = step(p, xs, ys)
    hand = dp_sgd_hand(p, xs[0], ys[0])
    for k in hand:
        torch.testing.assert_close(ours[k][0], hand[k])
    fns = {"pmap": lambda: step(p, xs, ys), "hand": lambda: dp_sgd_hand(p, xs[0], ys[0])}
    for fn in fns.values():
        fn()
    times = {(k, clock): [] for k in fns for clock in ("cpu", "wall")}
    for _ in range(rounds):
        for k, fn in fns.items():
            dist.barrier()
            c0, w0 = time.process_time(), time.perf_counter()
            fn()
            times[k, "wall"].append(time.perf_counter() - w0)
            times[k, "cpu"].append(time.process_time() - c0)
    return {key: statistics.median(t) for key, t in times.items()}


def _normalise_only(rounds):
    """(a)'s normalisation in this process (run by bench_vmap_collectives): prints the times."""
    import json

    torch.set_num_threads(1)
    x = torch.randn(GLOBAL_BATCH, 1024)
    ours = ft.vmap(normalise, axis_name="i")

    def hand():
        return (x - x.mean(0)) / x.abs().sum(0)

    torch.testing.assert_close(ours(x), hand())
    print(json.dumps(_interleaved({"ours": lambda: ours(x), "hand": hand}, rounds)))


def _breakdown_only(rounds):
    """Where (a)'s time over the hand-written code goes (``--breakdown``; run by
    bench_breakdown in the reused-buffer regime): the same five kernels with more and more of
    the machinery, each variant timed in the same interleaved rounds. Prints the times."""
    import json

    from functransforms.batching._tensor import VmapInterpreter, wrap_batched

    from functransforms._core import levels as _core

    torch.set_num_threads(1)
    x = torch.randn(GLOBAL_BATCH, 1024)
    ours = ft.vmap(normalise, axis_name="i")
    ours(x)  # builds the lean path's facts and the rule tables
    interp = VmapInterpreter(GLOBAL_BATCH, "error", "vmap(normalise)")
    interp.axis_name, interp.chunked = "i", False
    stack = _core._state.stack

    def hand():
        return (x - x.mean(0)) / x.abs().sum(0)

    def wrappers():  # the hand-written kernels, and the four wrappers vmap builds around them
        m = x.mean(0)
        t = wrap_batched(x, 0, interp)
        d = x - m
        w1 = wrap_batched(d, 0, interp)
        a = x.abs()
        w2 = wrap_batched(a, 0, interp)
        s = a.sum(0)
        del a, w2
        out = d / s
        w3 = wrap_batched(out, 0, interp)
        del t, w1, w3
        return out

    mk = torch.Tensor._make_wrapper_subclass
    args = (
        type(wrap_batched(x, 0, interp)),
        (1024,),
        (1,),
        None,
        None,
        x.dtype,
        x.layout,
        x.device,
    )

    def bare():  # the hand-written kernels, and four wrappers made with constant arguments
        m = x.mean(0)
        t = mk(*args)
        d = x - m
        w1 = mk(*args)
        a = x.abs()
        w2 = mk(*args)
        s = a.sum(0)
        del a, w2
        out = d / s
        w3 = mk(*args)
        del t, w1, w3
        return out

    def ops():  # the function on a wrapper: the ops and collectives, without vmap's call
        stack.append(interp)
        try:
            return normalise(wrap_batched(x, 0, interp))._value
        finally:
            stack.pop()

    torch.testing.assert_close(ops(), hand())
    fns = {"hand": hand, "bare": bare, "wrappers": wrappers, "ops": ops, "vmap": lambda: ours(x)}
    print(json.dumps(_interleaved(fns, rounds)))


def bench_breakdown(rounds):
    """Rows of ``--breakdown`` (reused buffers, one process): (label, seconds, hand-written)."""
    import json
    import subprocess

    mmap_at, trim_at = REGIMES["freed buffers reused"]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(mmap_at), MALLOC_TRIM_THRESHOLD_=str(trim_at))
    child = [sys.executable, os.path.abspath(__file__), "--breakdown-only", str(rounds)]
    t = json.loads(subprocess.run(child, env=env, check=True, capture_output=True).stdout)
    labels = {
        "bare": "(a) breakdown: the hand-written kernels + 4 bare _make_wrapper_subclass calls",
        "wrappers": "(a) breakdown: the hand-written kernels + the 4 wrappers vmap builds",
        "ops": "(a) breakdown: normalise on a wrapper (ops, collectives), no vmap call",
        "vmap": "(a) breakdown: the whole vmap",
    }
    return [(label, t[k], t["hand"]) for k, label in labels.items()]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds (noisier)")
    ap.add_argument("--procs", default="1,2,4", help="process counts for (b); '' skips (b)")
    ap.add_argument(
        "--allocator",
        default="freed buffers reused",
        choices=[*REGIMES, "default"],
        help="glibc allocator regime of the (b) workers (default: reuse freed buffers)",
    )
    ap.add_argument(
        "--runs", type=int, default=1, help="(a): processes per allocator regime (median ratio)"
    )
    ap.add_argument(
        "--breakdown",
        action="store_true",
        help="(a) only, reused buffers: the kernels with more and more of vmap's machinery",
    )
    ap.add_argument("--normalise-only", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--breakdown-only", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.normalise_only:
        return _normalise_only(args.normalise_only)
    if args.breakdown_only:
        return _breakdown_only(args.breakdown_only)
    rounds = 5 if args.quick else 15
    load = _load()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_distributed as me  # spawned workers import the function by module name

    rows, walls = [], {}
    if args.breakdown:
        args.procs = ""
        rows += bench_breakdown(rounds * 20)
    for world in [int(n) for n in args.procs.split(",") if n]:
        results = ft.distributed.launch(
            me.dp_sgd_worker, world, rounds, args.allocator, timeout=600
        )
        cpu = {k: statistics.mean(r[k, "cpu"] for r in results) for k in ("pmap", "hand")}
        wall = {k: max(r[k, "wall"] for r in results) for k in ("pmap", "hand")}
        walls[world] = wall
        name = f"(b) DP-SGD step, {world} gloo process{'es' if world > 1 else ''}, {args.allocator}"
        rows.append((f"{name}: CPU per process", cpu["pmap"], cpu["hand"]))
        rows.append((f"{name}: wall, slowest process", wall["pmap"], wall["hand"]))
    if not args.breakdown:
        rows += bench_vmap_collectives(rounds * 20, args.runs)

    print(
        f"load average {load} at start, {_load()} at end; {os.cpu_count()} cores; torch "
        f"{torch.__version__}; functransforms from {os.path.dirname(ft.__file__)}; single-threaded "
        "processes; medians of interleaved rounds\n"
    )
    print("| workload | ours | reference (hand-written) | ours / reference |")
    print("|---|---|---|---|")
    for label, ours, ref in rows:
        unit, scale = ("ms", 1e3) if label.startswith("(b)") else ("us", 1e6)
        print(
            f"| {label} | {ours * scale:.1f} {unit} | {ref * scale:.1f} {unit} | {ours / ref:.2f} |"
        )
    if 1 in walls:
        print(
            "\nspeed-up of the wall time over 1 process: "
            + "; ".join(
                f"{w} processes: pmap {walls[1]['pmap'] / t['pmap']:.2f}x, "
                f"hand-written {walls[1]['hand'] / t['hand']:.2f}x"
                for w, t in walls.items()
                if w != 1
            )
        )


if __name__ == "__main__":
    main()
