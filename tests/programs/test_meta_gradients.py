"""torch's autograd over what our transforms return: meta-learning and derivative penalties.

The programs torch.func's own examples teach, run with ``functransforms`` in place of
``torch.func`` and differentiated by ``torch.autograd.grad`` outside the transforms:

- MAML (the functorch Omniglot example: 3 x [Conv2d, BatchNorm2d(track_running_stats=False),
  ReLU(inplace), MaxPool2d], Flatten, Linear; an MLP with BatchNorm1d; an MLP with LayerNorm):
  per task, k inner steps ``p - lr * grad(loss)(p, support)`` through ``functional_call``, the
  query loss at the adapted parameters, over tasks with ``vmap`` or a loop; the meta-gradient is
  ``torch.autograd.grad`` of the summed query losses with respect to the initial parameters.
- Penalties on our derivatives: a Jacobian penalty by ``jacrev`` / ``jacfwd`` / ``vmap(jacrev)``,
  a Hessian-trace regularizer, the squared Hessian with respect to a weight, a Hessian-vector
  product ``jvp(grad)``; each eager and through ``jit`` (the replayed graph is what torch's
  autograd records: it must carry the same derivatives).

The oracle is the same program written with plain ``torch.autograd.grad(..., create_graph=True)``
(``PLAIN`` below: grads, Jacobians by rows, Hessians as Jacobians of Jacobians, jvp by the
double-vjp trick, vmap as a loop): the math, not another implementation. torch.func is wrong
on several of these programs (its vmap of a gradient through batch/layer norm, its forward mode
through the norms' statistics; docs/torch_func_differences.md), so it is not the oracle.
float64 throughout; agreement is 1e-6 relative.
See Note [Torch autograd through our transforms] in functransforms/_core/levels.py."""

import warnings

import pytest
import torch
import torch.func as tf
import torch.nn.functional as F
from torch import nn

import functransforms as ft
from functransforms._jit._guards import autograd_function_node, autograd_node_mark
from functransforms.errors import JitFallbackWarning

_D = torch.float64
_INNER_LR = 0.1


def _assert_grads_close(ours, theirs):
    """Each meta-gradient within 1e-6 relative of the oracle's. The floor of the absolute
    tolerance is scaled by the largest gradient: a bias before a batch norm has a true gradient
    of 0, and both sides hold rounding noise there."""
    assert [a is None for a in ours] == [b is None for b in theirs]
    scale = max(b.abs().max().item() for b in theirs if b is not None)
    for a, b in zip(ours, theirs):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9 * scale)


def _req(t):
    return t if t.requires_grad else t.detach().requires_grad_()


def _jac(y, x):
    """dy/dx by rows of plain autograd, kept differentiable: [*y.shape, *x.shape]."""
    rows = [
        torch.autograd.grad(yi, x, create_graph=True, retain_graph=True, allow_unused=True)[0]
        for yi in y.reshape(-1)
    ]
    rows = [torch.zeros_like(x) if r is None else r for r in rows]
    return torch.stack(rows).reshape(*y.shape, *x.shape)


class PLAIN:
    """The transforms these programs use, written with plain autograd (create_graph=True)."""

    functional_call = staticmethod(torch.func.functional_call)

    @staticmethod
    def grad(f):
        def g(p, *args):
            if isinstance(p, dict):
                p = {k: _req(v) for k, v in p.items()}
                gs = torch.autograd.grad(f(p, *args), list(p.values()), create_graph=True)
                return dict(zip(p, gs))
            p = _req(p)
            return torch.autograd.grad(f(p, *args), p, create_graph=True)[0]

        return g

    @staticmethod
    def jacrev(f):
        def j(x):
            x = _req(x)
            return _jac(f(x), x)

        return j

    jacfwd = jacrev

    @staticmethod
    def hessian(f):
        return PLAIN.jacrev(PLAIN.jacrev(f))

    @staticmethod
    def jvp(f, primals, tangents):
        x = _req(primals[0])
        y = f(x)
        u = torch.zeros_like(y, requires_grad=True)
        (g,) = torch.autograd.grad(y, x, u, create_graph=True)
        (jv,) = torch.autograd.grad(g, u, tangents[0], create_graph=True)
        return y, jv

    @staticmethod
    def vmap(f):
        def v(*args):
            outs = [f(*(a[i] for a in args)) for i in range(len(args[0]))]
            return torch.stack(outs)

        return v


# -- MAML --------------------------------------------------------------------------------------


class _Flatten(nn.Module):
    def forward(self, x):
        return x.view(x.size(0), -1)


def _omniglot_net(n_way, channels=2):
    """The published network (64 channels there; 2 here, for time): 28 x 28 -> 1 x 1."""
    layers, c_in = [], 1
    for _ in range(3):
        layers += [
            nn.Conv2d(c_in, channels, 3),
            nn.BatchNorm2d(channels, momentum=1, affine=True, track_running_stats=False),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2, 2),
        ]
        c_in = channels
    return nn.Sequential(*layers, _Flatten(), nn.Linear(channels, n_way))


def _mlp(norm, n_way, d_in=12, hidden=16):
    return nn.Sequential(nn.Linear(d_in, hidden), norm(hidden), nn.ReLU(), nn.Linear(hidden, n_way))


_N_WAY = 5
_MAML_NETS = {
    "omniglot_conv_batchnorm": (_omniglot_net, (1, 28, 28), 1),
    "mlp_batchnorm": (
        lambda n: _mlp(lambda d: nn.BatchNorm1d(d, track_running_stats=False), n),
        (12,),
        2,
    ),
    "mlp_layernorm": (lambda n: _mlp(nn.LayerNorm, n), (12,), 2),
}


def _tasks(n_tasks, k_shot, shape):
    """Omniglot-like tasks: n_way classes x k_shot sparse binary images per set."""
    g = torch.Generator().manual_seed(1)

    def images():
        return (torch.rand(n_tasks, _N_WAY * k_shot, *shape, generator=g) < 0.2).to(_D)

    labels = torch.arange(_N_WAY).repeat(k_shot).expand(n_tasks, -1).contiguous()
    return images(), labels, images(), labels.clone()


def _make(name):
    make, shape, k_shot = _MAML_NETS[name]
    torch.manual_seed(0)
    net = make(_N_WAY).to(_D).train()
    params = {k: v.detach().clone().requires_grad_() for k, v in net.named_parameters()}
    return net, params, _tasks(3 if name.startswith("mlp") else 2, k_shot, shape)


def _query_losses(T, net, params, tasks, inner_steps, over_tasks):
    def loss(p, x, y):
        return F.cross_entropy(T.functional_call(net, p, (x,)), y)

    def task_loss(x_spt, y_spt, x_qry, y_qry):
        new = params
        for _ in range(inner_steps):
            grads = T.grad(loss)(new, x_spt, y_spt)
            new = {k: new[k] - _INNER_LR * grads[k] for k in new}
        return loss(new, x_qry, y_qry)

    if over_tasks == "vmap":
        return T.vmap(task_loss)(*tasks)
    return torch.stack([task_loss(*(t[i] for t in tasks)) for i in range(len(tasks[0]))])


def _meta_grads(losses, params):
    return torch.autograd.grad(losses.sum(), list(params.values()))


@pytest.mark.parametrize("over_tasks", ["vmap", "loop"])
@pytest.mark.parametrize("inner_steps", [1, 3])
@pytest.mark.parametrize("name", sorted(_MAML_NETS))
def test_maml_meta_gradients_match_plain_autograd(name, inner_steps, over_tasks):
    net, params, tasks = _make(name)
    ours = _meta_grads(_query_losses(ft, net, params, tasks, inner_steps, over_tasks), params)
    plain = _meta_grads(_query_losses(PLAIN, net, params, tasks, inner_steps, "loop"), params)
    _assert_grads_close(ours, plain)


def test_maml_oracle_is_plain_autograd():
    """The oracle ``PLAIN`` is double backward written by hand, and torch.func's loop over tasks
    (reverse mode only) agrees with it: the oracle itself is checked."""
    net, params, tasks = _make("mlp_layernorm")
    theirs = _meta_grads(_query_losses(tf, net, params, tasks, 2, "loop"), params)
    oracle = _meta_grads(_query_losses(PLAIN, net, params, tasks, 2, "loop"), params)
    _assert_grads_close(oracle, theirs)
    names = list(params)

    def loss(p, x, y):
        return F.cross_entropy(torch.func.functional_call(net, p, (x,)), y)

    total = 0
    for x_spt, y_spt, x_qry, y_qry in zip(*tasks):
        new = params
        for _ in range(2):
            grads = torch.autograd.grad(
                loss(new, x_spt, y_spt), [new[k] for k in names], create_graph=True
            )
            new = {k: new[k] - _INNER_LR * g for k, g in zip(names, grads)}
        total = total + loss(new, x_qry, y_qry)
    plain = torch.autograd.grad(total, [params[k] for k in names])
    _assert_grads_close(theirs, plain)


def test_maml_through_jit_matches_plain_autograd():
    """The jitted meta-step (inner loop, vmap over tasks): its meta-gradient is torch.func's, on
    the tracing call and on the next one."""
    net, params, tasks = _make("mlp_batchnorm")
    jitted = ft.jit(lambda p, *tasks: _query_losses(ft, net, p, tasks, 3, "vmap"))
    theirs = _meta_grads(_query_losses(PLAIN, net, params, tasks, 3, "loop"), params)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            _assert_grads_close(_meta_grads(jitted(params, *tasks), params), theirs)
    fallbacks = [w for w in caught if issubclass(w.category, JitFallbackWarning)]
    # replayed, or (never silently) eager where the graph holds an autograd.Function
    assert jitted.cache_info().hits == 1 or "autograd.Function" in str(fallbacks[0].message)


# -- penalties on our Jacobians and Hessians ---------------------------------------------------


def _small_mlp(norm):
    torch.manual_seed(0)
    layers = (
        [nn.Linear(3, 8)] + ([norm(8)] if norm is not None else []) + [nn.Tanh(), nn.Linear(8, 2)]
    )
    return nn.Sequential(*layers).to(_D).train()


_PENALTY_NETS = {
    "tanh": None,
    "layernorm": nn.LayerNorm,
    "layernorm_no_affine": lambda d: nn.LayerNorm(d, elementwise_affine=False),
    "batchnorm": lambda d: nn.BatchNorm1d(d, track_running_stats=False),
}


def _penalties(T, net):
    """Scalar programs of (params, x) whose value is built from T's derivatives."""

    def call(p, x):
        return T.functional_call(net, p, (x,))

    def jacobian_penalty_jacrev(p, x):  # batch norm mixes the batch: the whole [4,2,4,3]
        return T.jacrev(lambda x: call(p, x))(x).pow(2).sum()

    def jacobian_penalty_jacfwd(p, x):
        return T.jacfwd(lambda x: call(p, x))(x).pow(2).sum()

    def per_sample_jacobian_penalty(p, x):  # [4, 2, 3]
        return T.vmap(T.jacrev(lambda xi: call(p, xi[None])[0]))(x).pow(2).sum()

    def hessian_trace(p, x):
        H = T.hessian(lambda x: call(p, x).pow(2).sum())(x)  # [4, 3, 4, 3]
        return H.reshape(x.numel(), x.numel()).diagonal().sum()

    def weight_hessian_norm(p, x):
        def f(w):
            return call({**p, "0.weight": w}, x).pow(2).sum()

        return T.hessian(f)(p["0.weight"]).pow(2).sum()  # [8, 3, 8, 3]

    def hessian_vector_product(p, x):
        def f(x):
            return call(p, x).pow(2).sum()

        return T.jvp(T.grad(f), (x,), (torch.ones_like(x),))[1].pow(2).sum()

    programs = [
        jacobian_penalty_jacrev,
        jacobian_penalty_jacfwd,
        hessian_trace,
        weight_hessian_norm,
        hessian_vector_product,
    ]
    if not isinstance(net[1], nn.BatchNorm1d):  # one sample has no batch statistics
        programs.append(per_sample_jacobian_penalty)
    return {f.__name__: f for f in programs}


_PROGRAMS = sorted(_penalties(ft, _small_mlp(None)))


def _outer_grads(program, net, x):
    params = {k: v.detach().clone().requires_grad_() for k, v in net.named_parameters()}
    x = x.clone().requires_grad_()
    out = program(params, x)
    return torch.autograd.grad(out, [*params.values(), x], allow_unused=True)


def _directional_fd(program, net, x, grads, n_dirs=2, eps=1e-5):
    """<grads, v> against central differences of the program's value along random directions
    v of (params, x): the oracle where torch's own higher derivatives of a norm are wrong."""
    params = {k: v.detach() for k, v in net.named_parameters()}
    g = torch.Generator().manual_seed(3)
    for _ in range(n_dirs):
        v = {k: torch.randn(p.shape, generator=g, dtype=_D) for k, p in params.items()}
        vx = torch.randn(x.shape, generator=g, dtype=_D)

        def phi(t, v=v, vx=vx):
            return program({k: p + t * v[k] for k, p in params.items()}, x + t * vx).item()

        fd = (phi(eps) - phi(-eps)) / (2 * eps)
        dots = [(a * b).sum() for a, b in zip(grads, [*v.values(), vx]) if a is not None]
        got = sum(dots).item()
        assert abs(got - fd) <= 1e-6 * max(abs(fd), 1.0), (got, fd)


# torch's own derivatives of the norms are wrong past the second order (its double-backward
# formulas of native_layer_norm/batch_norm are differentiated again, docs/design), and torch.func
# through them too: there, finite differences decide.
_THIRD_ORDER = {"hessian_trace", "weight_hessian_norm", "hessian_vector_product"}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("program", _PROGRAMS)
@pytest.mark.parametrize("norm", sorted(_PENALTY_NETS))
def test_autograd_of_derivative_penalties_matches_plain_autograd(norm, program, jit):
    net = _small_mlp(_PENALTY_NETS[norm])
    if program not in _penalties(ft, net):
        pytest.skip("batch norm needs a batch: no per-sample Jacobian")
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(2), dtype=_D)
    ours_fn = _penalties(ft, net)[program]
    if norm != "tanh" and program in _THIRD_ORDER:
        _directional_fd(ours_fn, net, x, _outer_grads(ours_fn, net, x))
        theirs = _outer_grads(ours_fn, net, x)  # the jitted program must equal eager
    else:
        theirs = _outer_grads(_penalties(PLAIN, net)[program], net, x)
    if not jit:
        _assert_grads_close(_outer_grads(ours_fn, net, x), theirs)
        return
    jitted = ft.jit(ours_fn)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # the tracing call, then a replay (or the eager fallback)
            _assert_grads_close(_outer_grads(jitted, net, x), theirs)
    fallbacks = [w for w in caught if issubclass(w.category, JitFallbackWarning)]
    if norm == "tanh":  # nothing torch's autograd needs besides the ATen ops: replayed
        assert not fallbacks and jitted.cache_info().hits == 1
    else:  # replayed, or (never silently) eager where the graph holds an autograd.Function
        assert jitted.cache_info().hits == 1 or "autograd.Function" in str(fallbacks[0].message)


def test_jit_finds_autograd_function_nodes_made_by_the_call():
    """The replay guard behind the jit cases above: torch's graph of a result is walked back to
    the history made before the call; a custom node in between is found by its class."""

    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, g):
            return 2 * g

    x = torch.randn(3, dtype=_D, requires_grad=True)
    before = Twice.apply(x.sin())
    mark = autograd_node_mark()
    assert autograd_function_node([before.cos()], mark) is None
    assert autograd_function_node([Twice.apply(before.cos()).exp()], mark) == "Twice"
    assert autograd_function_node([x.detach()], mark) is None
