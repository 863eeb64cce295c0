"""functransforms inside real PyTorch programs, each claim against torch.func or plain
autograd: torch's autograd through our transforms (backward, double backward, MAML), grad-mode
semantics, in-place writes to primals, module state, torch.compile."""

import copy

import pytest
import torch
import torch.nn.functional as F

import functransforms as ft

tf = torch.func
LIBS = {"ft": ft, "torch.func": tf}


def _close(a, b, **kw):
    kw.setdefault("atol", 1e-10)
    kw.setdefault("rtol", 1e-7)
    torch.testing.assert_close(a, b, **kw)


def _outer_grads(build, *shapes, seed=0, device="cpu"):
    """``torch.autograd.grad`` of ``build(lib, *leaves)`` by every leaf, for ours and torch.func.

    Returns ``{lib_name: (value, grads)}``."""
    g = torch.Generator().manual_seed(seed)
    base = [torch.randn(*s, generator=g, dtype=torch.float64).to(device) for s in shapes]
    out = {}
    for name, lib in LIBS.items():
        leaves = [b.clone().requires_grad_() for b in base]
        value = build(lib, *leaves)
        out[name] = (value.detach(), torch.autograd.grad(value, leaves, allow_unused=True))
    return out


def _assert_same_outer_grads(build, *shapes, device="cpu"):
    res = _outer_grads(build, *shapes, device=device)
    (v_ours, g_ours), (v_ref, g_ref) = res["ft"], res["torch.func"]
    _close(v_ours, v_ref)
    for a, b in zip(g_ours, g_ref):
        assert (a is None) == (b is None)
        if a is not None:
            _close(a, b)


# -- 1. torch's autograd sees through our transforms ---------------------------------------------
# Tests taking the `device` fixture (tests/conftest.py) run on CUDA too where it exists.
def test_backward_through_vmap_with_captured_weight(device):
    """A weight used inside vmap and outside it: W.grad gets the vmapped term, not only the decay
    term."""
    torch.manual_seed(0)
    W0 = torch.randn(3, 3, dtype=torch.float64, device=device)
    xs = torch.randn(5, 3, dtype=torch.float64, device=device)
    grads = {}
    for name, lib in LIBS.items():
        W = W0.clone().requires_grad_()
        out = lib.vmap(lambda x: torch.tanh(W @ x).sum())(xs)  # noqa: B023
        assert out.requires_grad
        (out.sum() + 0.1 * (W**2).sum()).backward()
        grads[name] = W.grad
    W = W0.clone().requires_grad_()
    (torch.tanh(xs @ W.T).sum() + 0.1 * (W**2).sum()).backward()
    _close(grads["ft"], W.grad)
    _close(grads["torch.func"], W.grad)


def test_backward_through_vmap_alone(device):
    """Without another path to W, backward used to raise ("does not require grad")."""
    W = torch.randn(3, 3, dtype=torch.float64, device=device, requires_grad=True)
    xs = torch.randn(5, 3, dtype=torch.float64, device=device)
    ft.vmap(lambda x: torch.tanh(W @ x).sum())(xs).sum().backward()
    ref = torch.autograd.grad(torch.tanh(xs @ W.T).sum(), W)[0]
    _close(W.grad, ref)


def test_autograd_grad_of_ft_grad(device):
    """d/dx of grad((sin x)^2) = 2 cos 2x."""
    x = torch.randn(4, dtype=torch.float64, device=device, requires_grad=True)
    g = ft.grad(lambda x: (x.sin() ** 2).sum())(x)
    assert g.requires_grad
    _close(torch.autograd.grad(g.sum(), x)[0], 2 * torch.cos(2 * x.detach()))


_OUTER = {
    "grad": (lambda lib, x: lib.grad(lambda x: (x.sin() ** 2).sum())(x).sum(), (4,)),
    "vjp_fn": (
        lambda lib, x: lib.vjp(lambda x: x.sin() ** 2, x)[1](torch.ones_like(x))[0].sum(),
        (4,),
    ),
    "vjp_out": (lambda lib, x: lib.vjp(lambda x: x.sin() ** 2, x)[0].sum(), (4,)),
    "jvp_tangent": (
        lambda lib, x, v: lib.jvp(lambda x: x.sin() ** 2, (x,), (v,))[1].pow(2).sum(),
        (4,),
        (4,),
    ),
    "jvp_primal": (
        lambda lib, x, v: lib.jvp(lambda x: x.sin() ** 2, (x,), (v,))[0].pow(2).sum(),
        (4,),
        (4,),
    ),
    "vmap_mean": (lambda lib, x: lib.vmap(torch.mean)(x).sum() + x.sum(), (3, 4)),
    "vmap_view": (
        lambda lib, x: lib.vmap(lambda r: r.t().reshape(-1)[:3].exp())(x).sum(),
        (3, 2, 4),
    ),
    "vmap_matmul": (
        lambda lib, x, W: lib.vmap(lambda r: (r @ W).sin())(x).sum(),
        (3, 2, 4),
        (4, 5),
    ),
    "vmap_nested_in_dims": (
        lambda lib, x: (
            lib.vmap(lib.vmap(lambda r: r.sum() * r.max(), in_dims=1), in_dims=2)(x).pow(2).sum()
        ),
        (3, 4, 5),
    ),
    "vmap_grad_captured": (
        lambda lib, W, xs: lib.vmap(lib.grad(lambda x: torch.tanh(W @ x).sum()))(xs).pow(2).sum(),
        (3, 3),
        (5, 3),
    ),
    "grad_captured": (
        lambda lib, W, x: lib.grad(lambda x: torch.tanh(W @ x).sum())(x).pow(2).sum(),
        (3, 3),
        (3,),
    ),
    "hessian": (
        lambda lib, x: lib.hessian(lambda x: (x.sin() * x.exp()).sum())(x).pow(2).sum(),
        (3,),
    ),
    "jacrev": (lambda lib, x: lib.jacrev(lambda x: x.sin().cumsum(0))(x).pow(2).sum(), (3,)),
    "jacfwd": (lambda lib, x: lib.jacfwd(lambda x: x.sin().cumsum(0))(x).pow(2).sum(), (3,)),
    "hvp": (
        lambda lib, x, v: lib.jvp(lib.grad(lambda x: (x.sin() ** 3).sum()), (x,), (v,))[1].sum(),
        (3,),
        (3,),
    ),
    "vmap_of_vjp_fn": (
        lambda lib, x: (
            lib.vmap(lib.vjp(lambda x: x.sin() * x.sum(), x)[1])(torch.eye(3).to(x))[0].pow(2).sum()
        ),
        (3,),
    ),
}


@pytest.mark.parametrize("case", sorted(_OUTER))
def test_torch_autograd_over_our_outputs(case, device):
    build, *shapes = _OUTER[case]
    _assert_same_outer_grads(build, *shapes, device=device)


def _double_backward(op):
    return lambda lib, x: lib.grad(lambda a: op(a).sum())(x).pow(2).sum()


def _eye3(a):
    return torch.eye(3, dtype=a.dtype, device=a.device)


# ops whose derivative rules are easy to write without their dependence on the primal, which
# torch.autograd over ft.grad then sees as wrong (or no) second derivative
_DOUBLE = {
    "addcmul": (lambda a: torch.addcmul(a, a, a, value=0.5), (4,)),
    "addcdiv": (lambda a: torch.addcdiv(a, a, a.exp(), value=0.5), (4,)),
    "std": (lambda a: a.std(), (5,)),
    "std_mean": (lambda a: torch.std_mean(a)[0] * torch.std_mean(a)[1], (5,)),
    "norm": (lambda a: a.norm(), (5,)),
    "renorm": (lambda a: torch.renorm(a, 2, 0, 0.5), (3, 4)),
    "logaddexp2": (lambda a: torch.logaddexp2(a, a.sin()), (4,)),
    "true_divide": (lambda a: torch.true_divide(a.exp(), a.cos() + 2), (4,)),
    "triplet_margin_loss": (lambda a: F.triplet_margin_loss(a, a.sin(), a.cos()), (3, 4)),
    "sqrt": (lambda a: a.exp().sqrt(), (4,)),
    "linalg.inv": (lambda a: torch.linalg.inv(a + 4 * _eye3(a)), (3, 3)),
    "linalg.solve_ex": (lambda a: torch.linalg.solve_ex(a + 4 * _eye3(a), a[:, 0])[0], (3, 3)),
    "linalg.eigvalsh": (lambda a: torch.linalg.eigvalsh(a + a.mT) ** 2, (3, 3)),
}


@pytest.mark.parametrize("op", sorted(_DOUBLE))
def test_double_backward_through_ft_grad(op, device):
    fn, shape = _DOUBLE[op]
    _assert_same_outer_grads(_double_backward(fn), shape, device=device)


def test_addcmul_double_backward_value():
    """The value itself: d/dx sum(grad(addcmul(a, a, a, value=.5))) = 1 (not 0.5)."""
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    g = ft.grad(lambda a: torch.addcmul(a, a, a, value=0.5).sum())(x)
    _close(torch.autograd.grad(g.sum(), x)[0], torch.ones(4, dtype=torch.float64))


def test_model_with_vmap_jacrev_term():
    """`lin(r).sum() + vmap(jacrev(tanh(lin(q))))(r).sum()`, derivative by lin.weight."""
    grads = {}
    for name, lib in LIBS.items():
        torch.manual_seed(0)
        lin = torch.nn.Linear(3, 3).double()
        r = torch.randn(4, 3, dtype=torch.float64)
        loss = lin(r).sum() + lib.vmap(lib.jacrev(lambda q: torch.tanh(lin(q))))(r).sum()  # noqa: B023
        grads[name] = torch.autograd.grad(loss, lin.weight)[0]
    _close(grads["ft"], grads["torch.func"])


# MAML: an inner step with grad, the outer step with ordinary autograd
def _maml_plain(lib, w, tasks, lr=0.1):
    def inner_loss(w, x, y):
        return ((x @ w - y) ** 2).mean()

    total = 0
    for xs, ys, xq, yq in tasks:
        w1 = w - lr * lib.grad(inner_loss)(w, xs, ys)
        w2 = w1 - lr * lib.grad(inner_loss)(w1, xs, ys)  # two inner steps: third-order terms
        total = total + inner_loss(w2, xq, yq)
    return total


def _tasks(n=3):
    g = torch.Generator().manual_seed(1)
    return [
        tuple(
            torch.randn(*s, generator=g, dtype=torch.float64) for s in ((6, 4), (6,), (5, 4), (5,))
        )
        for _ in range(n)
    ]


def test_maml_plain_tensors():
    tasks = _tasks()
    w0 = torch.randn(4, dtype=torch.float64)
    grads = {}
    for name, lib in LIBS.items():
        w = w0.clone().requires_grad_()
        _maml_plain(lib, w, tasks).backward()
        grads[name] = w.grad

    class _Autograd:  # plain autograd with create_graph: the textbook MAML
        @staticmethod
        def grad(f):
            def g(w, *a):
                return torch.autograd.grad(f(w, *a), w, create_graph=True)[0]

            return g

    w = w0.clone().requires_grad_()
    _maml_plain(_Autograd, w, tasks).backward()
    _close(grads["ft"], w.grad)
    _close(grads["torch.func"], w.grad)


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
    ).double()


def test_maml_module_functional_call():
    tasks = _tasks()
    grads = {}
    for name, lib in LIBS.items():
        net = _net()
        params = dict(net.named_parameters())

        def loss_fn(p, x, y, lib=lib, net=net):
            return F.mse_loss(lib.functional_call(net, p, (x,)).squeeze(-1), y)

        meta = 0
        for xs, ys, xq, yq in tasks:
            g = lib.grad(loss_fn)(params, xs, ys)
            fast = {k: params[k] - 0.1 * g[k] for k in params}
            meta = meta + loss_fn(fast, xq, yq)
        meta.backward()
        grads[name] = {k: p.grad.clone() for k, p in net.named_parameters()}
    for k in grads["ft"]:
        _close(grads["ft"][k], grads["torch.func"][k])


def test_maml_vmapped_over_tasks():
    """The per-task inner step batched with vmap, meta-gradient by backward()."""
    tasks = _tasks(4)
    stacked = [torch.stack([t[i] for t in tasks]) for i in range(4)]
    w0 = torch.randn(4, dtype=torch.float64)
    grads = {}
    for name, lib in LIBS.items():

        def task_loss(w, xs, ys, xq, yq, lib=lib):
            inner = lambda w: ((xs @ w - ys) ** 2).mean()  # noqa: E731
            w1 = w - 0.1 * lib.grad(inner)(w)
            return ((xq @ w1 - yq) ** 2).mean()

        w = w0.clone().requires_grad_()
        lib.vmap(task_loss, in_dims=(None, 0, 0, 0, 0))(w, *stacked).sum().backward()
        grads[name] = w.grad
    _close(grads["ft"], grads["torch.func"])


def test_vmap_inside_module_forward():
    """A module whose forward uses ft.vmap trains like one using torch.func.vmap."""

    class PerRow(torch.nn.Module):
        def __init__(self, lib):
            super().__init__()
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(3, 4).double()
            self.lib = lib

        def forward(self, x):
            return self.lib.vmap(lambda r: torch.tanh(self.lin(r)).max() * r.norm())(x)

    x = torch.randn(6, 3, dtype=torch.float64)
    grads = {}
    for name, lib in LIBS.items():
        m = PerRow(lib)
        m(x).pow(2).sum().backward()
        grads[name] = [p.grad for p in m.parameters()]
    for a, b in zip(grads["ft"], grads["torch.func"]):
        _close(a, b)


def test_ensemble_training_step():
    """stack_module_state + vmap(functional_call) forward, loss.backward() on the stacked params."""
    torch.manual_seed(0)
    models = [
        torch.nn.Sequential(
            torch.nn.Linear(5, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)
        ).double()
        for _ in range(4)
    ]
    x = torch.randn(8, 5, dtype=torch.float64)
    y = torch.randint(0, 2, (8,))
    grads = {}
    for name, lib in LIBS.items():
        params, buffers = lib.stack_module_state(models)
        base = copy.deepcopy(models[0]).to("meta")

        def fmodel(p, b, x, base=base, lib=lib):
            return lib.functional_call(base, (p, b), (x,))

        logits = lib.vmap(fmodel, in_dims=(0, 0, None))(params, buffers, x)  # [4, 8, 2]
        loss = F.cross_entropy(logits.reshape(-1, 2), y.repeat(4))
        loss.backward()
        grads[name] = {k: v.grad for k, v in params.items()}
    for k in grads["ft"]:
        _close(grads["ft"][k], grads["torch.func"][k])


def test_no_torch_graph_when_nothing_requires_grad():
    """The common path: nothing requires grad, nothing is recorded by torch."""
    x = torch.randn(3, 4, dtype=torch.float64)
    assert not ft.vmap(torch.mean)(x).requires_grad
    assert not ft.grad(lambda x: (x.sin() ** 2).sum())(x[0]).requires_grad
    assert not ft.jvp(torch.sin, (x,), (x,))[1].requires_grad


# -- 2. grad-mode semantics ---------------------------------------------------------------------
def _sin_stopped(x):
    with torch.no_grad():
        s = x.sin()
    return (s * x).sum()


def _sin_set_grad_enabled(x):
    torch.set_grad_enabled(False)
    try:
        s = x.sin()
    finally:
        torch.set_grad_enabled(True)
    return (s * x).sum()


def _sin_inference_mode(x):
    with torch.inference_mode():
        s = x.sin()
    return (s.clone() * x).sum()


_GRAD_MODE_CALLS = {
    "grad": lambda lib, f, x: lib.grad(f)(x),
    "vjp": lambda lib, f, x: lib.vjp(f, x)[1](torch.tensor(1.0, dtype=x.dtype))[0],
    "jacrev": lambda lib, f, x: lib.jacrev(f)(x),
    "vmap_grad": lambda lib, f, x: lib.vmap(lib.grad(f))(torch.stack([x, 2 * x])),
    "grad_of_grad": lambda lib, f, x: lib.grad(lambda y: lib.grad(f)(y).sum())(x),
    "hessian": lambda lib, f, x: lib.hessian(f)(x),
    "jvp_of_grad": lambda lib, f, x: lib.jvp(lib.grad(f), (x,), (torch.ones_like(x),))[1],
    "value_and_grad": lambda lib, f, x: (
        ft.value_and_grad(f)(x)[1] if lib is ft else tf.grad_and_value(f)(x)[0]
    ),
}


@pytest.mark.parametrize("call", sorted(_GRAD_MODE_CALLS))
@pytest.mark.parametrize("f", [_sin_stopped, _sin_set_grad_enabled], ids=["no_grad", "set_grad"])
def test_no_grad_inside_stops_our_grad(call, f):
    """torch.func: the no_grad part is a constant (grad = sin x, not sin x + x cos x)."""
    x = torch.tensor([0.3, 0.7], dtype=torch.float64)
    run = _GRAD_MODE_CALLS[call]
    _close(run(ft, f, x), run(tf, f, x))


def test_inference_mode_inside_stops_our_grad():
    """torch.func raises here (inference tensors saved for backward); we treat it as no_grad."""
    x = torch.tensor([0.3, 0.7], dtype=torch.float64)
    _close(ft.grad(_sin_inference_mode)(x), x.sin())


def test_outer_no_grad_does_not_stop_our_transforms():
    x = torch.tensor([0.3, 0.7], dtype=torch.float64)
    xr = x.clone().requires_grad_()
    with torch.no_grad():
        g = ft.grad(lambda x: (x**3).sum())(xr)
        h = ft.hessian(lambda x: (x**3).sum())(x)
        t = ft.jvp(torch.sin, (x,), (torch.ones(2, dtype=x.dtype),))[1]
        assert torch.is_grad_enabled() is False  # restored after each call
    _close(g, 3 * x**2)
    assert not g.requires_grad  # as torch.func: nothing recorded by torch under the outer no_grad
    _close(h, torch.diag(6 * x))
    _close(t, x.cos())


def test_grad_mode_restored_after_exception():
    x = torch.tensor([0.3, 0.7], dtype=torch.float64)

    def boom(x):
        raise RuntimeError("boom")

    with torch.no_grad():
        with pytest.raises(RuntimeError, match="boom"):
            ft.grad(boom)(x)
        assert not torch.is_grad_enabled()


def test_inplace_under_no_grad_keeps_history():
    """`with no_grad: y.mul_(3)` changes y's value, not its history (as torch's autograd)."""

    def f(x):
        y = x * 2
        with torch.no_grad():
            y.mul_(3)
        return (y * x).sum()

    def g(x):
        buf = torch.zeros(2, dtype=x.dtype)
        with torch.no_grad():
            buf[0] = x[0] * 3
        return (buf * x).sum() + x.sum()

    x = torch.tensor([0.3, 0.7], dtype=torch.float64)
    for fn in (f, g):
        _close(ft.grad(fn)(x), tf.grad(fn)(x))
        _close(
            ft.jvp(fn, (x,), (torch.ones_like(x),))[1], tf.jvp(fn, (x,), (torch.ones_like(x),))[1]
        )


def test_inplace_under_no_grad_keeps_history_at_outer_levels():
    """The write under no_grad keeps the history of every grad level, not only the innermost
    (gaussian_nll_loss's `var.clamp_(min=eps)`: its second derivative in var was zero under
    grad(grad) and grad(jvp), and grad(jvp) in the tangent lost the tangent's history;
    conformance test_vjp_vjp[nn.functional.gaussian_nll_loss-real], cosine_similarity)."""

    def f(v):
        v = v.clone()
        with torch.no_grad():
            v.clamp_(min=1e-6)
        return (v.log() * v).sum()

    x = torch.tensor([0.6, 1.3, 0.9], dtype=torch.float64)
    t = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)

    def second_derivatives(lib):  # grad(grad), grad(jvp) in the primal and the tangent, jvp(jvp)
        return (
            lib.grad(lambda y: lib.grad(f)(y).sum())(x),
            lib.grad(lambda y: lib.jvp(f, (y,), (t,))[1])(x),
            lib.grad(lambda s: lib.jvp(f, (x,), (s,))[1])(t),
            lib.jvp(lambda y: lib.jvp(f, (y,), (t,))[1], (x,), (t,))[1],
        )

    for ours, ref in zip(second_derivatives(ft), second_derivatives(tf)):
        assert ref.abs().sum() > 0
        _close(ours, ref)


def test_fwd_grad_disabled_inside_jvp():
    import torch.autograd.forward_ad as fwAD

    def g(x):
        with fwAD._set_fwd_grad_enabled(False):
            s = x.sin()
        return s * x

    x = torch.tensor([0.3, 0.7], dtype=torch.float64)
    v = torch.ones_like(x)
    for a, b in zip(ft.jvp(g, (x,), (v,)), tf.jvp(g, (x,), (v,))):
        _close(a, b)
    _close(ft.jacfwd(g)(x), tf.jacfwd(g)(x))


def test_no_grad_inside_does_not_stop_jvp():
    """torch.no_grad is about reverse mode only (forward AD ignores it), in torch.func too."""
    x = torch.tensor([0.3, 0.7], dtype=torch.float64)
    v = torch.ones_like(x)
    for a, b in zip(ft.jvp(_sin_stopped, (x,), (v,)), tf.jvp(_sin_stopped, (x,), (v,))):
        _close(a, b)


def test_vjp_fn_under_outer_no_grad():
    x = torch.tensor([0.3, 0.7], dtype=torch.float64, requires_grad=True)
    for lib in (ft, tf):
        out, fn = lib.vjp(torch.sin, x)
        assert out.requires_grad
        with torch.no_grad():
            (r,) = fn(torch.ones(2, dtype=x.dtype))
        assert not r.requires_grad
        (r,) = fn(torch.ones(2, dtype=x.dtype))
        assert r.requires_grad


# -- 3. writes to primals, repeated argnums, randomness='error' ---------------------------------
_WRITES = {
    "jvp_copy_": lambda lib, x: lib.jvp(
        lambda a, b: a.copy_(b), (x, torch.ones_like(x)), (torch.zeros_like(x),) * 2
    ),
    "jvp_mul_": lambda lib, x: lib.jvp(lambda a: a.mul_(2), (x,), (torch.ones_like(x),)),
    "jvp_view_write": lambda lib, x: lib.jvp(lambda a: a[0].mul_(2), (x,), (torch.ones_like(x),))[
        0
    ],
    "jacfwd_mul_": lambda lib, x: lib.jacfwd(lambda a: a.mul_(2))(x),
}


@pytest.mark.parametrize("case", sorted(_WRITES))
def test_inplace_write_to_primal_reaches_caller(case):
    results = {}
    for name, lib in LIBS.items():
        x = torch.tensor([1.0, 2.0], dtype=torch.float64)
        out = _WRITES[case](lib, x)
        results[name] = (x, out)
    _close(results["ft"][0], results["torch.func"][0])  # the caller's tensor
    _close(results["ft"][1], results["torch.func"][1])  # what the transform returned


def test_inplace_write_to_primal_under_vjp_and_grad():
    """torch.func refuses these (an in-place op on a leaf it made require grad); we write the
    final value back, as jvp does, and differentiate the function as written."""
    x = torch.tensor([1.0, 2.0], dtype=torch.float64)
    out, fn = ft.vjp(lambda a: a.mul_(2), x)
    _close(x, torch.tensor([2.0, 4.0], dtype=torch.float64))
    _close(fn(torch.ones(2, dtype=x.dtype))[0], torch.full((2,), 2.0, dtype=x.dtype))
    y = torch.tensor([1.0, 2.0], dtype=torch.float64)
    g = ft.grad(lambda a: a.mul_(3).pow(2).sum())(y)
    _close(y, torch.tensor([3.0, 6.0], dtype=torch.float64))
    _close(g, 18 * torch.tensor([1.0, 2.0], dtype=torch.float64))


def test_inplace_write_to_leaf_requiring_grad_raises():
    x = torch.tensor([1.0, 2.0], dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        ft.jvp(lambda a: a.mul_(2), (x,), (torch.ones_like(x),))


@pytest.mark.parametrize("argnums", [(0, 0), (0, -2), (1, 0, 1)])
@pytest.mark.parametrize("transform", ["grad", "jacrev", "jacfwd", "grad_and_value"])
def test_repeated_argnums_raise(transform, argnums):
    f = lambda a, b: (a * b).sum() if transform.startswith("grad") else a * b  # noqa: E731
    x = torch.ones(2, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="unique"):  # torch.func's error, as reference
        getattr(tf, transform)(f, argnums=argnums)(x, x)
    with pytest.raises(RuntimeError, match=r"names the same input twice"):
        getattr(ft, transform)(f, argnums=argnums)(x, x)


_GEN = torch.Generator().manual_seed(0)
_DRAWS = {
    "randn": lambda r: torch.randn(3, dtype=r.dtype) + r,
    "generator": lambda r: torch.randn(3, generator=_GEN, dtype=r.dtype) + r,
    "meta": lambda r: torch.randn(3, device="meta").sum() * 0 + r,
    "rand_like": lambda r: torch.rand_like(r),
    "dropout": lambda r: F.dropout(r, 0.5),
    "uniform_": lambda r: r.clone().uniform_(),
    "randperm": lambda r: r[torch.randperm(3)],
    "normal": lambda r: torch.normal(0.0, 1.0, (3,), dtype=r.dtype) + r,
    "inside_grad": lambda r: ft.grad(lambda y: (y * torch.randn(3, dtype=y.dtype)).sum())(r),
}
# torch.func's reference of a draw inside our grad is the same draw inside its own grad (ours
# inside torch.func's vmap raises a TransformError first)
_TF_DRAWS = {
    "inside_grad": lambda r: tf.grad(lambda y: (y * torch.randn(3, dtype=y.dtype)).sum())(r),
}


@pytest.mark.parametrize("case", sorted(_DRAWS))
def test_randomness_error_detects_every_draw(case):
    from functransforms.errors import RandomnessError

    x = torch.zeros(4, 3, dtype=torch.float64)
    f = _DRAWS[case]
    with pytest.raises(RuntimeError, match="randomness error mode"):  # torch.func raises too
        tf.vmap(_TF_DRAWS.get(case, f))(x)
    with pytest.raises(RandomnessError, match=r"draws random numbers.*randomness='error'"):
        ft.vmap(f)(x)
    torch.randn(2)  # and outside vmap, drawing works again


def test_randomness_error_ignores_other_threads():
    import threading

    stop = threading.Event()

    def draw():
        while not stop.is_set():
            torch.randn(8)

    t = threading.Thread(target=draw)
    t.start()
    try:
        x = torch.zeros(4, 3)
        for _ in range(100):
            ft.vmap(lambda r: r.sin() * 2)(x)
    finally:
        stop.set()
        t.join()


def test_randomness_error_state_restored_after_exception():
    from functransforms.errors import RandomnessError

    with pytest.raises(RandomnessError):
        ft.vmap(lambda r: torch.randn(3) + r)(torch.zeros(2, 3))
    torch.randn(3)
    out = ft.vmap(lambda r: torch.randn(3) + r, randomness="different")(torch.zeros(5, 3))
    assert (out.std(0) > 0).all()


# -- 4. user objects are never left as wrappers; batch norm; empty batches; integer indices ------
def _write_captured(buf):
    def f(x):
        buf[0] = x.sum()
        return (buf * x).sum()

    return f


@pytest.mark.parametrize("raises", [False, True], ids=["returns", "raises"])
def test_captured_tensor_not_left_batched_after_vmap_grad(raises):
    buf = torch.zeros(3, dtype=torch.float64)
    xs = torch.randn(4, 3, dtype=torch.float64)
    f = _write_captured(buf)

    def g(x):
        out = f(x)
        if raises:
            raise ValueError("boom")
        return out

    if raises:
        with pytest.raises(ValueError, match="boom"):
            ft.vmap(ft.grad(g))(xs)
    else:
        out = ft.vmap(ft.grad(g))(xs)
        # per example: buf = [sum x, 0, 0], f = x0 * sum x
        expected = xs[:, :1].expand(4, 3) + torch.eye(3, dtype=xs.dtype)[0] * xs.sum(
            1, keepdim=True
        )
        _close(out, expected)
    assert type(buf) is torch.Tensor  # not a (dead) BatchedTensor
    _close(buf, torch.zeros(3, dtype=torch.float64))  # one value per example: the original kept
    buf.add_(1)  # an ordinary tensor again


def test_captured_tensor_written_under_nested_grad():
    """grad(grad(f)) writing a captured buffer: the buffer ends with the value eager code
    leaves, as a plain tensor, and can be written again by a later call."""
    buf = torch.zeros(3, dtype=torch.float64)
    x = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    f = _write_captured(buf)
    for _ in range(2):
        _close(ft.grad(lambda x: ft.grad(f)(x).sum())(x), torch.tensor([4.0, 1, 1]).double())
        assert type(buf) is torch.Tensor
        _close(buf, torch.tensor([6.0, 0, 0], dtype=torch.float64))
        _close(ft.grad(f)(x), torch.tensor([7.0, 1, 1], dtype=torch.float64))


def _bn(mode):
    torch.manual_seed(1)
    bn = torch.nn.BatchNorm1d(3).double()
    with torch.no_grad():
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 2)
    if mode == "eval":
        bn.eval()
    return bn


@pytest.mark.parametrize("mode", ["eval", "no_running_stats", "batched_stats"])
def test_batch_norm_under_vmap_matches_torch_func(mode):
    xs = torch.randn(4, 5, 3, dtype=torch.float64)
    results = {}
    for name, lib in LIBS.items():
        bn = _bn(mode)
        if mode == "no_running_stats":
            lib.replace_all_batch_norm_modules_(bn)
        p, b = dict(bn.named_parameters()), dict(bn.named_buffers())
        if mode == "batched_stats":
            b = {k: v.expand(4, *v.shape).clone() for k, v in b.items()}
            out = lib.vmap(
                lambda p, b, x, bn=bn, lib=lib: lib.functional_call(bn, (p, b), (x,)),
                in_dims=(None, 0, 0),
            )(p, b, xs)
            results[name] = (out, b["running_mean"], b["running_var"])
            continue

        def loss(p, x, bn=bn, b=b, lib=lib):
            return lib.functional_call(bn, (p, b), (x,)).pow(2).sum()

        out = lib.vmap(lambda x, bn=bn, p=p, b=b, lib=lib: lib.functional_call(bn, (p, b), (x,)))(
            xs
        )
        g = lib.vmap(lib.grad(loss), in_dims=(None, 0))(p, xs)
        results[name] = (out, g["weight"], g["bias"])
    for a, b in zip(results["ft"], results["torch.func"]):
        _close(a, b)


def test_batch_norm_unbatched_running_stats_raise_clearly():
    from functransforms.errors import InplaceError

    bn = _bn("train")
    before = bn.running_mean.clone()
    with pytest.raises(InplaceError, match=r"running_mean.*replace_all_batch_norm_modules_"):
        ft.vmap(bn)(torch.randn(4, 5, 3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="running_mean or running_var"):  # torch.func too
        tf.vmap(bn)(torch.randn(4, 5, 3, dtype=torch.float64))
    assert type(bn.running_mean) is torch.Tensor
    _close(bn.running_mean, before)


def test_replace_all_batch_norm_modules_is_exported():
    net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    assert ft.replace_all_batch_norm_modules_(net) is net
    assert net[1].running_mean is None and not net[1].track_running_stats


_EMPTY = {
    "vmap_grad": lambda lib: lib.vmap(lib.grad(lambda x: (x.sin() ** 2).sum()))(
        torch.randn(0, 3, dtype=torch.float64)
    ),
    "vmap_sum": lambda lib: lib.vmap(torch.sum)(torch.randn(0, 3, dtype=torch.float64)),
    "vmap_mean_dim": lambda lib: lib.vmap(lambda x: x.mean(0))(torch.randn(0, 3, 2)),
    "hessian_empty": lambda lib: lib.hessian(lambda x: (x**3).sum())(
        torch.randn(0, dtype=torch.float64)
    ),
    "jacrev_empty": lambda lib: lib.jacrev(torch.sin)(torch.randn(0, dtype=torch.float64)),
}


@pytest.mark.parametrize("case", sorted(_EMPTY))
def test_batch_size_zero(case):
    ours, ref = _EMPTY[case](ft), _EMPTY[case](tf)
    assert ours.shape == ref.shape and ours.dtype == ref.dtype


_V = torch.randn(5, dtype=torch.float64)
_M = torch.randn(5, 3, dtype=torch.float64)
_INDEXING = {
    "v[i]": (lambda i: _V[i], torch.tensor([3, 0, 4, 1])),
    "M[i]": (lambda i: _M[i], torch.tensor([3, 0, 4, 1])),
    "take_0d": (lambda i: torch.take(_V, i), torch.tensor([3, 0, -1, 1])),
    "take_2d": (lambda i: torch.take(_M, i), torch.tensor([[1, 7], [0, 14], [3, -3]])),
}


@pytest.mark.parametrize("case", sorted(_INDEXING))
def test_batched_integer_index_gathers(case):
    f, idx = _INDEXING[case]
    _close(ft.vmap(f)(idx), tf.vmap(f)(idx))


def test_take_batched_source_and_grad():
    V = torch.randn(2, 5, dtype=torch.float64)
    i = torch.tensor([[-1, 2], [0, -5]])
    _close(ft.vmap(torch.take)(V, i), tf.vmap(torch.take)(V, i))
    g = lambda lib: lib.vmap(lib.grad(lambda v, i: torch.take(v, i).pow(2).sum()))(V, i)  # noqa: E731
    _close(g(ft), g(tf))


# -- 5. torch.compile ---------------------------------------------------------------------------
def _f(x):
    return (x.sin() * x).sum()


def _g(x):
    return x.sin() * 2


_X = torch.randn(4, 3, dtype=torch.float64)
_COMPILED = {
    "vmap(grad(f))": (lambda lib: lib.vmap(lib.grad(_f)), _X),
    "jacrev(g)": (lambda lib: lib.jacrev(_g), _X[0]),
    "jacfwd(g)": (lambda lib: lib.jacfwd(_g), _X[0]),
    "hessian(f)": (lambda lib: lib.hessian(_f), _X[0]),
    "grad(f)": (lambda lib: lib.grad(_f), _X[0]),
    "vmap(g)": (lambda lib: lib.vmap(_g), _X),
}


@pytest.mark.parametrize("case", sorted(_COMPILED))
def test_torch_compile_of_our_transforms(case):
    """Used to raise an internal ValueError (a tree structure built by dynamo's traced optree,
    without our namespace, compared with ours) for vmap(grad) and jacrev."""
    import torch._dynamo

    make, x = _COMPILED[case]
    torch._dynamo.reset()
    out = torch.compile(make(ft), backend="eager")(x)
    _close(out, make(tf)(x))
    # the transform runs as one eager region (Note [torch.compile around our transforms])
    torch._dynamo.reset()
    assert torch._dynamo.explain(make(ft))(x).graph_break_count <= 1


def test_our_transforms_of_compiled_functions():
    import torch._dynamo

    torch._dynamo.reset()
    _close(ft.grad(torch.compile(_f, backend="eager"))(_X[0]), tf.grad(_f)(_X[0]))
    _close(ft.vmap(torch.compile(_g, backend="eager"))(_X), tf.vmap(_g)(_X))


# -- devices: every transform on `meta` (no values: no host reads on the way) -------------------
def _meta_cases():
    x = torch.empty(4, 3, device="meta", dtype=torch.float64)
    ones = torch.empty(3, 3, device="meta", dtype=torch.float64)
    f = lambda v: (v.sin() * v).sum()  # noqa: E731
    g = lambda v: v.exp() @ ones  # noqa: E731
    return {
        "vmap": lambda: ft.vmap(g)(x),
        "vmap_chunked": lambda: ft.vmap(g, chunk_size=2)(x),
        "vmap_randomness_different": lambda: ft.vmap(
            lambda v: v + torch.randn(3, device="meta", dtype=v.dtype), randomness="different"
        )(x),
        "grad": lambda: ft.grad(f)(x[0]),
        "value_and_grad": lambda: ft.value_and_grad(f)(x[0]),
        "vjp": lambda: ft.vjp(g, x)[1](x),
        "jvp": lambda: ft.jvp(g, (x,), (x,)),
        "linearize": lambda: ft.linearize(g, x)[1](x),
        "jacrev": lambda: ft.jacrev(g)(x[0]),
        "jacfwd": lambda: ft.jacfwd(g)(x[0]),
        "hessian": lambda: ft.hessian(f)(x[0]),
        "vmap_grad": lambda: ft.vmap(ft.grad(f))(x),
        "linear_transpose": lambda: ft.linear_transpose(lambda v: v * 2, x)(x),
        "checkpoint": lambda: ft.grad(ft.checkpoint(f))(x[0]),
    }


@pytest.mark.parametrize("case", sorted(_meta_cases()))
def test_every_transform_on_meta(case):
    out = _meta_cases()[case]()
    leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    assert leaves and all(t.device.type == "meta" for t in leaves)


def _meta_mlp_cases(lib):
    """grad / vjp / jvp / vmap / jacrev of a small MLP whose parameters and inputs live on
    `meta`, through functional_call (the model a user moves to meta to check shapes)."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2)).to(
        "meta"
    )
    params = dict(model.named_parameters())
    xs = torch.empty(4, 3, device="meta")

    def loss(p, x):
        return lib.functional_call(model, p, (x,)).pow(2).sum()

    def out(p, x):
        return lib.functional_call(model, p, (x,))

    return {
        "grad": lambda: lib.grad(loss)(params, xs[0]),
        "vjp": lambda: lib.vjp(lambda x: out(params, x), xs)[1](torch.empty(4, 2, device="meta")),
        "jvp": lambda: lib.jvp(lambda x: out(params, x), (xs,), (xs,)),
        "vmap": lambda: lib.vmap(out, in_dims=(None, 0))(params, xs),
        "vmap_grad": lambda: lib.vmap(lib.grad(loss), in_dims=(None, 0))(params, xs),
        "jacrev": lambda: lib.jacrev(out, argnums=1)(params, xs[0]),
    }


@pytest.mark.parametrize("case", sorted(_meta_mlp_cases(ft)))
def test_mlp_transforms_on_meta_give_meta_results_of_torch_funcs_shapes(case):
    try:
        ref = _meta_mlp_cases(tf)[case]()
    except Exception as e:  # torch.func refuses meta here: ours must raise too, not guess
        with pytest.raises(Exception) as ours_error:
            _meta_mlp_cases(ft)[case]()
        assert str(ours_error.value), f"torch.func raised {e!r}; ours raised without a message"
        return
    ours = _meta_mlp_cases(ft)[case]()
    a, spec_a = torch.utils._pytree.tree_flatten(ours)
    b, spec_b = torch.utils._pytree.tree_flatten(ref)
    assert spec_a == spec_b and len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert x.device.type == "meta" and (x.shape, x.dtype) == (y.shape, y.dtype)


def test_permutation_operator_norm_on_operator_device():
    from functransforms.linalg import PermutationOperator

    P = PermutationOperator(torch.tensor([2, 0, 1], device="meta"))
    assert P._frobenius_sq().device.type == "meta"


# -- packaging: Python started next to a clone named functransforms -----------------------------
def _run_beside_clone(tmp_path, code, pythonpath=None):
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[2]
    (tmp_path / "functransforms").symlink_to(
        root, target_is_directory=True
    )  # `git clone` gives this
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = str(root)  # what `editable_mode=compat` writes into its .pth
    return subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )


def test_clone_beside_the_working_directory_does_not_shadow_the_install(tmp_path):
    # The README's strict editable install puts a regular package on sys.path, which wins over
    # the clone's folder (a namespace portion) found first in the working directory.
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = "import functransforms.batching"
    installed = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True
    )
    if installed.returncode:
        pytest.skip("functransforms is not installed here (a checkout on PYTHONPATH)")
    r = _run_beside_clone(tmp_path, "import functransforms.batching, functransforms as ft; ft.vmap")
    assert r.returncode == 0, r.stderr


def test_clone_shadowing_the_package_is_detected(tmp_path):
    # What an install that loses to the clone's folder sees (setuptools' default editable
    # finder runs after the path finder): ``functransforms`` is an empty namespace package.
    code = (
        "import sys, types; ns = types.ModuleType('functransforms'); "
        "ns.__path__ = ['functransforms']; sys.modules['functransforms'] = ns; "
        "import functransforms.batching"
    )
    r = _run_beside_clone(tmp_path, code)
    assert r.returncode != 0
    assert "shadows the installed package" in r.stderr and "editable_mode=strict" in r.stderr


def test_clone_root_on_sys_path_imports_the_real_package(tmp_path):
    code = "import torch, functransforms as ft; print(ft.vmap(torch.sin)(torch.zeros(2, 1)).shape)"
    r = _run_beside_clone(tmp_path, code, pythonpath=True)
    assert r.returncode == 0, r.stderr
    assert "torch.Size([2, 1])" in r.stdout


def test_ours_inside_torch_func_raises_a_clear_error():
    """torch.func's wrappers have no storage: our transforms inside theirs failed deep inside
    ("Cannot access storage of TensorWrapper"); now a TransformError says what to do. Theirs
    inside ours works."""
    from functransforms.errors import TransformError

    x = torch.randn(3, 2, dtype=torch.float64)
    for outer in [
        lambda: tf.grad(lambda x: ft.vmap(torch.sin)(x).sum())(x),
        lambda: tf.vmap(ft.grad(lambda y: (y**3).sum()))(x),
        lambda: tf.jvp(ft.jacrev(torch.sin), (x,), (x,)),
    ]:
        with pytest.raises(TransformError, match="inside a torch.func transform"):
            outer()
    _close(ft.vmap(tf.grad(lambda y: (y**3).sum()))(x), 3 * x**2)
    _close(ft.grad(lambda x: tf.vmap(torch.sin)(x).sum())(x), x.cos())
