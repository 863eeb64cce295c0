"""Functions run in the worker processes of tests/distributed/test_pmap.py (spawned workers
import them by name, so they live in a module). Each per-example function is run under
``pmap`` here and under ``vmap`` with the same axis name in the test process: the two must agree."""

import torch
import torch.distributed as dist

import functransforms as ft

K = 2  # examples per process (1: pmap without a level for its shard, JAX's layout)


def global_data(world, seed=0, k=K):
    g = torch.Generator().manual_seed(seed)
    n = world * k
    return {
        "x": torch.randn(n, 2 * n, dtype=torch.float64, generator=g),
        "t": torch.randn(n, 2 * n, dtype=torch.float64, generator=g),
        "w": torch.randn(3, 2, dtype=torch.float64, generator=g),
        "xs": torch.randn(n, 5, 3, dtype=torch.float64, generator=g),
        "ys": torch.randn(n, 5, 2, dtype=torch.float64, generator=g),
    }


def values(n):
    """Per-example functions of a [2n] example whose outputs use every collective."""
    ring = [(i, (i + 1) % n) for i in range(n)]
    partial = [(0, n - 1), (n - 1, 1)] if n > 2 else [(1, 0)]
    return {
        "psum": lambda t: ft.psum(t, "d"),
        "pmean": lambda t: t - ft.pmean(t, "d"),
        "pmax": lambda t: ft.pmax(t, "d"),
        "pmin": lambda t: ft.pmin(t, "d"),
        "all_gather": lambda t: ft.all_gather(t, "d"),
        "all_gather_tiled": lambda t: ft.all_gather(t.reshape(2, -1), "d", axis=1, tiled=True),
        "psum_scatter": lambda t: ft.psum_scatter(t.reshape(n, 2), "d"),
        "psum_scatter_tiled": lambda t: ft.psum_scatter(t, "d", tiled=True),
        "all_to_all": lambda t: ft.all_to_all(t.reshape(n, 2), "d", 0, 1),
        "all_to_all_tiled": lambda t: ft.all_to_all(t.reshape(2 * n, 1), "d", 0, 1, tiled=True),
        "ppermute": lambda t: ft.ppermute(t, "d", ring),
        "ppermute_partial": lambda t: ft.ppermute(t, "d", partial),
        "axis_index": lambda t: t * ft.axis_index("d") + ft.axis_size("d"),
    }


def losses(n):
    """Per-example scalar losses through each collective, for the derivative checks."""
    ring = [(i, (i + 1) % n) for i in range(n)]
    return {
        "normalise": lambda t: (t - ft.pmean(t, "d")).pow(2).sum() / ft.psum(t.exp().sum(), "d"),
        "pmax": lambda t: (ft.pmax(t, "d") * t).sum(),
        "all_gather": lambda t: (ft.all_gather(t, "d") ** 2 * t).sum(),
        "psum_scatter": lambda t: ft.psum_scatter(t.reshape(n, 2).cos(), "d").prod(),
        "all_to_all": lambda t: (
            ft.all_to_all(t.reshape(n, 2), "d", 0, 1).exp() * t[:2, None]
        ).sum(),
        "ppermute": lambda t: (ft.ppermute(t, "d", ring) * t.tanh()).sum(),
    }


def dp_sgd_loss(w, x, y):
    return ((x @ w - y) ** 2).sum()


def clipped_grad(w, x, y):
    g = ft.grad(dp_sgd_loss)(w, x, y)
    return g / torch.clamp(g.norm(), min=1.0)


def dp_sgd_step(w, xs, ys):
    """One DP-SGD step on a device's batch: per-sample gradients, clipped, averaged over the
    batch *and* the devices (a collective naming both axes)."""

    def averaged(w, x, y):
        return ft.pmean(clipped_grad(w, x, y), ("devices", "batch"))

    # the average is the same for every example: keep the first
    return ft.vmap(averaged, in_dims=(None, 0, 0), axis_name="batch")(w, xs, ys)[0]


def replicated_loss(w, t):
    return (t[:2] @ w).sin().sum() * ft.pmean(t, "d").sum()


def shard(x, k=K):
    r = dist.get_rank()
    return x[r * k : (r + 1) * k]


def run_all(seed, k=K):
    """Every pmap check of this process (``k`` examples each); returns {name: this process's
    result}."""
    world = dist.get_world_size()
    n = world * k
    data = global_data(world, seed, k)
    x, t, w = shard(data["x"], k), shard(data["t"], k), data["w"]
    out = {}
    for name, f in values(n).items():
        out["value/" + name] = ft.pmap(f, "d")(x)
    for name, f in losses(n).items():
        mapped = ft.pmap(f, "d")
        out["grad_outside/" + name] = ft.grad(lambda xs, m=mapped: m(xs).sum())(x)
        out["jvp/" + name] = ft.jvp(mapped, (x,), (t,))[1]
        out["grad_inside/" + name] = ft.pmap(ft.grad(f), "d")(x)
    # a replicated parameter: its gradient is the single-process one on every process
    replicated = ft.pmap(replicated_loss, "d", in_dims=(None, 0))
    out["grad_replicated"] = ft.grad(lambda w: replicated(w, x).sum())(w[:2])
    # DP-SGD: one device example per process holding a batch, vmap inside pmap
    r = dist.get_rank()
    xs = data["xs"].reshape(world, -1, 3)[r : r + 1]
    ys = data["ys"].reshape(world, -1, 2)[r : r + 1]
    out["dp_sgd"] = ft.pmap(dp_sgd_step, "devices", in_dims=(None, 0, 0))(w, xs, ys)
    # with one example per process, f sees the example itself (no wrapper of a pmap level)
    wrapped = ft.pmap(lambda t: torch.tensor(type(t) is not torch.Tensor), "d")(x)
    out["wrapped"] = (k, bool(wrapped.all()))
    # errors raised the same way on every process
    try:
        # 1 example on even ranks, 2 on odd ones
        ft.pmap(lambda t: ft.psum(t, "d"), "d")(x[:1].expand(1 + dist.get_rank() % 2, -1))
    except ValueError as e:
        out["error/mismatch"] = str(e)
    try:
        ft.pmap(lambda t: ft.psum(t, "nope"), "d")(x)
    except NameError as e:
        out["error/unbound"] = str(e)
    return out


def fail_on_rank_one(timeout):
    if dist.get_rank() == 1:
        raise ZeroDivisionError("the original failure, on rank 1")
    # rank 0 waits in a collective that rank 1 never joins: it must not hang the launcher
    ft.pmap(lambda t: ft.psum(t, "d"), "d")(torch.ones(1, 2))
    return "unreachable"
