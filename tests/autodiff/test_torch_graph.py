"""torch's own autograd over what our transforms return (autodiff/_torch_graph.py, Note [Outputs
torch leaves without a graph]; Note [Torch autograd through our transforms]).

Each case is checked against the same composition through torch.func, which agrees with plain
``torch.autograd.grad(..., create_graph=True)`` on all of them (asserted too where it is cheap).
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import functransforms as ft

DT = torch.float64


def _close(a, b, tol=1e-10):
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    scale = max(b.abs().max().item(), 1.0)
    assert (a - b).abs().max().item() <= tol * scale, (a, b)


def _ln(x):
    return F.layer_norm(x, (4,))


def _ln_affine(x):
    return F.layer_norm(x, (4,), torch.linspace(0.5, 1.5, 4, dtype=DT), torch.ones(4, dtype=DT))


def _bn(x):
    return F.batch_norm(x, None, None, training=True)


def _gn(x):
    return F.group_norm(x.reshape(2, 4, 3), 2).reshape(x.shape)


def _cos(x):
    return F.cosine_similarity(x[0], x[1], dim=0)


def _pad(x):
    return F.pad(x.reshape(1, *x.shape), (1, 1), mode="circular")[0]


FUNCS = {"layer_norm": _ln, "layer_norm_affine": _ln_affine, "batch_norm": _bn}
FUNCS.update({"group_norm": _gn, "cosine_similarity": _cos, "circular_pad": _pad})
SHAPES = {"group_norm": (2, 12)}


def _inputs(name):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SHAPES.get(name, (3, 4)), generator=g, dtype=DT)
    return x, g


@pytest.mark.parametrize("name", sorted(FUNCS))
def test_autograd_over_vjp_is_double_backward(name):
    f = FUNCS[name]
    x0, g = _inputs(name)
    ct0 = torch.randn(f(x0).shape, generator=g, dtype=DT)
    gg = torch.randn(x0.shape, generator=g, dtype=DT)
    got = []
    for lib in (ft, torch.func):
        x, ct = x0.clone().requires_grad_(), ct0.clone().requires_grad_()
        _, pull = lib.vjp(f, x)
        (gx,) = pull(ct)
        got.append(torch.autograd.grad(gx, (x, ct), gg, allow_unused=True, materialize_grads=True))
    x, ct = x0.clone().requires_grad_(), ct0.clone().requires_grad_()
    (gx,) = torch.autograd.grad(f(x), x, ct, create_graph=True)
    plain = torch.autograd.grad(gx, (x, ct), gg, allow_unused=True, materialize_grads=True)
    for ours, theirs, ref in zip(*got, plain):
        _close(ours, theirs)
        _close(theirs, ref)


@pytest.mark.parametrize("name", sorted(FUNCS))
def test_autograd_through_vmap(name):
    f = FUNCS[name]
    x0, g = _inputs(name)
    xs0 = torch.stack([x0, 1.1 * x0 + 0.05])
    ct = torch.randn(torch.func.vmap(f)(xs0).shape, generator=g, dtype=DT)
    got = []
    for lib in (ft, torch.func):
        xs = xs0.clone().requires_grad_()
        got.append(torch.autograd.grad(lib.vmap(f)(xs), xs, ct)[0])
    _close(*got)


def _fd_grad(phi, x, eps=1e-6):
    g = torch.zeros_like(x)
    for i in range(x.numel()):
        e = torch.zeros(x.numel(), dtype=x.dtype)
        e[i] = eps
        e = e.view_as(x)
        g.view(-1)[i] = (phi(x + e) - phi(x - e)) / (2 * eps)
    return g


@pytest.mark.parametrize("name", sorted(FUNCS))
def test_autograd_over_jvp(name):
    """Against finite differences of ``<f(x), c0> + <jvp(f)(x, t), c1>`` in x and in t:
    torch.func is wrong here for the norms (its forward formulas read mean/rstd, which torch's
    reverse mode takes for constants)."""
    f = FUNCS[name]
    x0, g = _inputs(name)
    t0 = torch.randn(x0.shape, generator=g, dtype=DT)
    c0, c1 = (torch.randn(f(x0).shape, generator=g, dtype=DT) for _ in range(2))

    def phi(x, t):
        out, tan = ft.jvp(f, (x,), (t,))
        return (out * c0).sum() + (tan * c1).sum()

    x, t = x0.clone().requires_grad_(), t0.clone().requires_grad_()
    out = ft.jvp(f, (x,), (t,))
    gx, gt = torch.autograd.grad(out, (x, t), (c0, c1), allow_unused=True, materialize_grads=True)
    _close(gx, _fd_grad(lambda x: phi(x, t0), x0), 1e-6)
    _close(gt, _fd_grad(lambda t: phi(x0, t), t0), 1e-6)


@pytest.mark.parametrize(
    "name", ["layer_norm", "layer_norm_affine", "group_norm", "cosine_similarity"]
)
def test_autograd_over_vmap_of_grad(name):
    """Per-example gradients differentiated again by torch (learned optimizers, MAML over tasks)."""
    f = FUNCS[name]
    x0, g = _inputs(name)
    ct = torch.randn(f(x0).shape, generator=g, dtype=DT)
    xs0 = torch.stack([x0, 1.1 * x0 + 0.05])
    gg = torch.randn(xs0.shape, generator=g, dtype=DT)

    def h(z):
        return (f(z) * ct).sum()

    got = []
    for lib in (ft, torch.func):
        xs = xs0.clone().requires_grad_()
        got.append(torch.autograd.grad(lib.vmap(lib.grad(h))(xs), xs, gg)[0])
    _close(*got)


def test_meta_gradient_of_one_inner_step_through_layer_norm():
    """One inner step of ``ft.grad`` through Linear + LayerNorm, then ``.backward()``: the
    meta-gradient equals create_graph=True autograd's (it was 15% off)."""
    torch.manual_seed(0)
    x, y = torch.randn(10, 20, dtype=DT), torch.randint(0, 16, (10,))
    for norm in (nn.LayerNorm(16), nn.LayerNorm(16, elementwise_affine=False)):
        net = nn.Sequential(nn.Linear(20, 16), norm).to(DT)
        p = dict(net.named_parameters())

        def loss(p, x, net=net):
            return F.cross_entropy(torch.func.functional_call(net, p, x), y)

        grads = []
        for g_of in (ft.grad(loss), torch.func.grad(loss)):
            g = g_of(p, x)
            meta = loss({k: p[k] - 0.1 * g[k] for k in p}, x)
            grads.append(torch.autograd.grad(meta, p["0.weight"])[0])
        (gw,) = [torch.autograd.grad(loss(p, x), list(p.values()), create_graph=True)]
        plain = loss({k: p[k] - 0.1 * gk for k, gk in zip(p, gw)}, x)
        _close(grads[0], grads[1])
        _close(grads[1], torch.autograd.grad(plain, p["0.weight"])[0])


def test_aux_outputs_are_differentiable_through_our_rule():
    """native_layer_norm's mean and rstd have a graph under our transforms (torch declares them
    non-differentiable); their gradient is our rule's, checked by finite differences."""
    x0 = torch.randn(3, 4, dtype=DT)

    def stats(x):
        _, mean, rstd = torch.ops.aten.native_layer_norm(x, [4], None, None, 1e-5)
        return (mean * rstd).sum()

    xs = x0.clone().requires_grad_()
    out = ft.vmap(lambda r: stats(r[None]))(xs)
    (g,) = torch.autograd.grad(out.sum(), xs)
    fd = torch.zeros_like(x0)
    eps = 1e-6
    for i in range(x0.numel()):
        e = torch.zeros(x0.numel(), dtype=DT)
        e[i] = eps
        e = e.view_as(x0)
        fd.view(-1)[i] = (stats(x0 + e) - stats(x0 - e)) / (2 * eps)
    _close(g, fd, 1e-6)


def test_write_under_no_grad_keeps_torch_history():
    """torch's cosine_similarity clamps its norms in place under no_grad: the value changes, the
    history stays (as in eager torch), at the grad level, under vmap and under jvp."""

    def h(x):
        n = x.norm().clone()
        with torch.no_grad():
            n.clamp_min_(1e-8)
        return (x / n) * x[0]

    g = torch.Generator().manual_seed(0)
    xs0, ts0, gg = (torch.randn(2, 4, generator=g, dtype=DT) for _ in range(3))

    def run(lib):
        xs, ts = xs0.clone().requires_grad_(), ts0.clone().requires_grad_()
        gs = lib.vmap(lib.grad(lambda z: (h(z) * gg[0]).sum()))(xs)
        o, t = lib.vmap(lambda x, t: lib.jvp(h, (x,), (t,)))(xs, ts)
        return torch.autograd.grad((gs, o, t), (xs, ts), (gg, gg, 0.5 * gg))

    for ours, theirs in zip(run(ft), run(torch.func)):
        _close(ours, theirs)


def test_nothing_outside_requires_grad_adds_no_torch_node():
    """The mechanism only acts where torch records: plain inputs give plain results."""
    x = torch.randn(3, 4, dtype=DT)
    out, pull = ft.vjp(_ln_affine, x)
    assert out.grad_fn is None and pull(torch.ones_like(out))[0].grad_fn is None


def _through_vmap_equals_loop(f, xs0):
    ct = torch.randn(torch.func.vmap(f)(xs0).shape, generator=torch.Generator().manual_seed(1))
    ct = ct.to(xs0.dtype)
    xs = xs0.clone().requires_grad_()
    (ours,) = torch.autograd.grad(ft.vmap(f)(xs), xs, ct)
    xs = xs0.clone().requires_grad_()
    (loop,) = torch.autograd.grad(torch.stack([f(x) for x in xs]), xs, ct)
    _close(ours, loop)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_backward_through_vmap_of_embedding_bag(mode):
    """torch picks its forward-only kernel when the (wrapped) weight does not require grad;
    torch's autograd refuses to record that one: the recorded twin runs instead."""
    ii, off = torch.tensor([1, 2, 4, 5, 8]), torch.tensor([0, 2])
    ws = torch.randn(2, 10, 4, dtype=DT)
    _through_vmap_equals_loop(lambda w: F.embedding_bag(ii, w, off, mode=mode), ws)


def test_backward_through_vmap_of_safe_softmax_with_a_masked_row():
    """A row of -inf: torch's decomposition of _safe_softmax gave nan gradients."""
    xs = torch.randn(2, 3, 4, dtype=DT)
    xs[0, 1] = float("-inf")
    _through_vmap_equals_loop(lambda x: torch.ops.aten._safe_softmax(x, -1), xs)


def _write_slice(x):
    out = x.new_zeros(6)
    out[1:4].copy_(x)
    out[0:1].copy_(x[2:3])
    return out


def _write_diagonal(x):
    out = x.new_zeros(3, 3)
    out.diagonal().copy_(x)
    return out


def _write_rows(x):
    out = x.new_zeros(2, 3)
    out[1].copy_(x)
    out[0].copy_(x.flip(0))
    return out


def _zero_a_slice(x):
    y = x * 2
    y[1:].zero_()
    return y


def _circular_pad_1d(x):
    return F.pad(x[None, None], (1, 2), mode="circular")[0, 0]


WRITES = [_write_slice, _write_diagonal, _write_rows, _zero_a_slice, _circular_pad_1d]


@pytest.mark.parametrize("dtype", [DT, torch.complex128])
@pytest.mark.parametrize("f", WRITES, ids=lambda f: f.__name__.strip("_"))
def test_writes_into_views_of_an_input_that_requires_grad(f, dtype):
    """Our levels scatter a write through a view back into its base with slice_scatter,
    select_scatter, diagonal_scatter: run on our wrappers, they are the level's business, not
    torch's. Substituted by the form torch's autograd records (meant for plain values) they
    lost the write: complex results came out zero under vjp, jvp and grad of an input that
    requires grad (circular pad too)."""
    x0 = torch.randn(3, generator=torch.Generator().manual_seed(0), dtype=dtype)
    c = torch.randn(f(x0).shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
    x = x0.clone().requires_grad_()
    out, pull = ft.vjp(f, x)
    _close(out, f(x0))
    _close(ft.jvp(f, (x,), (torch.ones_like(x0),))[0], f(x0))

    def loss(x):
        return (f(x) * c).real.sum()

    (plain,) = torch.autograd.grad(loss(x), x, create_graph=True)
    ours = ft.grad(loss)(x)
    _close(ours, plain)
    # torch's autograd over our pullback: double backward
    w = torch.randn(x0.shape, generator=torch.Generator().manual_seed(2), dtype=dtype)
    (g_ours,) = pull(c)
    (g_plain,) = torch.autograd.grad(f(x), x, c, create_graph=True)
    _close(g_ours, g_plain)
    (ours2,) = torch.autograd.grad((g_ours * w).real.sum() + (out * c).real.sum(), x)
    (plain2,) = torch.autograd.grad((g_plain * w).real.sum() + (f(x) * c).real.sum(), x)
    _close(ours2, plain2)
