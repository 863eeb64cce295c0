"""Interop benchmark: a training step whose forward uses vmap, followed by loss.backward().

    python benchmarks/bench_interop.py [--quick]

The model is torch.func's ensembling tutorial: 10 MLPs 784-128-128-10 stacked with
``stack_module_state``, a batch of 64 shared by every member, ``vmap(functional_call)`` forward,
cross-entropy, ``loss.backward()`` on the stacked parameters, one SGD update. Single-threaded
CPU; every time is the median over repeats, ours and torch.func interleaved in one run.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F

import functransforms as ft

tf = torch.func


def _mlp():
    return torch.nn.Sequential(
        torch.nn.Linear(784, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, 10),
    )


def make_step(lib, n_models=10, batch=64, seed=0):
    """A closure running one training step with ``lib`` (functransforms or torch.func)."""
    torch.manual_seed(seed)
    models = [_mlp() for _ in range(n_models)]
    params, buffers = lib.stack_module_state(models)
    base = copy.deepcopy(models[0]).to("meta")
    x = torch.randn(batch, 784)
    y = torch.randint(0, 10, (batch,))
    opt = torch.optim.SGD(list(params.values()), lr=1e-3)

    def fmodel(p, b, x):
        return lib.functional_call(base, (p, b), (x,))

    ensemble = lib.vmap(fmodel, in_dims=(0, 0, None))

    def step():
        opt.zero_grad(set_to_none=True)
        logits = ensemble(params, buffers, x)  # [n_models, batch, 10]
        loss = F.cross_entropy(logits.reshape(-1, 10), y.repeat(n_models))
        loss.backward()
        opt.step()
        return loss

    return step, params


def interleaved(fns, repeats, warmup=3):
    """Median time of each function, run in turn so that both see the same machine load."""
    for f in fns:
        for _ in range(warmup):
            f()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for ts, f in zip(times, fns):
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    ns = ap.parse_args(argv)
    torch.set_num_threads(1)
    ours, p_ours = make_step(ft)
    theirs, p_theirs = make_step(tf)
    # same start, same data: one step each must give the same loss and gradients
    l_ours, l_theirs = ours(), theirs()
    err = max(
        (p_ours[k] - p_theirs[k]).abs().max().item() for k in p_ours
    )  # after one SGD step with equal gradients the parameters agree
    to, tt = interleaved([ours, theirs], 7 if ns.quick else 41)
    print(
        "| training step: vmap over 10 MLPs 784-128-128-10 (stack_module_state), batch 64, "
        "loss.backward(), SGD | ours (ms) | torch.func (ms) | ours / torch.func | target <= 1.3 "
        "| max abs err (params after one step) |"
    )
    print("|---|---:|---:|---:|---|---:|")
    print(
        f"| | {to * 1e3:.3f} | {tt * 1e3:.3f} | {to / tt:.2f} | "
        f"{'met' if to / tt <= 1.3 else 'MISSED'} | {err:.1e} |"
    )
    assert abs(l_ours.item() - l_theirs.item()) < 1e-4


if __name__ == "__main__":
    main()
