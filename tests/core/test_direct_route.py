"""Note [Direct route to the inner level] (functransforms/_core/levels.py): an op a grad level hands
down goes straight to the inner interpreter only when torch would send it there, and gives what
the ordinary call gives (values, containers, torch autograd through the transform)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import functransforms as ft
from functransforms._core import levels as _core


def _ordinary(monkeypatch):
    """Force every op onto torch's path: no exclude set satisfies an all-ones mask."""
    ft.grad(lambda x: x.sum())(torch.ones(1))  # the mask is read at the first transform call
    monkeypatch.setattr(_core, "_ABOVE_PYTHON", (1 << 64) - 1)


def _f(x):
    a, b = x.unbind(0)  # Tensor[]
    m, i = torch.max(x, dim=-1)  # several returns
    parts = torch.split(x, 1, dim=-1)
    y = torch.sin(a) * b + m.sum() + parts[0].sum() * i.sum()
    z = y.clone()
    z.add_(torch.cos(a), alpha=0.5)  # an in-place op with a keyword
    return (z * z).sum() + torch.sort(x.flatten(), descending=True)[0][0]


@pytest.mark.parametrize("batched", [False, True])
def test_same_as_the_ordinary_path(batched, monkeypatch):
    x = torch.randn(4, 2, 3, dtype=torch.float64)
    f = ft.grad(_f)
    fn = ft.vmap(f) if batched else (lambda x: f(x[0]))
    fast = fn(x)
    _ordinary(monkeypatch)
    slow = fn(x)
    assert torch.equal(fast, slow)
    ref = torch.func.vmap(torch.func.grad(_f))(x) if batched else torch.func.grad(_f)(x[0])
    torch.testing.assert_close(fast, ref)


def test_taken_under_vmap_of_grad(monkeypatch):
    seen = []
    orig = _core._route

    def spy(interp, func, args, kwargs):
        seen.append((type(interp).__name__, func))
        return orig(interp, func, args, kwargs)

    monkeypatch.setattr(_core, "_route", spy)
    hits = []
    direct = _core.redispatch

    def watch(func, args, kwargs):
        n = len(seen)
        out = direct(func, args, kwargs)
        hits.append(len(seen) > n)
        return out

    monkeypatch.setattr(_core, "redispatch", watch)
    import functransforms.autodiff.reverse as reverse

    monkeypatch.setattr(reverse, "redispatch", watch)
    ft.vmap(ft.grad(lambda x: torch.sin(x).sum()))(torch.randn(3, 4))
    assert hits and all(hits)  # the grad level's sin and sum went straight to vmap


def test_not_taken_under_a_dispatch_mode():
    """A mode on the stack sees the inner level's ops (as it would through torch)."""
    seen = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    x = torch.randn(3, 4)
    with Log():
        out = ft.vmap(ft.grad(lambda x: torch.sin(x).sum()))(x)
    torch.testing.assert_close(out, torch.cos(x))
    assert torch.ops.aten.sin.default in seen


def test_torch_autograd_through_the_route():
    """A plain input that requires grad: the inner level runs with torch's autograd on, so
    backward() sees through vmap(grad(f)) as before."""
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    out = ft.vmap(ft.grad(lambda v: (torch.sin(v) ** 2).sum()))(x)
    (g,) = torch.autograd.grad(out.sum(), x)
    x2 = x.detach().requires_grad_()
    ref = torch.func.vmap(torch.func.grad(lambda v: (torch.sin(v) ** 2).sum()))(x2)
    (g2,) = torch.autograd.grad(ref.sum(), x2)
    torch.testing.assert_close(g, g2)


def test_grad_of_grad_and_no_grad_inside():
    x = torch.randn(5, dtype=torch.float64)

    def f(v):
        with torch.no_grad():
            c = torch.exp(v).sum()
        return (torch.sin(v) * c).sum()

    xs = x.reshape(5, 1).expand(5, 3)
    got = ft.vmap(ft.grad(lambda v: ft.grad(f)(v).sum()))(xs)
    ref = torch.func.vmap(torch.func.grad(lambda v: torch.func.grad(f)(v).sum()))(xs)
    torch.testing.assert_close(got, ref)


# Note [Pointwise pullbacks on physical values] (autodiff/reverse.py)
def _unary_chain(v):
    y = torch.relu(torch.tanh(torch.sin(v) * 1.5))  # relu and tanh keep only their outputs
    y = torch.nn.functional.gelu(y + 0.1)  # gelu keeps only its input
    return (torch.sqrt(y + 1.0) * torch.sigmoid(v)).sum()


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
def test_physical_pullbacks_agree(dtype, monkeypatch):
    import functransforms.autodiff.reverse as reverse

    ran = []
    orig = reverse._physical_pullback

    def spy(rule, ct, node):
        out = orig(rule, ct, node)
        ran.append(out is not None)
        return out

    monkeypatch.setattr(reverse, "_physical_pullback", spy)
    f = _unary_chain if dtype == torch.float64 else (lambda v: torch.sin(v).abs().sum())
    x = torch.randn(5, 4, dtype=dtype)
    got = ft.vmap(ft.grad(f))(x)
    torch.testing.assert_close(got, torch.func.vmap(torch.func.grad(f))(x))
    if dtype.is_complex:
        assert not any(ran)  # lazy conjugates: through the wrappers
    else:
        assert ran and all(ran)


def test_physical_pullbacks_step_aside():
    """Another level inside, a batch dim elsewhere, a plain input: the usual pullback."""
    x = torch.randn(3, 2, 4, dtype=torch.float64)
    f = ft.vmap(ft.vmap(ft.grad(_unary_chain)), in_dims=1)
    ref = torch.func.vmap(torch.func.vmap(torch.func.grad(_unary_chain)), in_dims=1)
    torch.testing.assert_close(f(x), ref(x))
    w = torch.randn(4, dtype=torch.float64)
    g = ft.vmap(ft.grad(lambda w, v: _unary_chain(v * w)), in_dims=(None, 1))
    rg = torch.func.vmap(torch.func.grad(lambda w, v: _unary_chain(v * w)), in_dims=(None, 1))
    torch.testing.assert_close(g(w, x[0].T), rg(w, x[0].T))


def test_physical_pullbacks_with_plain_constants(monkeypatch):
    """jacrev: the vjp is taken outside the vmap, so the tape holds plain values and only the
    cotangents are batched (at dim 0, or elsewhere with in_dims); the pullback runs on the
    physical cotangent with the constants broadcast, and agrees with PyTorch, also for torch's
    autograd through it."""
    import functransforms.autodiff.reverse as reverse

    ran = []
    orig = reverse._physical_pullback

    def spy(rule, ct, node):
        out = orig(rule, ct, node)
        ran.append(out is not None)
        return out

    monkeypatch.setattr(reverse, "_physical_pullback", spy)
    W = torch.randn(6, 4, dtype=torch.float64)

    def f(v):
        y = torch.relu(torch.tanh(torch.sin(W @ v) * 1.5))
        return torch.sqrt(torch.nn.functional.gelu(y + 0.1) + 1.0) * torch.sigmoid(W @ v)

    x = torch.randn(4, dtype=torch.float64)
    torch.testing.assert_close(ft.jacrev(f)(x), torch.func.jacrev(f)(x))
    assert ran and all(ran)
    out, pull = ft.vjp(f, x)
    _, rpull = torch.func.vjp(f, x)
    cts = torch.randn(6, 3, dtype=torch.float64)  # batch dim 1
    torch.testing.assert_close(
        ft.vmap(pull, in_dims=1)(cts), torch.func.vmap(rpull, in_dims=1)(cts)
    )
    xg = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(ft.jacrev(f)(xg).sum(), xg)
    (rg,) = torch.autograd.grad(torch.func.jacrev(f)(xg).sum(), xg)
    torch.testing.assert_close(g, rg)
