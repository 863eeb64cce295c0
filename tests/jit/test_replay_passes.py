"""The replay's graph passes (functransforms/_jit/_passes.py): each one rewrites what it should,
leaves what it must not touch, keeps values bit-identical to the plain replay and keeps
torch's autograd derivatives."""

from __future__ import annotations

import pytest
import torch

import functransforms as ft
from functransforms._jit import _passes as passes

aten = torch.ops.aten
_PASSES = (
    "_common_subexpressions",
    "_view_round_trips",
    "_keepdim_sums",
    "_scalar_identities",
    "_python_bindings",
)


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _plain(monkeypatch, f, *args):
    """f's jit result with the passes under test turned off (the plain replay)."""
    with monkeypatch.context() as m:
        for name in _PASSES:
            m.setattr(passes, name, lambda gm: 0)
        j = ft.jit(f)
        j(*args)
        return j(*args), j.graph(*args)


def _both(monkeypatch, f, *args):
    plain, plain_gm = _plain(monkeypatch, f, *args)
    j = ft.jit(f)
    j(*args)
    out = j(*args)
    torch.testing.assert_close(out, plain, rtol=0, atol=0, equal_nan=True)  # bit-identical
    # eager: the plain replay's own rewrites round
    torch.testing.assert_close(out, f(*args), equal_nan=True)
    return j.graph(*args), plain_gm


# -- common subexpressions ---------------------------------------------------------------------
def test_common_subexpressions_computes_once(monkeypatch):
    x = torch.randn(5, dtype=torch.float64)
    gm, plain = _both(monkeypatch, lambda x: x.cos() * 2 + x.cos().exp(), x)
    assert _targets(plain).count(aten.cos.default) == 2
    assert _targets(gm).count(aten.cos.default) == 1


def test_common_subexpressions_keeps_random_draws_and_fresh_buffers():
    # two draws (and dropout's two empty_like buffers, each written by its own bernoulli_)
    x = torch.randn(50, dtype=torch.float64)
    f = lambda x: (
        torch.rand_like(x)
        - torch.rand_like(x)
        + torch.dropout(x, 0.5, True)
        - torch.dropout(x, 0.5, True)
    )  # noqa: E501
    j = ft.jit(f)
    j(x)
    torch.manual_seed(3)
    eager = f(x)
    torch.manual_seed(3)
    out = j(x)
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    assert out.abs().max() > 0  # merged draws would cancel to zeros


def test_common_subexpressions_keeps_a_written_result_apart():
    x = torch.randn(4, dtype=torch.float64)

    def f(x):
        a = x.sin()
        b = x.sin()
        b.mul_(3)  # a must not see this
        return a + b

    j = ft.jit(f)
    j(x)
    torch.testing.assert_close(j(x), f(x), rtol=0, atol=0)
    assert _targets(j.graph(x)).count(aten.sin.default) == 2


def test_common_subexpressions_kept_when_torch_autograd_records():
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    j = ft.jit(lambda x: x.cos() * 2 + x.cos().exp())
    j(x)
    assert _targets(j.graph(x)).count(aten.cos.default) == 2


def test_common_subexpressions_keeps_two_returned_results_distinct():
    x = torch.randn(4, dtype=torch.float64)
    j = ft.jit(lambda x: (x.sin(), x.sin()))
    j(x)
    a, b = j(x)
    assert a.data_ptr() != b.data_ptr()
    a.add_(1)
    torch.testing.assert_close(b, x.sin(), rtol=0, atol=0)


# -- view round trips --------------------------------------------------------------------------
def test_view_round_trip_is_dropped(monkeypatch):
    x = torch.randn(3, 4, 5, dtype=torch.float64)
    f = lambda x: x.transpose(1, 2).transpose(1, 2).exp()  # noqa: E731
    gm, plain = _both(monkeypatch, f, x)
    assert _targets(plain).count(aten.transpose.int) == 2
    assert aten.transpose.int not in _targets(gm)


def test_view_to_another_layout_is_kept(monkeypatch):
    x = torch.randn(3, 4, 5, dtype=torch.float64)
    f = lambda x: x.transpose(1, 2).transpose(0, 2).exp()  # noqa: E731
    gm, _ = _both(monkeypatch, f, x)
    assert _targets(gm).count(aten.transpose.int) == 2


def test_view_round_trip_keeps_detach():
    # detach returns an alias of the same layout, but it stops torch's gradients
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    j = ft.jit(lambda x: x.detach() * x)
    j(x)
    (g,) = torch.autograd.grad(j(x).sum(), x)
    torch.testing.assert_close(g, x.detach(), rtol=0, atol=0)


def test_returned_view_round_trip_stays_a_fresh_alias():
    x = torch.randn(3, 4, dtype=torch.float64)
    j = ft.jit(lambda x: x.t().t())
    j(x)
    out = j(x)
    assert out is not x and out.data_ptr() == x.data_ptr()


# -- sums kept and viewed flat -------------------------------------------------------------------
def test_keepdim_sum_viewed_flat_becomes_a_plain_sum(monkeypatch):
    x = torch.randn(6, 5, dtype=torch.float64)
    f = lambda x: x.sum(1, keepdim=True).view(6) * 2  # noqa: E731 - vmap's rules emit this
    gm, plain = _both(monkeypatch, f, x)
    sums = [n for n in gm.graph.nodes if n.target is aten.sum.dim_IntList]
    assert sums and all(len(n.args) < 3 or n.args[2] is False for n in sums)
    assert len(gm.graph.nodes) < len(plain.graph.nodes)


def test_keepdim_sum_with_another_reader_is_kept(monkeypatch):
    x = torch.randn(6, 5, dtype=torch.float64)

    def f(x):
        s = x.sum(1, keepdim=True)
        return s.view(6) + s.exp().view(6)

    gm, _ = _both(monkeypatch, f, x)
    (s,) = [n for n in gm.graph.nodes if n.target is aten.sum.dim_IntList]
    assert s.args[2] is True


# -- Python bindings -----------------------------------------------------------------------------
def test_bindings_replay_the_same_overload(monkeypatch):
    x = torch.randn(4, 4, dtype=torch.float64)
    f = lambda x: (x.t() @ x).sin() * 2 + 1  # noqa: E731
    gm, _ = _both(monkeypatch, f, x)
    marked = {n.target: n.meta.get("binding") for n in gm.graph.nodes if n.op == "call_function"}
    assert marked[aten.mm.default] is torch._C._VariableFunctions.mm
    assert marked[aten.mul.Tensor] is torch._C._VariableFunctions.mul


def test_binding_check_refuses_another_overload():
    # torch.sum(x, dtype=...) is sum.default, not sum.dim_IntList: the check must see it
    g = torch.fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(3, 4)
    node = g.call_function(aten.sum.dim_IntList, (x, [0]))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    fn = passes._binding_of(node, gm)
    assert fn is not None
    rec, t = passes._Record(), torch.empty(3, 4, device="meta")
    with rec:
        fn(t, [0])
    assert rec.calls[0][0] is aten.sum.dim_IntList
    node2 = g.call_function(aten.sum.default, (x,), {"dtype": torch.float64})
    fn2 = passes._binding_of(node2, gm)
    if fn2 is not None:
        rec = passes._Record()
        with rec:
            fn2(t, dtype=torch.float64)
        assert rec.calls[0][0] is aten.sum.default


def test_bindings_do_not_call_torch_function_of_a_subclass():
    calls = []

    class Sub(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            calls.append(func)
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))

    x = torch.randn(3, dtype=torch.float64)
    j = ft.jit(lambda x: x.sin() * 2)
    sub = x.as_subclass(Sub)
    j(sub)  # traced: f runs, and sees its __torch_function__
    calls.clear()
    out = j(sub)
    torch.testing.assert_close(out.as_subclass(torch.Tensor), x.sin() * 2, rtol=0, atol=0)
    # as through _op: nothing above the dispatcher (the signature reads metadata only)
    assert not [c for c in calls if getattr(c, "__name__", "") in ("sin", "mul", "__mul__")]


# -- all passes together: workloads, and torch autograd through the replay -----------------------
def _maml():
    torch.manual_seed(0)
    p = {
        "w0": torch.randn(8, 1, dtype=torch.float64),
        "b0": torch.zeros(8, dtype=torch.float64),
        "w1": torch.randn(1, 8, dtype=torch.float64),
        "b1": torch.zeros(1, dtype=torch.float64),
    }
    xs, xq = torch.randn(4, 5, 1, dtype=torch.float64), torch.randn(4, 5, 1, dtype=torch.float64)
    ys, yq = xs.sin(), xq.sin()

    def mse(p, x, y):
        h = torch.relu(torch.nn.functional.linear(x, p["w0"], p["b0"]))
        return ((torch.nn.functional.linear(h, p["w1"], p["b1"]) - y) ** 2).mean()

    def task(p, xs, ys, xq, yq):
        g = ft.grad(mse)(p, xs, ys)
        return mse({k: p[k] - 0.1 * g[k] for k in p}, xq, yq)

    def meta(p, xs, ys, xq, yq):
        return ft.vmap(task, in_dims=(None, 0, 0, 0, 0))(p, xs, ys, xq, yq).mean()

    return meta, (p, xs, ys, xq, yq), mse


def test_maml_meta_gradient_is_bit_identical_to_the_plain_replay(monkeypatch):
    meta, args, mse = _maml()
    f = ft.grad(meta)
    gm, plain = _both(monkeypatch, f, *args)
    assert len(gm.graph.nodes) < len(plain.graph.nodes)
    leaves = {k: v.clone().requires_grad_() for k, v in args[0].items()}

    def oracle_task(i):
        g = torch.autograd.grad(
            mse(leaves, args[1][i], args[2][i]), list(leaves.values()), create_graph=True
        )
        adapted = {k: leaves[k] - 0.1 * gi for k, gi in zip(leaves, g)}
        return mse(adapted, args[3][i], args[4][i])

    loss = torch.stack([oracle_task(i) for i in range(4)]).mean()
    ref = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))
    out = ft.jit(f)(*args)
    for k in ref:
        torch.testing.assert_close(out[k], ref[k])


@pytest.mark.parametrize("which", ["maml_loss", "hvp"])
def test_torch_autograd_through_the_rewritten_replay(monkeypatch, which):
    if which == "maml_loss":
        meta, args, _ = _maml()
        f = meta
        p = {k: v.clone().requires_grad_() for k, v in args[0].items()}
        call = (p, *args[1:])
        inputs = list(p.values())
    else:
        A = torch.randn(6, 6, dtype=torch.float64)
        h = lambda x: (x.sin() * (A @ x)).sum()  # noqa: E731
        f = lambda x, v: ft.jvp(ft.grad(h), (x,), (v,))[1]  # noqa: E731
        x = torch.randn(6, dtype=torch.float64, requires_grad=True)
        call = (x, torch.randn(6, dtype=torch.float64))
        inputs = [x]
    j = ft.jit(f)
    j(*call)
    got = torch.autograd.grad(j(*call).sum(), inputs)
    with monkeypatch.context() as m:
        for name in _PASSES:
            m.setattr(passes, name, lambda gm: 0)
        plain = ft.jit(f)
        plain(*call)
        want = torch.autograd.grad(plain(*call).sum(), inputs)
    eager = torch.autograd.grad(f(*call).sum(), inputs)
    for a, b, c in zip(got, want, eager):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # bit-identical to the plain replay
        torch.testing.assert_close(a, c)


# -- scalar identities -------------------------------------------------------------------------
def test_scalar_identities_drop_unit_powers_and_fold_negations(monkeypatch):
    # the vjp of (a - b) ** 2 scaled by a learning rate: pow(x, 1), mul(x, -1), mul(., lr)
    a, b = torch.randn(6, dtype=torch.float64), torch.randn(6, dtype=torch.float64)

    def step(a, b):
        g = ft.grad(lambda b: ((a - b) ** 2).sum())(b)
        return b - 0.01 * g

    gm, plain = _both(monkeypatch, step, a, b)
    assert len(_targets(gm)) < len(_targets(plain))
    gm, plain = _both(monkeypatch, lambda a, b: (a - b) ** 1 * 2, a, b)
    assert aten.pow.Tensor_Scalar in _targets(plain)
    assert aten.pow.Tensor_Scalar not in _targets(gm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.complex128])
def test_scalar_identities_are_bit_identical_at_the_edges(monkeypatch, dtype):
    x = torch.tensor([0.0, -0.0, 1e-310, 3.0e38, float("inf"), float("nan"), -2.5])
    x = x.to(dtype) if not dtype.is_complex else torch.complex(x, x.flip(0)).to(dtype)
    f = lambda x: (x.sin() ** 1 * 1 * -1) * 0.3 + (x.cos() * -1) * -7.0  # noqa: E731
    gm, plain = _both(monkeypatch, f, x)
    assert len(_targets(gm)) < len(_targets(plain))


def test_scalar_identities_keep_returned_and_written_results():
    x = torch.randn(4, dtype=torch.float64)

    def f(x):
        y = x.sin()
        z = y**1  # z must not alias y: y is written below
        y.mul_(3)
        w = x.cos() * 1  # returned: its own memory
        return z, w

    j = ft.jit(f)
    j(x)
    z, w = j(x)
    torch.testing.assert_close(z, x.sin(), rtol=0, atol=0)
    assert aten.pow.Tensor_Scalar in _targets(j.graph(x))
    assert aten.mul.Tensor in _targets(j.graph(x))


def test_scalar_identities_keep_a_product_read_by_absolute_offsets():
    # as_strided reads absolute storage offsets: x * 1 must stay a buffer of its own when the
    # piece it multiplies is a view at an offset into another tensor
    x = torch.randn(6, dtype=torch.float64)

    def f(x):
        y = x.split(2)[1] * 1
        return y.as_strided((2,), (1,), 0) + 0

    j = ft.jit(f)
    j(x)
    torch.testing.assert_close(j(x), f(x), rtol=0, atol=0)
    assert aten.mul.Tensor in _targets(j.graph(x))


# -- outer products ----------------------------------------------------------------------------


def _layouts(rng, shape):
    """A tensor of ``shape`` in a random layout: a permuted dense buffer, sliced, or any
    strides at all (ties and overlaps included)."""
    if torch.rand(1, generator=rng) < 0.4:
        strides = [int(s) for s in torch.randint(0, 7, (len(shape),), generator=rng)]
        storage = torch.randn(200, dtype=torch.float64, generator=rng)
        return storage.as_strided(shape, strides)
    perm = torch.randperm(len(shape), generator=rng).tolist()
    base = torch.randn([shape[p] * 2 for p in perm], dtype=torch.float64, generator=rng)
    base = base[tuple(slice(None, None, 2) for _ in perm)]  # non-dense strides too
    inverse = sorted(range(len(perm)), key=perm.__getitem__)
    return base.permute(inverse)


def test_broadcast_result_strides_match_torch_mul():
    # the outer-product pass swaps a matmul for a mul only when the mul's result has the
    # matmul's layout; that layout is computed without running a meta kernel, and must be
    # the one torch's mul gives
    rng = torch.Generator().manual_seed(0)
    for _ in range(400):
        batch = torch.randint(1, 4, (int(torch.randint(0, 3, (1,), generator=rng)),), generator=rng)
        m, n = torch.randint(1, 5, (2,), generator=rng).tolist()
        a = _layouts(rng, (*batch.tolist(), m, 1))
        b = _layouts(rng, (*batch.tolist(), 1, n))
        if torch.rand(1, generator=rng) < 0.3:  # a broadcast operand
            b = b[..., :1, :].expand(*batch.tolist(), 1, n) if n > 1 else b
        out = a * b
        computed = passes._broadcast_result_strides(
            tuple(out.shape), (a.shape, a.stride()), (b.shape, b.stride())
        )
        assert computed == out.stride(), (a.shape, a.stride(), b.shape, b.stride())


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_outer_products_become_products_with_the_matmul_layout(layout):
    a = torch.randn(5, 4, 1, dtype=torch.float64)
    b = torch.randn(5, 3, 1, dtype=torch.float64).transpose(1, 2)
    if layout == "transposed":
        a = torch.randn(5, 1, 4, dtype=torch.float64).transpose(1, 2)
        b = torch.randn(5, 1, 3, dtype=torch.float64)

    def f(a, b):
        return torch.bmm(a, b).sin()

    j = ft.jit(f)
    out = j(a, b)
    assert torch.equal(out, f(a, b))
    assert out.stride() == f(a, b).stride()
    targets = _targets(j.graph(a, b))
    assert aten.bmm.default not in targets and aten.mul.Tensor in targets
