"""functransforms (eager, jit, jit inductor) vs torch.func vs jax.jit, side by side on CPU.

    pip install -e '.[jax]'     # jax and jaxlib, CPU
    python benchmarks/bench_jax.py [--quick] [--no-inductor] [--only KEY]
    python benchmarks/bench_jax.py --cold       # only the cold-start table (fresh processes)
    python benchmarks/bench_jax.py --out docs/performance-jax.md

One process, one thread for both libraries (``torch.set_num_threads(1)``; XLA's CPU client
without its multi-threaded Eigen and with one intra-op thread), the same inputs converted to
JAX arrays, every result checked against jax's (max relative error column). Times are medians
of CPU time over interleaved rounds (one sample of every column per round). The process's CPU
time, not the calling thread's: XLA may run a computation on a thread of its own.

Rows whose results are large (per-sample gradients at B=512, the tutorial CNN) run twice:
with the caller dropping each result (jit then writes into the memory of a result the caller
dropped: Note [Large buffers reused across calls]) and with the caller keeping its last three
results alive, so every call of every column gets fresh memory.

Skips cleanly (exit status 0, a message) when jax is not installed.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings

# Before jax is imported: one CPU thread for XLA, CPU only, float32.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
).strip()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_core  # noqa: E402

import functransforms as ft  # noqa: E402

tf = torch.func
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_KEEP = 3  # results a "kept" row holds alive


def _jax():
    try:
        import jax
    except ImportError:
        return None
    return jax


_clock = time.process_time


def interleaved(fns, repeats, warmup=2, budget=2e-3):
    """Median seconds per call of each fn (process CPU time); one sample of each per round."""
    live = {k: f for k, f in fns.items() if f is not None}
    for _ in range(warmup):
        for f in live.values():
            f()
    number = {}
    for k, f in live.items():
        t0 = _clock()
        f()
        number[k] = max(1, min(200, int(budget / max(_clock() - t0, 1e-7))))
    samples = {k: [] for k in live}
    for _ in range(repeats):
        for k, f in live.items():
            n = number[k]
            t0 = _clock()
            for _ in range(n):
                f()
            samples[k].append((_clock() - t0) / n)
    return {k: (statistics.median(samples[k]) if k in samples else None) for k in fns}


# ==================================================================================================
# Workloads: the torch function (ours_fn through functransforms, theirs_fn through torch.func),
# its torch arguments, and the same math in JAX (jax_fn, to be jitted) on the same values.


def _np(t):
    return t.detach().cpu().numpy()


def _to_jax(jnp, tree):
    if isinstance(tree, dict):
        return {k: _to_jax(jnp, v) for k, v in tree.items()}
    if isinstance(tree, (tuple, list)):
        return type(tree)(_to_jax(jnp, v) for v in tree)
    if isinstance(tree, torch.Tensor):
        return jnp.asarray(_np(tree))
    return tree


def _jax_mlp(jnp, p, x, n):
    h = x
    for i in range(n):
        h = h @ p[f"w{i}"].T + p[f"b{i}"]
        if i < n - 1:
            h = jnp.maximum(h, 0)
    return h


def case_per_sample(jax, B):
    jnp = jax.numpy
    c = bench_core.case_per_sample(B)

    def loss(p, x, y):
        out = _jax_mlp(jnp, p, x, 3)
        return -jax.nn.log_softmax(out)[y]

    c["jax_fn"] = jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))
    return c


def case_cnn(jax, B=64):
    jnp, lax = jax.numpy, jax.lax
    c = bench_core.case_cnn(B)

    def conv(x, w, b):
        y = lax.conv_general_dilated(
            x, w, (1, 1), "VALID", dimension_numbers=("NCHW", "OIHW", "NCHW")
        )
        return y + b[None, :, None, None]

    def loss(p, x, y):
        h = x[None]
        h = jnp.maximum(conv(h, p["conv1.weight"], p["conv1.bias"]), 0)
        h = jnp.maximum(conv(h, p["conv2.weight"], p["conv2.bias"]), 0)
        h = lax.reduce_window(h, -jnp.inf, lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID")
        h = h.reshape(1, -1)
        h = jnp.maximum(h @ p["fc1.weight"].T + p["fc1.bias"], 0)
        out = jax.nn.log_softmax(h @ p["fc2.weight"].T + p["fc2.bias"], axis=1)
        return -out[0, y]

    c["jax_fn"] = jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))
    return c


def case_jac(jax, mode):
    jnp = jax.numpy
    c = bench_core.case_jac(mode)
    g = torch.Generator().manual_seed(1)
    Wt = torch.randn(256, 256, generator=g) / 16  # bench_core.case_jac's W (same seed and draws)
    Wj = jnp.asarray(_np(Wt))
    f = lambda x: jnp.tanh(Wj @ x)  # noqa: E731
    c["jax_fn"] = getattr(jax, mode)(f)
    return c


def case_hessian(jax):
    jnp = jax.numpy
    c = bench_core.case_hessian()
    A = jnp.asarray(_np(bench_core._hess_problem()[0]))
    f = lambda x: (jnp.sin(x) * (A @ x)).sum() + (x**3).sum()  # noqa: E731
    c["jax_fn"] = jax.hessian(f)
    return c


def case_hvp(jax):
    jnp = jax.numpy
    c = bench_core.case_hvp()
    A = jnp.asarray(_np(bench_core._hess_problem()[0]))
    f = lambda x: (jnp.sin(x) * (A @ x)).sum() + (x**3).sum()  # noqa: E731
    c["jax_fn"] = lambda x, v: jax.jvp(jax.grad(f), (x,), (v,))[1]
    return c


def case_ntk(jax, N=32, d=64, h=128, k=10):
    """Empirical NTK of an MLP d-h-h-k between two batches of N inputs (torch.func's tutorial:
    per-example Jacobians by vmap(jacrev), contracted over parameters)."""
    jnp = jax.numpy
    g = torch.Generator().manual_seed(8)
    sizes = [d, h, h, k]
    params = {}
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        params[f"w{i}"] = torch.randn(b, a, generator=g) / a**0.5
        params[f"b{i}"] = torch.randn(b, generator=g) * 0.1
    x1 = torch.randn(N, d, generator=g)
    x2 = torch.randn(N, d, generator=g)

    def net(p, x):  # one example: [d] -> [k]
        z = torch.tanh(F.linear(x, p["w0"], p["b0"]))
        z = torch.tanh(F.linear(z, p["w1"], p["b1"]))
        return F.linear(z, p["w2"], p["b2"])

    def make(lib):
        jac = lib.vmap(lib.jacrev(net), in_dims=(None, 0))

        def ntk(p, x1, x2):  # [N, N, k, k]
            j1, j2 = jac(p, x1), jac(p, x2)
            return sum(
                torch.einsum("Naf,Mbf->NMab", j1[n].flatten(2), j2[n].flatten(2))
                for n in sorted(j1)
            )

        return ntk

    def jnet(p, x):
        z = jnp.tanh(p["w0"] @ x + p["b0"])
        z = jnp.tanh(p["w1"] @ z + p["b1"])
        return p["w2"] @ z + p["b2"]

    jjac = jax.vmap(jax.jacrev(jnet), in_axes=(None, 0))

    def jntk(p, x1, x2):
        j1, j2 = jjac(p, x1), jjac(p, x2)
        return sum(
            jnp.einsum("Naf,Mbf->NMab", j1[n].reshape(N, k, -1), j2[n].reshape(N, k, -1))
            for n in sorted(j1)
        )

    return dict(
        name=f"(j) empirical NTK, MLP {d}-{h}-{h}-{k}, {N}x{N} inputs",
        key="ntk",
        ours_fn=make(ft),
        theirs_fn=make(tf),
        args=(params, x1, x2),
        jax_fn=jntk,
    )


def case_ensemble(jax):
    jnp = jax.numpy
    c = bench_core.case_ensemble()

    def model(p, x):
        h = jnp.maximum(x @ p["0.weight"].T + p["0.bias"], 0)
        return h @ p["2.weight"].T + p["2.bias"]

    c["jax_fn"] = lambda p, b, x: jax.vmap(model, in_axes=(0, None))(p, x)
    return c


def case_maml(jax, tasks=16, shots=10, hidden=40, inner_lr=0.01):
    """A MAML meta-gradient (JAX's MAML tutorial, sine regression): per task one inner SGD
    step on its support set, the adapted model's loss on its query set; the gradient of the
    mean query loss over 16 tasks with respect to the initial parameters (second order)."""
    jnp = jax.numpy
    g = torch.Generator().manual_seed(9)
    sizes = [1, hidden, hidden, 1]
    params = {}
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        params[f"w{i}"] = torch.randn(b, a, generator=g) / a**0.5
        params[f"b{i}"] = torch.zeros(b)
    amp = torch.rand(tasks, 1, 1, generator=g) * 4.9 + 0.1
    phase = torch.rand(tasks, 1, 1, generator=g) * 3.14
    xs = torch.rand(tasks, shots, 1, generator=g) * 10 - 5
    xq = torch.rand(tasks, shots, 1, generator=g) * 10 - 5
    ys, yq = amp * torch.sin(xs + phase), amp * torch.sin(xq + phase)

    def net(p, x):  # [n, 1] -> [n, 1]
        h = torch.relu(F.linear(x, p["w0"], p["b0"]))
        h = torch.relu(F.linear(h, p["w1"], p["b1"]))
        return F.linear(h, p["w2"], p["b2"])

    def mse(p, x, y):
        return ((net(p, x) - y) ** 2).mean()

    def make(lib):
        def task_loss(p, xs, ys, xq, yq):
            gr = lib.grad(mse)(p, xs, ys)
            adapted = {k: p[k] - inner_lr * gr[k] for k in p}
            return mse(adapted, xq, yq)

        def meta_loss(p, xs, ys, xq, yq):
            return lib.vmap(task_loss, in_dims=(None, 0, 0, 0, 0))(p, xs, ys, xq, yq).mean()

        return lib.grad(meta_loss)

    def jmse(p, x, y):
        return ((_jax_mlp(jnp, p, x, 3) - y) ** 2).mean()

    def jtask(p, xs, ys, xq, yq):
        gr = jax.grad(jmse)(p, xs, ys)
        return jmse({k: p[k] - inner_lr * gr[k] for k in p}, xq, yq)

    def jmeta(p, xs, ys, xq, yq):
        return jax.vmap(jtask, in_axes=(None, 0, 0, 0, 0))(p, xs, ys, xq, yq).mean()

    return dict(
        name=f"(k) MAML meta-gradient, MLP 1-{hidden}-{hidden}-1, {tasks} tasks x {shots} shots",
        key="maml",
        ours_fn=make(ft),
        theirs_fn=make(tf),
        args=(params, xs, ys, xq, yq),
        jax_fn=jax.grad(jmeta),
    )


def all_cases(jax):
    return [
        ("per_sample_mlp_B8", lambda: case_per_sample(jax, 8), False),
        ("per_sample_mlp_B64", lambda: case_per_sample(jax, 64), False),
        ("per_sample_mlp_B512", lambda: case_per_sample(jax, 512), False),
        ("per_sample_mlp_B512_kept", lambda: case_per_sample(jax, 512), True),
        ("per_sample_cnn_B64", lambda: case_cnn(jax, 64), False),
        ("per_sample_cnn_B64_kept", lambda: case_cnn(jax, 64), True),
        ("jacrev", lambda: case_jac(jax, "jacrev"), False),
        ("jacfwd", lambda: case_jac(jax, "jacfwd"), False),
        ("hessian", lambda: case_hessian(jax), False),
        ("hvp", lambda: case_hvp(jax), False),
        ("ntk", lambda: case_ntk(jax), False),
        ("ensemble10", lambda: case_ensemble(jax), False),
        ("maml", lambda: case_maml(jax), False),
    ]


def _leaves(tree):
    from functransforms._pytree import tree_leaves  # sorts dict keys, as jax's does

    return [x for x in tree_leaves(tree) if x is not None]


def _rel_err(ours, theirs_np):
    """max |a - b| / max(1, max |b|) over matching leaves."""
    import numpy as np

    la = [_np(x) for x in _leaves(ours)]
    if len(la) != len(theirs_np):
        raise AssertionError(f"{len(la)} result leaves, jax has {len(theirs_np)}")
    err = 0.0
    for a, b in zip(la, theirs_np):
        if a.shape != b.shape:
            raise AssertionError(f"result shape {a.shape}, jax's {b.shape}")
        scale = max(1.0, float(np.abs(b).max()) if b.size else 1.0)
        err = max(err, float(np.abs(a.astype("float64") - b.astype("float64")).max()) / scale)
    return err


_TOL = 1e-4  # float32, different kernels and orders of summation


def _caller(fn, keep, block=None):
    """A call of fn whose result is dropped, or kept alive for the next ``_KEEP`` calls."""
    if not keep:
        if block is None:
            return fn
        return lambda: block(fn())
    held = collections.deque(maxlen=_KEEP)
    if block is None:
        return lambda: held.append(fn())
    return lambda: held.append(block(fn()))


def run_case(jax, key, make, keep, repeats, inductor):
    import numpy as np

    c = make()
    args = c["args"]
    row = {"workload": c["name"] + (", results kept" if keep else ""), "key": key, "kept": keep}
    jargs = _to_jax(jax.numpy, args)
    jfn = jax.jit(c["jax_fn"])
    t0 = time.perf_counter()
    jref = jfn(*jargs)
    jax.block_until_ready(jref)
    row["jax_compile_s"] = time.perf_counter() - t0
    jref_np = [np.asarray(x) for x in jax.tree_util.tree_leaves(jref)]
    ours = lambda: c["ours_fn"](*args)  # noqa: E731
    theirs = lambda: c["theirs_fn"](*args)  # noqa: E731
    jitted = ft.jit(c["ours_fn"])
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        first = jitted(*args)
        row["trace_s"] = time.perf_counter() - t0
    row["jit_fallback"] = [str(w.message)[:200] for w in rec if "JitFallback" in str(w.category)]
    errs = {
        "ours": _rel_err(ours(), jref_np),
        "jit (traced)": _rel_err(first, jref_np),
        "jit": _rel_err(jitted(*args), jref_np),
        "torch.func": _rel_err(theirs(), jref_np),
    }
    del first
    fns = {
        "ours": _caller(ours, keep),
        "jit": _caller(lambda: jitted(*args), keep),
        "torch_func": _caller(theirs, keep),
        "jax": _caller(lambda: jfn(*jargs), keep, jax.block_until_ready),
    }
    if inductor:
        try:
            ind = ft.jit(c["ours_fn"], backend="inductor")
            t0 = time.perf_counter()
            ind(*args)
            errs["jit inductor"] = _rel_err(ind(*args), jref_np)
            row["inductor_compile_s"] = time.perf_counter() - t0
            fns["jit_inductor"] = _caller(lambda: ind(*args), keep)
        except Exception as e:  # noqa: BLE001 - reported in the row
            row["inductor_na"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    row["rel_err"] = errs
    row["max_rel_err"] = max(errs.values())
    if row["max_rel_err"] > _TOL:
        raise AssertionError(f"{key}: results differ from jax's: {errs}")
    t = interleaved(fns, repeats)
    row.update({f"{k}_ms": (v * 1e3 if v is not None else None) for k, v in t.items()})
    return row


# -- cold start ----------------------------------------------------------------------------------
_COLD_MLP = (
    "g = torch.Generator().manual_seed(0)\n"
    "p = {'w0': torch.randn(128, 784, generator=g) / 28, 'b0': torch.zeros(128),\n"
    "     'w1': torch.randn(128, 128, generator=g) / 11, 'b1': torch.zeros(128),\n"
    "     'w2': torch.randn(10, 128, generator=g) / 11, 'b2': torch.zeros(10)}\n"
    "xs = torch.randn(8, 784, generator=g); ys = torch.randint(0, 10, (8,), generator=g)\n"
    "import torch.nn.functional as F\n"
    "def loss(p, x, y):\n"
    "    h = F.relu(F.linear(x, p['w0'], p['b0']))\n"
    "    h = F.relu(F.linear(h, p['w1'], p['b1']))\n"
    "    return F.cross_entropy(F.linear(h, p['w2'], p['b2'])[None], y[None])\n"
)
_COLD = {
    "import functransforms + first jit call": (
        "import torch\n" + _COLD_MLP,
        "import functransforms as ft\n"
        "ft.jit(ft.vmap(ft.grad(loss), in_dims=(None, 0, 0)))(p, xs, ys)\n",
    ),
    "import functransforms + first eager call": (
        "import torch\n" + _COLD_MLP,
        "import functransforms as ft\nft.vmap(ft.grad(loss), in_dims=(None, 0, 0))(p, xs, ys)\n",
    ),
    "torch.func first call": (
        "import torch\n" + _COLD_MLP,
        "import torch.func as tf\ntf.vmap(tf.grad(loss), in_dims=(None, 0, 0))(p, xs, ys)\n",
    ),
    "import jax + jax.jit first call": (
        "import numpy as np\n"
        "r = np.random.default_rng(0)\n"
        "n = lambda *s: r.standard_normal(s, 'float32')\n"
        "p = {'w0': n(128, 784) / 28, 'b0': np.zeros(128, 'float32'),\n"
        "     'w1': n(128, 128) / 11, 'b1': np.zeros(128, 'float32'),\n"
        "     'w2': n(10, 128) / 11, 'b2': np.zeros(10, 'float32')}\n"
        "xs = r.standard_normal((8, 784), 'float32'); ys = r.integers(0, 10, 8)\n",
        "import jax, jax.numpy as jnp\n"
        "def loss(p, x, y):\n"
        "    h = jnp.maximum(p['w0'] @ x + p['b0'], 0)\n"
        "    h = jnp.maximum(p['w1'] @ h + p['b1'], 0)\n"
        "    return -jax.nn.log_softmax(p['w2'] @ h + p['b2'])[y]\n"
        "psg = jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0, 0)))\n"
        "jax.block_until_ready(psg(p, xs, ys))\n",
    ),
}


def cold_start(runs=7, with_jax=True):
    """Medians over fresh processes of the CPU and wall time of each statement (its setup:
    ``import torch`` and the inputs, not timed), and how many modules it imported."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPATH"] = _ROOT + os.pathsep + env.get("PYTHONPATH", "")
    out = {}
    for name, (setup, stmt) in _COLD.items():
        if "jax" in name and not with_jax:
            continue
        code = (
            f"import sys, time\n{setup}n0 = len(sys.modules)\n"
            "t0, c0 = time.perf_counter(), time.process_time()\n"
            f"{stmt}print(time.perf_counter() - t0, time.process_time() - c0, "
            "len(sys.modules) - n0, 'sympy' in sys.modules)\n"
        )
        samples = []
        for i in range(runs + 1):  # the first run writes bytecode caches
            r = subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=_ROOT
            )
            if r.returncode:
                raise RuntimeError(f"cold start {name!r} failed:\n{r.stderr[-2000:]}")
            if i:
                samples.append(r.stdout.strip().splitlines()[-1].split())
        wall = statistics.median(float(s[0]) for s in samples)
        cpu = statistics.median(float(s[1]) for s in samples)
        out[name] = {
            "wall_ms": wall * 1e3,
            "cpu_ms": cpu * 1e3,
            "modules": int(statistics.median(int(s[2]) for s in samples)),
            "sympy": samples[-1][3] == "True",
        }
    return out


# -- report --------------------------------------------------------------------------------------
def _ms(v):
    return "-" if v is None else f"{v:.3f}"


def render(rows, cold, inductor):
    cols = ["ours", "jit", "jit_inductor", "torch_func", "jax"]
    head = [
        "workload",
        "ours eager (ms)",
        "ours jit (ms)",
        "ours jit inductor (ms)",
        "torch.func eager (ms)",
        "jax.jit (ms)",
        "jit / jax.jit (<= 1.0)",
        "jit inductor / jax.jit",
        "eager / torch.func",
        "max rel err",
    ]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for r in rows:
        j = r["jax_ms"]
        ratio = r["jit_ms"] / j
        ind = r.get("jit_inductor_ms")
        cells = [r["workload"], *(_ms(r.get(f"{c}_ms")) for c in cols)]
        cells += [
            f"{ratio:.2f} {'met' if ratio <= 1.0 else 'MISSED'}",
            "-" if ind is None else f"{ind / j:.2f}",
            f"{r['ours_ms'] / r['torch_func_ms']:.2f}",
            f"{r['max_rel_err']:.1e}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    if cold:
        text += (
            "\nCold start (fresh processes, median of the runs; the statement's own time, after "
            "`import torch` and building its inputs; modules: how many it imported):\n\n"
            "| | wall (ms) | CPU (ms) | modules imported | sympy imported |\n"
            "|---|---:|---:|---:|---|\n"
        )
        for k, c in cold.items():
            text += (
                f"| {k} | {c['wall_ms']:.1f} | {c['cpu_ms']:.1f} | {c['modules']} | "
                f"{'yes' if c['sympy'] else 'no'} |\n"
            )
    return text


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds")
    ap.add_argument("--no-inductor", action="store_true", help="skip the jit inductor column")
    ap.add_argument("--no-cold", action="store_true", help="skip the cold-start table")
    ap.add_argument("--cold", action="store_true", help="only the cold-start table")
    ap.add_argument("--only", default=None, help="rows whose key contains this")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--out", default=None, help="write a markdown page (and .json) here")
    a = ap.parse_args(argv)
    jax = _jax()
    if jax is None:
        print("bench_jax: jax is not installed (pip install -e '.[jax]'); skipped.")
        return 0
    jax.config.update("jax_enable_x64", False)
    torch.set_num_threads(1)
    repeats = a.repeats or (7 if a.quick else 21)
    inductor = not a.no_inductor
    rows = []
    for key, make, keep in [] if a.cold else all_cases(jax):
        if a.only and a.only not in key:
            continue
        row = run_case(jax, key, make, keep, repeats, inductor)
        rows.append(row)
        print(
            f"{row['workload']}: "
            + ", ".join(f"{k[:-3]} {v:.3f}" for k, v in row.items() if k.endswith("_ms") and v)
            + f" ms; jit/jax {row['jit_ms'] / row['jax_ms']:.2f}; err {row['max_rel_err']:.1e}",
            flush=True,
        )
    cold = {} if a.no_cold or (a.only and not a.cold) else cold_start(3 if a.quick else 7)
    text = render(rows, cold, inductor)
    print(text)
    if a.out:
        load = os.getloadavg()[0]
        header = (
            "# functransforms vs jax.jit on CPU\n\nGenerated by\n\n"
            f"    python benchmarks/bench_jax.py --out {a.out}\n\n"
            f"- date: {datetime.date.today()}\n"
            f"- machine: {platform.machine()}, nproc = {os.cpu_count()}, CPython "
            f"{platform.python_version()}, torch {torch.__version__}, jax {jax.__version__} "
            f"(jaxlib {__import__('jaxlib').__version__}), one thread each "
            "(torch.set_num_threads(1); XLA_FLAGS=--xla_cpu_multi_thread_eigen=false "
            f"intra_op_parallelism_threads=1), load average at the end: {load:.1f}\n"
            f"- every time is the median over {repeats} interleaved rounds (each sample averages "
            "enough calls to last ~2 ms) of the process's CPU time; float32; the same inputs "
            "converted to jax arrays, every column's result checked against jax.jit's "
            f"(max relative error <= {_TOL:g}).\n"
            "- ours eager: functransforms transforms; ours jit: `ft.jit(<the same function>)`, "
            "the recorded ATen graph replayed op by op (the default backend); ours jit "
            "inductor: `ft.jit(..., backend='inductor')`; torch.func eager: the same code "
            "through torch.func; jax.jit: the same math in jax.numpy under `jax.jit`.\n"
            f'- "results kept": the caller holds its last {_KEEP} results, so no column can '
            "reuse a result's memory (every call writes fresh pages); the row above it drops "
            "each result.\n"
            "- target (ahead of JAX on CPU): jit / jax.jit <= 1.0 on every row; import "
            "+ first jit call <= 300 ms CPU.\n\n"
        )
        with open(a.out, "w") as fh:
            fh.write(header + text)
        with open(os.path.splitext(a.out)[0] + ".json", "w") as fh:
            json.dump({"rows": rows, "cold_start": cold, "repeats": repeats}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
