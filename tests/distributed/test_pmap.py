"""pmap over local gloo processes: every collective, derivatives in every
composition, DP-SGD, errors and worker failures, against the same per-example functions run
under vmap in this process (whose collectives tests/distributed/test_collectives.py checks against
explicit batch reductions and torch.func)."""

import distributed_workers as workers
import pytest
import torch
import torch.distributed as dist
import torch.func as tf

import functransforms as ft
from functransforms.distributed import WorkerError, launch

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")


def single_process(world, seed=0, k=workers.K):
    """What the workers compute, in one process: vmap with the same axis name."""
    n = world * k
    data = workers.global_data(world, seed, k)
    x, t, w = data["x"], data["t"], data["w"]
    out = {}
    for name, f in workers.values(n).items():
        out["value/" + name] = ft.vmap(f, axis_name="d")(x)
    for name, f in workers.losses(n).items():
        mapped = ft.vmap(f, axis_name="d")
        out["grad_outside/" + name] = ft.grad(lambda xs, m=mapped: m(xs).sum())(x)
        out["jvp/" + name] = ft.jvp(mapped, (x,), (t,))[1]
        out["grad_inside/" + name] = ft.vmap(ft.grad(f), axis_name="d")(x)
    replicated = ft.vmap(workers.replicated_loss, in_dims=(None, 0), axis_name="d")
    out["grad_replicated"] = ft.grad(lambda w: replicated(w, x).sum())(w[:2])
    per = tf.vmap(tf.grad(workers.dp_sgd_loss), in_dims=(None, 0, 0))(
        w, data["xs"].reshape(-1, 3), data["ys"].reshape(-1, 2)
    )
    norms = per.flatten(1).norm(dim=1).clamp(min=1.0)
    out["dp_sgd"] = (per / norms[:, None, None]).mean(0)
    return out


# k = 1 example per process runs pmap without a level of its own (Note [pmap without a level
# for its shard], functransforms/distributed/_collectives.py); k = 2 runs it as a vmap over the
# shard
@pytest.fixture(
    scope="module",
    params=[(2, 2), (4, 2), (2, 1), (4, 1)],
    ids=["2procs", "4procs", "2procs-1each", "4procs-1each"],
)
def runs(request):
    world, k = request.param
    return world, launch(workers.run_all, world, 0, k, timeout=120), single_process(world, 0, k)


def test_every_result_matches_single_process(runs):
    world, per_rank, reference = runs
    for name, ref in reference.items():
        got = [r[name] for r in per_rank]
        if name == "grad_replicated":
            for g in got:  # every process holds the whole gradient
                torch.testing.assert_close(g, ref, msg=name)
        elif name == "dp_sgd":
            for g in got:
                torch.testing.assert_close(g, ref.expand_as(g), msg=name)
        else:
            torch.testing.assert_close(torch.cat(got), ref, msg=name)


def test_one_example_per_process_runs_without_a_level(runs):
    for k, wrapped in (r["wrapped"] for r in runs[1]):
        assert wrapped == (k > 1)


def test_errors_are_raised_on_every_process(runs):
    world, per_rank, _ = runs
    for r in per_rank:
        assert "different shapes" in r["error/mismatch"]
        assert "rank 0: (((1, " in r["error/mismatch"]
        assert "rank 1: (((2, " in r["error/mismatch"]
        assert "unbound axis name 'nope'" in r["error/unbound"]
        assert "['d']" in r["error/unbound"]


def test_worker_failure_surfaces_the_first_traceback():
    with pytest.raises(WorkerError, match="ZeroDivisionError: the original failure") as info:
        launch(workers.fail_on_rank_one, 2, 10, timeout=10)
    assert info.value.rank == 1
    assert "fail_on_rank_one" in str(info.value)  # the worker's own traceback


def test_without_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="no torch.distributed process group"):
        ft.pmap(lambda t: t, "d")(torch.ones(2))
