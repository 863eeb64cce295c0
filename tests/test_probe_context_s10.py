"""Session 10 probe: our transforms inside the surroundings of real programs (torch.compile and
torch.export, autocast, meta and fake tensors, empty batches, global modes, generators).

torch.func is the oracle; where it is wrong or refuses, the test says so and compares with a
plain autograd loop or finite differences. Each finding fixed in the library is named in
docs/design.md, "Session 10 probe: programs' surroundings"."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.func as tf

import functransforms as ft

_g = torch.Generator().manual_seed(0)
D = torch.float64


def _rand(*shape, dtype=D):
    return torch.randn(*shape, dtype=dtype, generator=_g)


def _leaves(tree):
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _same(ours, ref, atol=1e-6, rtol=1e-5, values=True):
    a, b = _leaves(ours), _leaves(ref)
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert (x.shape, x.dtype, x.device) == (y.shape, y.dtype, y.device)
        if values and x.device.type != "meta":
            torch.testing.assert_close(x, y, atol=atol, rtol=rtol)


# -- 1. torch.compile around, inside and beside our transforms ----------------------------------
def _loss(w, x, y):
    return ((x @ w - y) ** 2).mean()


def _f(x):
    return (x.sin() * x).sum()


def _g_sum(v):  # a reduction beside a pointwise op: the batched sum must be aligned
    return v.sin() * 2 + v.sum()


_W, _XS, _YS = _rand(3, 2), _rand(5, 4, 3), _rand(5, 4, 2)
_X = _rand(4, 3)


def _step(lib):
    def step(w, xs, ys):
        g = lib.vmap(lib.grad(_loss), in_dims=(None, 0, 0))(w, xs, ys)
        return w - 0.1 * g.mean(0), g.norm()

    return step


_COMPILE_CASES = {
    "compile(grad)": (lambda lib, c: c(lib.grad(_f))(_X[0])),
    "compile(vmap(grad))": (lambda lib, c: c(lib.vmap(lib.grad(_f)))(_X)),
    "grad(compile)": (lambda lib, c: lib.grad(c(_f))(_X[0])),
    # SILENT before: dynamo traced our __torch_function__ and replayed it over the physical value
    "vmap(compile(sin+sum))": (lambda lib, c: lib.vmap(c(_g_sum))(_X)),
    "vmap(compile(mean))": (lambda lib, c: lib.vmap(c(lambda v: v - v.mean()))(_X)),
    # crash before: RecursionError inside dynamo
    "vmap(grad(compile))": (lambda lib, c: lib.vmap(lib.grad(c(_f)))(_X)),
    "jvp(compile(sum))": (lambda lib, c: lib.jvp(c(_g_sum), (_X,), (_X * 2,))),
    "jacrev(compile(sum))": (lambda lib, c: lib.jacrev(c(_g_sum))(_X[0])),
    "compiled step": (lambda lib, c: c(_step(lib))(_W, _XS, _YS)),
    "compile(jvp)": (lambda lib, c: c(lambda x, t: lib.jvp(torch.sin, (x,), (t,)))(_X, _X * 2)),
    "compile(hessian)": (lambda lib, c: c(lib.hessian(_f))(_X[0])),
}


def _compiler(backend, **kw):
    return lambda fn: torch.compile(fn, backend=backend, **kw)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("case", sorted(_COMPILE_CASES))
def test_compile_and_transforms_compute_torch_funcs_values(case, backend):
    import torch._dynamo

    torch._dynamo.reset()
    ours = _COMPILE_CASES[case](ft, _compiler(backend))
    _same(ours, _COMPILE_CASES[case](tf, lambda fn: fn))


def test_compiled_training_step_fullgraph_and_backward_through_vmap_grad():
    import torch._dynamo

    def outer(lib):
        def fn(w, xs, ys):
            g = lib.vmap(lib.grad(_loss, argnums=1), in_dims=(None, 0, 0))(w, xs, ys)
            return (g**2).sum()

        return fn

    def run(fn):
        w = _W.clone().requires_grad_()
        out = fn(w, _XS, _YS)
        out.backward()
        return out, w.grad

    torch._dynamo.reset()
    _same(run(torch.compile(outer(ft), backend="aot_eager")), run(outer(tf)))


def test_fullgraph_compile_of_our_transforms_refuses_naming_the_transform():
    """torch.func's transforms are built into dynamo; ours run eagerly (one graph break), which
    fullgraph=True forbids: dynamo raises naming our function (docs/torch_func_differences.md,
    section 33)."""
    import torch._dynamo

    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match="functransforms"):
        torch.compile(_step(ft), backend="eager", fullgraph=True)(_W, _XS, _YS)


def test_compiled_function_inside_vmap_when_dynamo_loads_after_us():
    """The skip list is registered at the first transform call after dynamo is imported (a
    fresh process: functransforms imported before torch._dynamo)."""
    code = textwrap.dedent(
        """
        import torch, sys
        import functransforms as ft
        assert "torch._dynamo" not in sys.modules
        x = torch.randn(4, 3, dtype=torch.float64)
        g = lambda v: v.sin() * 2 + v.sum()
        out = ft.vmap(torch.compile(g, backend="eager"))(x)
        ref = torch.stack([g(r) for r in x])
        torch.testing.assert_close(out, ref)
        print("ok")
        """
    )
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root}
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=root, env=env
    )
    assert res.stdout.strip().endswith("ok"), res.stderr[-2000:]
