"""Core performance suite: functransforms (eager and jit) vs torch.func vs hand-written code.

    python benchmarks/bench_core.py [--quick] [--no-inductor] [--out docs/performance.md]
    python benchmarks/bench_core.py --per-op    # per-op dispatch cost of sin and mm only

Single-threaded (torch.set_num_threads(1)); every number is the median over repeats, and the
columns of one row are timed interleaved (one call of each per round), so a load spike hits
them alike. On CUDA (when present) every workload runs there too, with synchronised timing.
torch.func is the baseline here (the library itself never calls it). ``--out X.md`` also
writes ``X.json`` (machine-readable: every time, ratio and target of the run).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import functransforms as ft

tf = torch.func
DEVICE = "cpu"
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sync():
    if DEVICE != "cpu":
        torch.cuda.synchronize()


def _clock():
    # On CPU with one torch thread every kernel runs on the calling thread, so its CPU time
    # is the work done, and time spent preempted by other processes on a shared machine is
    # not counted (wall time on a loaded 2-core machine varied 3-5x between rounds). CUDA:
    # wall time after a synchronize.
    return time.thread_time() if DEVICE == "cpu" else time.perf_counter()


def _calibrate(fn, budget=2e-3):
    """How many calls make one timed sample last about ``budget`` seconds."""
    fn()
    _sync()
    t0 = _clock()
    fn()
    _sync()
    t = _clock() - t0
    return max(1, min(200, int(budget / max(t, 1e-7))))


def interleaved(fns, repeats, warmup=2):
    """Median seconds per call of each fn; one sample of each per round."""
    live = {k: f for k, f in fns.items() if f is not None}
    for _ in range(warmup):
        for f in live.values():
            f()
    number = {k: _calibrate(f) for k, f in live.items()}
    samples = {k: [] for k in live}
    for _ in range(repeats):
        for k, f in live.items():
            n = number[k]
            _sync()
            t0 = _clock()
            for _ in range(n):
                f()
            _sync()
            samples[k].append((_clock() - t0) / n)
    return {k: (statistics.median(samples[k]) if k in samples else None) for k in fns}


def median_time(fn, repeats, warmup=2):
    return interleaved({"f": fn}, repeats, warmup)["f"]


def _randn(*shape, g):
    return torch.randn(*shape, generator=g).to(DEVICE)


# -- the do-nothing subclass floor -----------------------------------------------------------------
class Floor(torch.Tensor):
    """A wrapper whose __torch_dispatch__ unwraps, runs the op and wraps: the least any eager
    design built on tensor subclasses pays per op."""

    @staticmethod
    def __new__(cls, v):
        r = torch.Tensor._make_wrapper_subclass(
            cls, v.shape, strides=v.stride(), dtype=v.dtype, device=v.device
        )
        r.v = v
        return r

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        un = lambda x: x.v if isinstance(x, Floor) else x  # noqa: E731
        out = func(
            *torch.utils._pytree.tree_map(un, args),
            **torch.utils._pytree.tree_map(un, kwargs or {}),
        )
        return torch.utils._pytree.tree_map_only(torch.Tensor, Floor, out)


def floor_fn(jitted, args):
    """The workload's own ATen op sequence (its jit graph) replayed on do-nothing wrappers."""
    from functransforms._pytree import tree_leaves  # the order jit flattens in

    gm = jitted.graph(*args)
    wrapped = [Floor(x) for x in tree_leaves(args) if isinstance(x, torch.Tensor)]
    fn = lambda: gm(*wrapped)  # noqa: E731
    try:
        fn()
    except Exception as e:  # an op the do-nothing wrapper cannot pass through
        print(f"floor n/a: {type(e).__name__}: {e}", file=sys.stderr)
        return None
    return fn


# ==================================================================================================
# Workloads. Each returns a dict: name, ours_fn / theirs_fn (the same math through our transforms
# and torch.func, called as fn(*args)), args, hand (explicit batched code) and optionally loop.


def case_per_sample(B):
    """(a) per-sample gradients of a 784-128-128-10 MLP."""
    g = torch.Generator().manual_seed(0)
    sizes = [784, 128, 128, 10]
    params = {}
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        params[f"w{i}"] = _randn(b, a, g=g) / a**0.5
        params[f"b{i}"] = torch.zeros(b, device=DEVICE)
    xs = _randn(B, 784, g=g)
    ys = torch.randint(0, 10, (B,), generator=g).to(DEVICE)

    def loss(p, x, y):
        h = F.relu(F.linear(x, p["w0"], p["b0"]))
        h = F.relu(F.linear(h, p["w1"], p["b1"]))
        out = F.linear(h, p["w2"], p["b2"])
        return F.cross_entropy(out.unsqueeze(0), y.unsqueeze(0))

    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}

    def loop():
        return [
            torch.autograd.grad(loss(leaves, xs[i], ys[i]), list(leaves.values()))
            for i in range(xs.shape[0])
        ]

    def hand():  # explicit batched backprop
        p = params
        z0 = F.linear(xs, p["w0"], p["b0"])
        h0 = F.relu(z0)
        z1 = F.linear(h0, p["w1"], p["b1"])
        h1 = F.relu(z1)
        out = F.linear(h1, p["w2"], p["b2"])
        d2 = torch.softmax(out, -1) - F.one_hot(ys, 10).to(out.dtype)  # [N, 10]
        d1 = (d2 @ p["w2"]) * (z1 > 0)
        d0 = (d1 @ p["w1"]) * (z0 > 0)
        return {
            "w2": d2[:, :, None] * h1[:, None, :],
            "b2": d2,
            "w1": d1[:, :, None] * h0[:, None, :],
            "b1": d1,
            "w0": d0[:, :, None] * xs[:, None, :],
            "b0": d0,
        }

    return dict(
        name=f"(a) per-sample grads, MLP 784-128-128-10, B={B}",
        key=f"per_sample_mlp_B{B}",
        ours_fn=ft.vmap(ft.grad(loss), in_dims=(None, 0, 0)),
        theirs_fn=tf.vmap(tf.grad(loss), in_dims=(None, 0, 0)),
        args=(params, xs, ys),
        hand=hand,
        loop=loop if B <= 64 else None,
    )


class SimpleCNN(nn.Module):
    """The torch.func per-sample-gradients tutorial's CNN (MNIST-shaped input)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = torch.flatten(F.max_pool2d(x, 2), 1)
        x = F.relu(self.fc1(x))
        return F.log_softmax(self.fc2(x), dim=1)


def case_cnn(B=64):
    """(a) per-sample gradients of the tutorial CNN (needs convolution derivative rules)."""
    torch.manual_seed(0)
    model = SimpleCNN().to(DEVICE)
    params = {k: v.detach() for k, v in model.named_parameters()}
    g = torch.Generator().manual_seed(0)
    xs = _randn(B, 1, 28, 28, g=g)
    ys = torch.randint(0, 10, (B,), generator=g).to(DEVICE)

    def make(lib):
        def loss(p, x, y):
            out = lib.functional_call(model, p, (x.unsqueeze(0),))
            return F.nll_loss(out, y.unsqueeze(0))

        return lib.vmap(lib.grad(loss), in_dims=(None, 0, 0))

    return dict(
        name=f"(a) per-sample grads, tutorial CNN, B={B}",
        key=f"per_sample_cnn_B{B}",
        ours_fn=make(ft),
        theirs_fn=make(tf),
        args=(params, xs, ys),
        hand=lambda: cnn_per_sample_grads(params, xs, ys),
    )


def cnn_per_sample_grads(p, x, y):
    """SimpleCNN's per-sample gradients by explicit batched backprop (public torch ops): each
    convolution's per-sample weight gradient is one grouped weight gradient
    (``torch.nn.grad.conv2d_weight`` with the batch folded into the channels, groups=B; 2.6x
    faster here than a batched matmul with the unfolded input, im2col). Most of the time of
    every implementation is writing fc1's per-sample gradient, [B, 128, 9216] floats: 302 MB
    at B=64, a fresh buffer per call (faulting its pages in costs ~7x the multiply)."""
    B = x.shape[0]
    w1, w2, w3, w4 = (p[f"{n}.weight"] for n in ("conv1", "conv2", "fc1", "fc2"))
    h1 = F.conv2d(x, w1, p["conv1.bias"])  # [B, 32, 26, 26]
    a1 = torch.relu(h1)
    h2 = F.conv2d(a1, w2, p["conv2.bias"])  # [B, 64, 24, 24]
    a2 = torch.relu(h2)
    pooled, idx = F.max_pool2d(a2, 2, return_indices=True)  # [B, 64, 12, 12]
    f = pooled.flatten(1)  # [B, 9216]
    h3 = torch.addmm(p["fc1.bias"], f, w3.T)
    a3 = torch.relu(h3)
    z = torch.addmm(p["fc2.bias"], a3, w4.T)
    gz = torch.softmax(z, 1)  # d(-log_softmax(z)[y]) / dz = softmax(z) - onehot(y)
    gz[torch.arange(B, device=z.device), y] -= 1
    gh3 = torch.where(h3 > 0, gz @ w4, 0.0)
    gf = gh3 @ w3
    gp = F.max_unpool2d(gf.view(pooled.shape), idx, 2, output_size=a2.shape[-2:])
    gh2 = torch.where(h2 > 0, gp, 0.0)
    gh1 = torch.where(h1 > 0, F.conv_transpose2d(gh2, w2), 0.0)

    def per_sample_weight_grad(inp, w, g):  # batch folded into channels, one group each
        fold = lambda t: t.reshape(1, -1, *t.shape[2:])  # noqa: E731
        gw = torch.nn.grad.conv2d_weight(
            fold(inp), (B * w.shape[0], *w.shape[1:]), fold(g), groups=B
        )
        return gw.view(B, *w.shape)

    return {
        "conv1.weight": per_sample_weight_grad(x, w1, gh1),
        "conv1.bias": gh1.sum((2, 3)),
        "conv2.weight": per_sample_weight_grad(a1, w2, gh2),
        "conv2.bias": gh2.sum((2, 3)),
        "fc1.weight": gh3[:, :, None] * f[:, None, :],
        "fc1.bias": gh3,
        "fc2.weight": gz[:, :, None] * a3[:, None, :],
        "fc2.bias": gz,
    }


def case_jac(mode):
    """(b) jacrev / jacfwd of tanh(W x), R^256 -> R^256."""
    g = torch.Generator().manual_seed(1)
    W = _randn(256, 256, g=g) / 16
    x = _randn(256, g=g)
    f = lambda x: torch.tanh(W @ x)  # noqa: E731
    xl = x.clone().requires_grad_()

    def loop():
        y = f(xl)
        return torch.stack(
            [torch.autograd.grad(y[i], xl, retain_graph=True)[0] for i in range(256)]
        )

    return dict(
        name=f"(b) {mode} of tanh(W x), 256->256",
        key=mode,
        ours_fn=getattr(ft, mode)(f),
        theirs_fn=getattr(tf, mode)(f),
        args=(x,),
        hand=lambda: (1 - torch.tanh(W @ x) ** 2)[:, None] * W,
        loop=loop,
    )


def case_vmap_jacrev(B=64, n=32):
    """(b) batched Jacobians: vmap(jacrev(tanh(W x))) over B points in R^n."""
    g = torch.Generator().manual_seed(4)
    W = _randn(n, n, g=g) / n**0.5
    xs = _randn(B, n, g=g)
    f = lambda x: torch.tanh(W @ x)  # noqa: E731
    return dict(
        name=f"(b) vmap(jacrev) of tanh(W x), B={B}, {n}->{n}",
        key="vmap_jacrev",
        ours_fn=ft.vmap(ft.jacrev(f)),
        theirs_fn=tf.vmap(tf.jacrev(f)),
        args=(xs,),
        hand=lambda: (1 - torch.tanh(xs @ W.T) ** 2)[:, :, None] * W,
    )


def _hess_problem():
    g = torch.Generator().manual_seed(2)
    A = _randn(128, 128, g=g) / 11
    x = _randn(128, g=g)
    v = _randn(128, g=g)
    f = lambda x: (torch.sin(x) * (A @ x)).sum() + x.pow(3).sum()  # noqa: E731
    return A, x, v, f


def case_hessian():
    """(c) hessian of a scalar function of 128 inputs."""
    A, x, v, f = _hess_problem()
    xl = x.clone().requires_grad_()

    def loop():
        (gx,) = torch.autograd.grad(f(xl), xl, create_graph=True)
        return torch.stack(
            [torch.autograd.grad(gx[i], xl, retain_graph=True)[0] for i in range(128)]
        )

    def hand():  # H = diag(-sin(x) * Ax + 6x) + diag(cos x) A + A^T diag(cos x)
        c = torch.cos(x)
        return torch.diag(-torch.sin(x) * (A @ x) + 6 * x) + c[:, None] * A + A.T * c[None, :]

    return dict(
        name="(c) hessian, scalar f of 128 inputs",
        key="hessian",
        ours_fn=ft.hessian(f),
        theirs_fn=tf.hessian(f),
        args=(x,),
        hand=hand,
        loop=loop,
    )


def case_hvp():
    """(d) Hessian-vector product jvp(grad(f))."""
    A, x, v, f = _hess_problem()
    xl = x.clone().requires_grad_()

    def loop():  # double backward, the classic eager hvp
        (gx,) = torch.autograd.grad(f(xl), xl, create_graph=True)
        return torch.autograd.grad(gx, xl, v)[0]

    def hand():
        c = torch.cos(x)
        return (-torch.sin(x) * (A @ x) + 6 * x) * v + c * (A @ v) + A.T @ (c * v)

    return dict(
        name="(d) hvp jvp(grad(f)), 128 inputs",
        key="hvp",
        ours_fn=lambda x, v: ft.jvp(ft.grad(f), (x,), (v,))[1],
        theirs_fn=lambda x, v: tf.jvp(tf.grad(f), (x,), (v,))[1],
        args=(x, v),
        hand=hand,
        loop=loop,
    )


def pointwise20(x):
    y = torch.sin(x)
    y = y * 2.0
    y = y + x
    y = torch.cos(y)
    y = torch.exp(y)
    y = y - 1.0
    y = torch.tanh(y)
    y = y * y
    y = torch.sigmoid(y)
    y = y + 0.5
    y = torch.log(y)
    y = torch.abs(y)
    y = torch.sqrt(y + 1.0)
    y = y / 3.0
    y = torch.relu(y)
    y = y.neg()
    y = torch.exp(y)
    y = y * x
    y = torch.sin(y)
    return y  # 20 ops


def case_pointwise():
    """(e) vmap of a 20-op pointwise function on (64, 8)."""
    x = _randn(64, 8, g=torch.Generator().manual_seed(3))
    return dict(
        name="(e) vmap, 20 pointwise ops, (64, 8)",
        key="pointwise20",
        ours_fn=ft.vmap(pointwise20),
        theirs_fn=tf.vmap(pointwise20),
        args=(x,),
        hand=lambda: pointwise20(x),
        loop=lambda: torch.stack([pointwise20(x[i]) for i in range(64)]),
    )


def case_ensemble(M=10, B=64):
    """(g) a 10-model ensemble (torch.func tutorial): vmap(functional_call) over stacked params."""
    torch.manual_seed(5)
    models = [
        nn.Sequential(nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10)).to(DEVICE)
        for _ in range(M)
    ]
    params, buffers = tf.stack_module_state(models)
    params = {k: v.detach() for k, v in params.items()}
    base = models[0]
    x = _randn(B, 784, g=torch.Generator().manual_seed(5))

    def make(lib):
        return lib.vmap(
            lambda p, b, x: lib.functional_call(base, (p, b), (x,)), in_dims=(0, 0, None)
        )

    def hand():
        h = torch.relu(
            torch.baddbmm(params["0.bias"][:, None], x.expand(M, B, 784), params["0.weight"].mT)
        )
        return torch.baddbmm(params["2.bias"][:, None], h, params["2.weight"].mT)

    return dict(
        name=f"(g) ensemble of {M} MLPs 784-128-10, B={B}",
        key="ensemble10",
        ours_fn=make(ft),
        theirs_fn=make(tf),
        args=(params, buffers, x),
        hand=hand,
    )


def _attn_inputs(B=32, T=16, d=32):
    g = torch.Generator().manual_seed(6)
    return _randn(B, T, d, g=g), _randn(B, T, d, g=g), _randn(B, T, d, g=g)


def attention(q, k, v):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    p = torch.exp(s - s.amax(-1, keepdim=True))
    return (p / p.sum(-1, keepdim=True)) @ v


def case_attention(sdpa):
    """(h) per-example attention, vmapped: explicit softmax or F.scaled_dot_product_attention."""
    q, k, v = _attn_inputs()
    f = F.scaled_dot_product_attention if sdpa else attention
    return dict(
        name=f"(h) vmap attention, {'sdpa' if sdpa else 'explicit softmax'}, B=32 T=16 d=32",
        key="attention_sdpa" if sdpa else "attention",
        ours_fn=ft.vmap(f),
        theirs_fn=tf.vmap(f),
        args=(q, k, v),
        hand=lambda: f(q, k, v),
    )


def case_solve(B=64, n=8):
    """(i) vmapped linear solve."""
    g = torch.Generator().manual_seed(7)
    A = _randn(B, n, n, g=g) + n * torch.eye(n, device=DEVICE)
    b = _randn(B, n, g=g)
    return dict(
        name=f"(i) vmap solve, B={B}, {n}x{n}",
        key="vmap_solve",
        ours_fn=ft.vmap(torch.linalg.solve),
        theirs_fn=tf.vmap(torch.linalg.solve),
        args=(A, b),
        hand=lambda: torch.linalg.solve(A, b),
    )


def all_cases():
    return [
        lambda: case_per_sample(8),
        lambda: case_per_sample(64),
        lambda: case_per_sample(512),
        lambda: case_cnn(64),
        lambda: case_jac("jacrev"),
        lambda: case_jac("jacfwd"),
        lambda: case_vmap_jacrev(),
        case_hessian,
        case_hvp,
        case_pointwise,
        case_ensemble,
        lambda: case_attention(False),
        lambda: case_attention(True),
        case_solve,
    ]


def _max_err(a, b):
    from functransforms._pytree import tree_leaves  # sorts dict keys

    la = [x for x in tree_leaves(a) if isinstance(x, torch.Tensor)]
    lb = [x for x in tree_leaves(b) if isinstance(x, torch.Tensor)]
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(la, lb))


def run_case(make, repeats, inductor, only=None):
    c = make()
    if only and only not in c["key"]:
        return None
    args = c["args"]
    row = {"workload": c["name"], "key": c["key"]}
    ours = lambda: c["ours_fn"](*args)  # noqa: E731
    theirs = lambda: c["theirs_fn"](*args)  # noqa: E731
    try:
        ref = theirs()
        err = _max_err(ours(), ref)
    except Exception as e:  # a missing rule: report the row as n/a
        row["na"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        return row
    jitted = ft.jit(c["ours_fn"])
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        err = max(err, _max_err(jitted(*args), ref))
    row["trace_s"] = time.perf_counter() - t0
    row["jit_fallback"] = [
        str(w.message)[:200] for w in rec if "JitFallback" in type(w.message).__name__
    ]
    err = max(err, _max_err(jitted(*args), ref))
    if c.get("hand") is not None:
        err = max(err, _max_err(c["hand"](), ref))
    row["max_abs_err"] = err
    fl = floor_fn(jitted, args) if not row["jit_fallback"] else None
    jit_call = lambda: jitted(*args)  # noqa: E731
    t = interleaved(
        {"ours": ours, "jit": jit_call, "torch_func": theirs, "hand": c.get("hand"), "floor": fl},
        repeats,
    )
    row.update({f"{k}_ms": (v * 1e3 if v is not None else None) for k, v in t.items()})
    if c.get("loop") is not None:
        row["loop_ms"] = median_time(c["loop"], max(3, repeats // 3)) * 1e3
    if inductor:
        try:
            # torch.compile of `tf.vmap(f)` shares one code object across rows: without a
            # reset, dynamo's recompile limit would silently run later rows eagerly.
            torch._dynamo.reset()
            ours_c = ft.jit(c["ours_fn"], backend="inductor")
            theirs_c = torch.compile(c["theirs_fn"])
            t0 = time.perf_counter()
            err = max(err, _max_err(ours_c(*args), ref), _max_err(ours_c(*args), ref))
            row["inductor_compile_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            err = max(err, _max_err(theirs_c(*args), ref), _max_err(theirs_c(*args), ref))
            row["torch_compile_compile_s"] = time.perf_counter() - t0
            row["max_abs_err"] = err
            ti = interleaved(
                {"jit_inductor": lambda: ours_c(*args), "torch_compile": lambda: theirs_c(*args)},
                repeats,
            )
            row.update({f"{k}_ms": v * 1e3 for k, v in ti.items()})
        except Exception as e:
            row["inductor_na"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return row


# The performance targets (CONTRIBUTING.md, "Benchmarks and performance targets"): ratios to
# torch.func eager unless stated.
def targets(row):
    out = {}
    if "na" in row:
        return out
    tf_ms, hand = row["torch_func_ms"], row.get("hand_ms")
    out["eager"] = (row["ours_ms"] / tf_ms, 1.3)
    strict = row["key"] in ("per_sample_mlp_B8", "hessian")
    jit_r = row["jit_ms"] / tf_ms
    if hand is not None and hand / tf_ms > 0.6:  # even hand-written code cannot reach 0.6
        out["jit"] = (row["jit_ms"] / hand, 1.1, "x hand-written")
    else:
        out["jit"] = (jit_r, 0.4 if strict else 0.6)
    if "jit_inductor_ms" in row:
        out["inductor"] = (row["jit_inductor_ms"] / row["torch_compile_ms"], 1.0)
    return out


# -- cold start ------------------------------------------------------------------------------------
_COLD = {
    "import functransforms": "import functransforms as ft",
    "import + first grad": (
        "import functransforms as ft; ft.grad(lambda x: x.sin().sum())(torch.randn(3))"
    ),
    "import + first vmap(grad)": (
        "import functransforms as ft; ft.vmap(ft.grad(lambda x: x.sin().sum()))(torch.randn(2, 3))"
    ),
    # target: import + first jit call <= 300 ms (a static-shape trace; benchmarks/bench_jax.py
    # times it on the per-sample-gradient MLP beside jax.jit's first call)
    "import + first jit(vmap(grad))": (
        "import functransforms as ft; "
        "ft.jit(ft.vmap(ft.grad(lambda x: x.sin().sum())))(torch.randn(2, 3))"
    ),
    "torch.func first grad": (
        "import torch.func as tf; tf.grad(lambda x: x.sin().sum())(torch.randn(3))"
    ),
    # The first op of a do-nothing subclass: torch's C++ __torch_dispatch__ path imports
    # torch.distributed.tensor (and with it sympy) at the first subclass op.
    "subclass floor": (
        "class W(torch.Tensor):\n"
        "    @classmethod\n"
        "    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):\n"
        "        return func(args[0].v)\n"
        "w = torch.Tensor._make_wrapper_subclass(W, (3,)); w.v = torch.randn(3); torch.sin(w)"
    ),
    "import torch.distributed.tensor": "import torch.distributed.tensor",
}


# Note [Cold start and torch's garbage]: ``import torch`` leaves ~166k objects for the garbage
# collector's oldest generation and the generation counters just below the point where CPython
# runs a full (generation-2) collection: the ~12k-th container object allocated after it
# (by any code) triggers a collection over torch's whole heap, ~70-80 ms of CPU. Whichever
# statement crosses that point pays it, so the table gives it as a column of its own (timed
# by a gc callback): "without it" is what the statement costs on its own.
_GC_PROBE = (
    "import gc\n"
    "_gc = [0.0, 0, 0.0]\n"
    "def _gc_cb(phase, info):\n"
    "    if info['generation'] != 2:\n"
    "        return\n"
    "    if phase == 'start':\n"
    "        _gc[2] = time.process_time()\n"
    "    else:\n"
    "        _gc[0] += time.process_time() - _gc[2]; _gc[1] += 1\n"
    "gc.callbacks.append(_gc_cb)\n"
)


# target: <= 100 ms each (the first transform call of a process, whichever it is)
_COLD_TARGETS = ("import functransforms", "import + first grad", "import + first vmap(grad)")
_COLD_JIT_TARGETS = ("import + first jit(vmap(grad))",)  # <= 300 ms


def cold_start(runs=7):
    """Per statement of ``_COLD``, medians over fresh processes: wall and CPU time after
    ``import torch``, the CPU time of full garbage collections inside it (Note [Cold start and
    torch's garbage]) and how many ran."""
    # As installed: with bytecode caches (this machine sets PYTHONDONTWRITEBYTECODE, which would
    # make every run compile the library's sources, ~0.2 s); one unmeasured run writes them.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    out = {}
    for name, stmt in _COLD.items():
        code = (
            f"import time, torch\n{_GC_PROBE}t0, c0 = time.perf_counter(), time.process_time()\n"
            f"{stmt}\nprint(time.perf_counter() - t0, time.process_time() - c0, *_gc[:2])\n"
        )
        samples = []
        for i in range(runs + 1):
            r = subprocess.run(
                [sys.executable, "-c", code],
                capture_output=True,
                text=True,
                check=True,
                env=env,
                cwd=_ROOT,  # `python -c` imports functransforms from here
            )
            if i:
                samples.append(tuple(map(float, r.stdout.strip().splitlines()[-1].split())))
        wall, cpu, gc_cpu, n_full = (statistics.median(col) for col in zip(*samples))
        out[name] = {"wall": wall, "cpu": cpu, "full_gc_cpu": gc_cpu, "full_gcs": n_full}
    return out


# -- jit overheads ---------------------------------------------------------------------------------
def jit_overheads(repeats):
    x = torch.randn(8, device=DEVICE)
    j = ft.jit(torch.sin)
    j(x)
    t = interleaved({"eager": lambda: torch.sin(x), "jit": lambda: j(x)}, repeats * 3)
    per_call = t["jit"] - t["eager"]
    # A new signature of the per-sample-gradient workload, after the first trace.
    c = case_per_sample(64)
    jitted = ft.jit(c["ours_fn"])
    params, xs, ys = c["args"]
    jitted(params, xs, ys)
    traces = []
    for B in (9, 10, 11, 12, 13, 14, 15):
        t0 = _clock()
        jitted(params, xs[:B], ys[:B])
        traces.append(_clock() - t0)
    return per_call, statistics.median(traces)


# -- dispatch overhead per op per level ------------------------------------------------------------
def dispatch_overhead(repeats):
    x = torch.randn(8, device=DEVICE)
    xb = torch.randn(4, 8, device=DEVICE)
    v = torch.randn(8, device=DEVICE)

    def sins(x):
        for _ in range(100):
            x = torch.sin(x)
        return x

    def ssum(x):
        return sins(x).sum()

    plain = median_time(lambda: sins(x), repeats)
    rows = {}
    for name, lib in (("ours", ft), ("torch.func", tf)):
        t = interleaved(
            {
                "vmap": lambda lib=lib: lib.vmap(sins)(xb),
                "grad": lambda lib=lib: lib.grad(ssum)(x),
                "jvp": lambda lib=lib: lib.jvp(sins, (x,), (v,)),
            },
            repeats,
        )
        for lvl, tt in t.items():
            rows[(lvl, name)] = (tt - plain) / 100
    return plain / 100, rows


def per_op_dispatch(repeats):
    """Per-op cost of ``sin`` and ``mm`` under vmap, grad and vmap(grad): (time of 100 ops under
    the transform - 100 plain ops on the same per-example values) / 100, in seconds. grad counts
    the forward op and its backward rule; vmap(grad) the same, batched (batch 4)."""
    g = torch.Generator().manual_seed(0)
    x, xb = _randn(8, g=g), _randn(4, 8, g=g)
    m, mb = _randn(4, 4, g=g) * 0.3, _randn(4, 4, 4, g=g) * 0.3
    w = _randn(4, 4, g=g) * 0.3

    def sins(x):
        for _ in range(100):
            x = torch.sin(x)
        return x

    def mms(x):
        for _ in range(100):
            x = torch.mm(x, w)
        return x

    out = {}
    for op, f, a, ab in (("sin", sins, x, xb), ("mm", mms, m, mb)):
        loss = lambda v, f=f: f(v).sum()  # noqa: E731
        t = interleaved(
            {
                "plain": lambda f=f, a=a: f(a),
                "vmap": lambda f=f, ab=ab: ft.vmap(f)(ab),
                "grad": lambda loss=loss, a=a: ft.grad(loss)(a),
                "vmap(grad)": lambda loss=loss, ab=ab: ft.vmap(ft.grad(loss))(ab),
            },
            repeats,
        )
        for k in ("vmap", "grad", "vmap(grad)"):
            out[(op, k)] = (t[k] - t["plain"]) / 100
    return out


def render_per_op(per_op):
    lines = [
        "| op | vmap (us/op) | grad (us/op) | vmap(grad) (us/op) |",
        "|---|---:|---:|---:|",
    ]
    for op in ("sin", "mm"):
        cells = " | ".join(f"{per_op[(op, k)] * 1e6:.1f}" for k in ("vmap", "grad", "vmap(grad)"))
        lines.append(f"| {op} | {cells} |")
    return "\n".join(lines)


def render_eager(rows):
    """The eager columns only: ours and the do-nothing subclass floor against torch.func."""
    lines = [
        "| workload | ours (ms) | torch.func (ms) | subclass floor (ms) "
        "| ours / torch.func (<= 1.3) | floor / torch.func |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        if "na" in row:
            lines.append(f"| {row['workload']} | n/a: {row['na']} | | | | |")
            continue
        tf_ms, fl = row["torch_func_ms"], row.get("floor_ms")
        lines.append(
            f"| {row['workload']} | {_ms(row['ours_ms'])} | {_ms(tf_ms)} | {_ms(fl)} | "
            f"{row['ours_ms'] / tf_ms:.2f} | {'-' if fl is None else f'{fl / tf_ms:.2f}'} |"
        )
    return "\n".join(lines)


def _ms(t):
    return "-" if t is None else f"{t:.3f}"


def _verdict(r, limit):
    return "met" if r <= limit else "MISSED"


def render(rows, cold, per_call, trace_s, plain, ov, inductor):
    lines = [
        "| workload | ours (ms) | jit (ms) | torch.func (ms) | hand-written (ms) "
        "| subclass floor (ms) | Python loop (ms) | ours / torch.func (<= 1.3) "
        "| jit / torch.func (<= 0.6) | jit target | max abs err |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    eager_ratios = []
    for row in rows:
        if "na" in row:
            lines.append(f"| {row['workload']} | n/a: {row['na']} | | | | | | | | | |")
            continue
        tg = targets(row)
        er, _ = tg["eager"]
        eager_ratios.append(er)
        jr = row["jit_ms"] / row["torch_func_ms"]
        jt = tg["jit"]
        jtxt = f"{jt[0]:.2f}{jt[2] if len(jt) > 2 else ''} <= {jt[1]}: {_verdict(jt[0], jt[1])}"
        if row.get("jit_fallback"):
            jtxt += " (eager fallback!)"
        lines.append(
            f"| {row['workload']} | {_ms(row['ours_ms'])} | {_ms(row['jit_ms'])} | "
            f"{_ms(row['torch_func_ms'])} | {_ms(row.get('hand_ms'))} | "
            f"{_ms(row.get('floor_ms'))} | {_ms(row.get('loop_ms'))} | {er:.2f} | {jr:.2f} | "
            f"{jtxt} | {row['max_abs_err']:.1e} |"
        )
    gm = (
        math.exp(sum(map(math.log, eager_ratios)) / len(eager_ratios))
        if eager_ratios
        else float("nan")
    )
    lines += [
        "",
        f"Geometric mean of ours / torch.func (eager): {gm:.2f} (target <= 1.0); "
        f"largest: {max(eager_ratios, default=float('nan')):.2f} (target <= 1.3).",
        "",
    ]
    if inductor:
        lines += [
            '`backend="inductor"` vs `torch.compile` of the same torch.func code '
            "(steady state; compile times in the JSON):",
            "",
            "| workload | jit inductor (ms) | torch.compile (ms) | ratio (<= 1.0) |",
            "|---|---:|---:|---|",
        ]
        for row in rows:
            if "na" in row:
                continue
            if "inductor_na" in row:
                lines.append(f"| {row['workload']} | n/a: {row['inductor_na']} | | |")
                continue
            r = row["jit_inductor_ms"] / row["torch_compile_ms"]
            lines.append(
                f"| {row['workload']} | {_ms(row['jit_inductor_ms'])} | "
                f"{_ms(row['torch_compile_ms'])} | {r:.2f} {_verdict(r, 1.0)} |"
            )
        lines.append("")
    lines += [
        f"jit per-call overhead over calling a one-op f eagerly (`jit(torch.sin)(x)`, x of 8 "
        f"floats): {per_call * 1e6:.1f} us (target <= 10 us: {_verdict(per_call, 10e-6)}). "
        f"Tracing a new signature of the per-sample-gradient workload after the first trace "
        f"(median of 7 batch sizes, CPU time): {trace_s * 1e3:.0f} ms (target <= 150 ms: "
        f"{_verdict(trace_s, 0.150)}).",
        "",
        "Cold start (fresh subprocesses, after `import torch`; median of 7 runs). The first "
        "full garbage collection of the process, over torch's ~166k objects, runs inside "
        "whichever statement allocates the ~12k-th object after `import torch` (Note [Cold "
        "start and torch's garbage], bench_core.py); its CPU time is its own column, and "
        '"without it" is what the statement costs on its own:',
        "",
        "| | wall time (ms) | CPU time (ms) | of which full GC (ms) | CPU without it (ms) "
        "| target <= 100 ms (CPU) |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for k, c in cold.items():
        target = _verdict(c["cpu"], 0.100) if k in _COLD_TARGETS else ""
        if k in _COLD_JIT_TARGETS:
            target = f"{_verdict(c['cpu'], 0.300)} (<= 300 ms)"
        lines.append(
            f"| {k} | {c['wall'] * 1e3:.1f} | {c['cpu'] * 1e3:.1f} | "
            f"{c['full_gc_cpu'] * 1e3:.1f} | {(c['cpu'] - c['full_gc_cpu']) * 1e3:.1f} | "
            f"{target} |"
        )
    lines += [
        "",
        f"Dispatch overhead per op per level (100 `sin` ops on a size-8 tensor, batch 4 for "
        f"vmap; (time under transform - plain time) / 100; plain op = {plain * 1e6:.1f} us):",
        "",
        "| level | ours (us/op) | torch.func (us/op) | ours / torch.func |",
        "|---|---:|---:|---:|",
    ]
    for lvl in ("vmap", "grad", "jvp"):
        o, t = ov[(lvl, "ours")], ov[(lvl, "torch.func")]
        lines.append(f"| {lvl} | {o * 1e6:.1f} | {t * 1e6:.1f} | {o / t:.2f} |")
    return "\n".join(lines), gm


BEGIN, END = "<!-- bench_core: generated -->", "<!-- bench_core: end -->"


def _kept_sections(path):
    """The hand-written sections after the generated table (kept verbatim)."""
    try:
        old = open(path).read()
    except FileNotFoundError:
        return ""
    if END in old:
        rest = old.split(END, 1)[1]
    else:
        i = old.find("\n## ")
        rest = old[i:] if i >= 0 else ""
    return rest.lstrip("\n") and "\n" + rest.lstrip("\n")


def main(argv=None):
    global DEVICE
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    ap.add_argument("--no-inductor", action="store_true", help="skip the torch.compile columns")
    ap.add_argument("--only", default=None, help="run the workloads whose key contains this")
    ap.add_argument("--out", default=None, help="write the report (markdown) to this file")
    ap.add_argument(
        "--per-op",
        action="store_true",
        help="only the per-op dispatch cost of sin and mm under vmap, grad and vmap(grad)",
    )
    ap.add_argument(
        "--eager-rows",
        action="store_true",
        help="only the eager columns of the workload rows (ours, torch.func, subclass floor), "
        "as a markdown table; no jit/inductor columns, cold start or overheads",
    )
    ns = ap.parse_args(argv)
    torch.set_num_threads(1)
    if ns.eager_rows:
        rows = [run_case(m, 5 if ns.quick else 21, False, ns.only) for m in all_cases()]
        print(render_eager([r for r in rows if r is not None]))
        return
    if ns.per_op:
        per_op = per_op_dispatch(21 if ns.quick else 61)
        print(json.dumps({f"{op}/{k}": v * 1e6 for (op, k), v in per_op.items()}))
        print(render_per_op(per_op))
        return
    r = 5 if ns.quick else 21
    inductor = not ns.no_inductor
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    report = {}
    sections = []
    for dev in devices:
        DEVICE = dev
        rows = []
        for make in all_cases():
            row = run_case(make, r, inductor, ns.only)
            if row is None:
                continue
            row["targets"] = {k: list(v) for k, v in targets(row).items()}
            rows.append(row)
            print(json.dumps(row), flush=True)
        per_call, trace_s = jit_overheads(r)
        cold = cold_start(7) if dev == "cpu" else {}
        plain, ov = dispatch_overhead(r * 2 + 1)
        table, gm = render(rows, cold, per_call, trace_s, plain, ov, inductor)
        print("\n" + table, flush=True)
        sections.append((dev, table))
        report[dev] = {
            "rows": rows,
            "eager_geomean": gm,
            "jit_per_call_overhead_us": per_call * 1e6,
            "jit_new_signature_trace_ms": trace_s * 1e3,
            "cold_start_ms": {
                k: {f: (v * 1e3 if f != "full_gcs" else v) for f, v in c.items()}
                for k, c in cold.items()
            },
            "dispatch_overhead_us_per_op": {
                f"{lvl}/{lib}": v * 1e6 for (lvl, lib), v in ov.items()
            },
        }

    if ns.out:
        cmd = (
            "python benchmarks/bench_core.py"
            + (" --quick" if ns.quick else "")
            + (" --no-inductor" if ns.no_inductor else "")
            + f" --out {ns.out}"
        )
        meta = {
            "command": cmd,
            "date": datetime.date.today().isoformat(),
            "machine": f"{platform.machine()}, nproc = {os.cpu_count()}",
            "python": platform.python_version(),
            "torch": torch.__version__,
            "threads": 1,
            "repeats": r,
            "load_average_end": os.getloadavg()[0],
        }
        header = (
            "# Performance\n\n"
            "Generated by\n\n"
            f"    {cmd}\n\n"
            f"- date: {meta['date']}\n"
            f"- machine: {meta['machine']}, {platform.python_implementation()} "
            f"{meta['python']}, torch {meta['torch']}, torch.set_num_threads(1), "
            f"load average at the end of the run: {meta['load_average_end']:.1f}\n"
            f"- every time is the median over {r} interleaved rounds (each sample averages enough "
            "calls to last ~2 ms) of the CPU time of the calling thread (one torch thread, so "
            "all kernels run on it; time preempted by other processes on the shared machine is "
            "not counted; cold start: wall and CPU time); float32. Machine-readable: "
            f"[{os.path.basename(os.path.splitext(ns.out)[0])}.json]"
            f"({os.path.basename(os.path.splitext(ns.out)[0])}.json).\n"
            "- ours: eager functransforms; jit: `ft.jit(<the same transformed function>)`, the "
            "recorded ATen graph replayed op by op; hand-written: explicit batched formulas; "
            "subclass floor: the workload's own ATen ops (its jit graph) replayed on a "
            "do-nothing `__torch_dispatch__` wrapper, the least any eager subclass design pays; "
            "Python loop: one eager `torch.autograd` call per example / row.\n"
            '- targets (CONTRIBUTING.md, "Benchmarks and performance targets"): '
            "eager ours / torch.func <= 1.3 per row, geometric mean <= 1.0; "
            "jit / torch.func <= 0.6 per row and <= 0.4 for per-sample grads B=8 and hessian, or "
            "<= 1.1x hand-written where hand-written code itself is above 0.6 of torch.func; "
            "jit inductor / torch.compile <= 1.0; jit per-call overhead <= 10 us; a new "
            "signature traces in <= 150 ms; import and first call <= 100 ms each.\n\n"
        )
        body = "\n\n".join(
            (f"## {dev}\n\n" if len(sections) > 1 else "") + t for dev, t in sections
        )
        os.makedirs(os.path.dirname(ns.out) or ".", exist_ok=True)
        kept = _kept_sections(ns.out)  # read before open(..., "w") truncates the file
        with open(ns.out, "w") as fh:
            fh.write(header + BEGIN + "\n" + body + "\n" + END + "\n" + kept)
        with open(os.path.splitext(ns.out)[0] + ".json", "w") as fh:
            json.dump({"meta": meta, **report}, fh, indent=1, default=str)
        print(f"\nwrote {ns.out} and its .json")


if __name__ == "__main__":
    main()
