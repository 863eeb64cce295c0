"""functransforms.jit: every replay and every fallback agrees with running f eagerly."""

import collections
import warnings
from operator import getitem

import pytest
import torch
import torch.nn.functional as F

import functransforms as ft
from functransforms.errors import JitFallbackWarning, RandomnessError

D = torch.float64
aten = torch.ops.aten


def _mlp():
    g = torch.Generator().manual_seed(0)
    sizes = [6, 5, 4, 3]
    params = {}
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        params[f"w{i}"] = torch.randn(b, a, generator=g, dtype=D) / a**0.5
        params[f"b{i}"] = torch.randn(b, generator=g, dtype=D)

    def loss(p, x, y):
        h = torch.tanh(F.linear(x, p["w0"], p["b0"]))
        h = torch.tanh(F.linear(h, p["w1"], p["b1"]))
        out = F.linear(h, p["w2"], p["b2"])
        return F.cross_entropy(out.unsqueeze(0), y.unsqueeze(0))

    return params, loss


def _close(a, b):
    for x, y in zip(torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)):
        torch.testing.assert_close(x, y)


class _Raises:
    """No JitFallbackWarning inside (it becomes an error)."""

    def __enter__(self):
        self.cm = warnings.catch_warnings()
        self.cm.__enter__()
        warnings.simplefilter("error", JitFallbackWarning)

    def __exit__(self, *exc):
        return self.cm.__exit__(*exc)


# -- replay is the eager result ---------------------------------------------------------------


def test_per_sample_grads_match_eager_and_torch_func():
    params, loss = _mlp()
    xs = torch.randn(8, 6, dtype=D)
    ys = torch.randint(0, 3, (8,))
    psg = ft.vmap(ft.grad(loss), in_dims=(None, 0, 0))
    jpsg = ft.jit(psg)
    with _Raises():
        first, second = jpsg(params, xs, ys), jpsg(params, xs, ys)
    ref = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, xs, ys)
    _close(first, ref)
    _close(second, ref)
    _close(second, psg(params, xs, ys))
    assert jpsg.cache_info()[:3] == (1, 1, 0)


@pytest.mark.parametrize(
    "make",
    [
        lambda f: ft.hessian(f),
        lambda f: ft.jacrev(f),
        lambda f: ft.jacfwd(f),
        lambda f: lambda x: ft.jvp(ft.grad(f), (x,), (torch.ones_like(x),))[1],
    ],
    ids=["hessian", "jacrev", "jacfwd", "hvp"],
)
def test_composed_transforms(make):
    A = torch.randn(5, 5, dtype=D)
    f = lambda x: (torch.sin(x) * (A @ x)).sum()  # noqa: E731
    g = make(f)
    jg = ft.jit(g)
    x = torch.randn(5, dtype=D)
    with _Raises():
        _close(jg(x), g(x))
        _close(jg(x), g(x))
        y = torch.randn(5, dtype=D)
        _close(jg(y), g(y))
    assert jg.cache_info().hits == 2


def test_pytree_kwargs_and_non_tensor_leaves():
    def f(d, *, scale, name):
        return {"out": d["a"] * scale + d["b"], "name": name, "n": 3}, d["a"].sum()

    jf = ft.jit(f)
    d = {"a": torch.randn(3, dtype=D), "b": torch.randn(3, dtype=D)}
    r1 = jf(d, scale=2.0, name="x")
    r2 = jf(d, scale=2.0, name="x")
    r3 = jf(d, scale=3.0, name="x")  # a new value of a non-tensor leaf is a new signature
    for r, s in ((r1, 2.0), (r2, 2.0), (r3, 3.0)):
        ref = f(d, scale=s, name="x")
        _close(r[0]["out"], ref[0]["out"])
        assert r[0]["name"] == "x" and r[0]["n"] == 3
        _close(r[1], ref[1])
    assert jf.cache_info()[:3] == (1, 2, 0)


def test_signature_shape_dtype_stride_grad_mode_default_dtype():
    f = lambda x: x * torch.ones(3) + 1  # noqa: E731 - ones follows the default dtype
    jf = ft.jit(f)
    x = torch.randn(3)
    jf(x)
    jf(x.double())
    jf(torch.randn(2, 3))
    jf(torch.randn(3, 2).t()[0])  # other strides
    with torch.no_grad():
        jf(x)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        out = jf(x.double())
        assert out.dtype == torch.float64
    finally:
        torch.set_default_dtype(old)
    assert jf.cache_info().misses == 6
    assert jf(x.double()).dtype == f(x.double()).dtype  # back to the float32 default: a hit
    assert jf.cache_info().hits == 1


def test_dicts_of_tensors_skip_the_pytree_flatten_and_keep_every_check(monkeypatch):
    # Note [Signature walk]: plain dicts of tensors are keyed without optree; the key must
    # still hold every field, and a dict mutated between calls is a new signature.
    def f(p, x, *, extra):
        return {k: v * x.sum() for k, v in p.items()}, x @ p["w"] + extra["b"]

    jf = ft.jit(f)
    p = {"w": torch.randn(3, 2, dtype=D), "u": torch.randn(2, dtype=D)}
    x, extra = torch.randn(4, 3, dtype=D), {"b": torch.randn(2, dtype=D)}
    jf(p, x, extra=extra)
    # The graph takes its inputs in optree's leaf order (sorted keys), as for any pytree.
    leaves = ft._pytree.tree_leaves(((p, x), {"extra": extra}))
    for got, want in zip(
        jf.graph(p, x, extra=extra)(*leaves), ft._pytree.tree_leaves(f(p, x, extra=extra))
    ):
        _close(got, want)

    flatten = ft._jit._trace.tree_flatten

    def no_input_flatten(tree):  # f's outputs are still flattened when a signature traces
        if isinstance(tree, tuple) and len(tree) == 2 and tree[1] == {"extra": extra}:
            raise AssertionError("plain dicts of tensors must not go through optree")
        return flatten(tree)

    monkeypatch.setattr(ft._jit._trace, "tree_flatten", no_input_flatten)

    def check(p, x, extra, misses):
        out, ref = jf(p, x, extra=extra), f(p, x, extra=extra)
        assert list(out[0]) == list(ref[0])  # the same keys in the same order
        for k in ref[0]:
            _close(out[0][k], ref[0][k])
        _close(out[1], ref[1])
        assert jf.cache_info().misses == misses

    check(p, x, extra, 1)  # a hit
    p["w"] = torch.randn(3, 2, dtype=D).t().contiguous().t()  # same dict, other strides
    check(p, x, extra, 2)
    p["u"] = torch.randn(2, dtype=torch.float32)  # dtype
    check(p, x, extra, 3)
    p["u"] = torch.randn(2, dtype=D, requires_grad=True)  # requires_grad
    check(p, x, extra, 4)
    p["u"].detach_()  # changed in place: back to a known signature
    check(p, x, extra, 4)
    p["v"] = torch.randn(1, dtype=D)  # a key added to the same dict
    check(p, x, extra, 5)
    check({"v": p["v"], "w": p["w"], "u": p["u"]}, x, extra, 6)  # another key order
    p["u"].resize_(3)  # the same tensor resized in place: its shape is read anew
    check(p, x, extra, 7)
    with torch.no_grad():  # grad mode
        check(p, x, extra, 8)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # default dtype
    try:
        check(p, x, extra, 9)
    finally:
        torch.set_default_dtype(old)
    check(p, x, {"b": x[:2, 0]}, 10)  # a strided view
    monkeypatch.undo()
    # Keys that are not str, dict subclasses and nested containers take the optree path.
    g = ft.jit(lambda d: d[1] * 2 if 1 in d else d[True] * 3)
    t = torch.randn(2, dtype=D)
    _close(g({1: t}), t * 2)
    _close(g({True: t}), t * 2)  # {1: t} == {True: t}: one signature, as eagerly
    h = ft.jit(lambda d: d["a"] * 2 if type(d) is collections.OrderedDict else d["a"])
    _close(h({"a": t}), t)
    _close(h(collections.OrderedDict(a=t)), t * 2)


def test_lru_eviction_and_cache_clear():
    jf = ft.jit(torch.sin, cache_size=2)
    a, b, c = torch.randn(1), torch.randn(2), torch.randn(3)
    jf(a), jf(b), jf(a), jf(c)  # b is the least recently used: evicted
    assert jf.cache_info() == ft._jit._trace.CacheInfo(1, 3, 0, 2, 2)
    jf(b)
    assert jf.cache_info().misses == 4
    jf(a)  # a was used before c and b: evicted by b
    assert jf.cache_info().misses == 5
    jf.cache_clear()
    assert jf.cache_info() == ft._jit._trace.CacheInfo(0, 0, 0, 2, 0)


def test_bad_arguments():
    with pytest.raises(ValueError, match="backend"):
        ft.jit(torch.sin, backend="xla")
    with pytest.raises(ValueError, match="cache_size"):
        ft.jit(torch.sin, cache_size=0)
    with pytest.raises(TypeError, match="callable"):
        ft.jit(3)


def test_decorator_forms():
    @ft.jit
    def f(x):
        return x.cos()

    @ft.jit(dynamic=True)
    def g(x):
        return x.cos()

    x = torch.randn(3)
    _close(f(x), x.cos())
    _close(g(x), x.cos())


def test_error_in_f_propagates_and_is_not_cached():
    def f(x):
        return x @ torch.randn(4, 4)

    jf = ft.jit(f)
    with pytest.raises(RuntimeError):
        jf(torch.randn(3))
    with pytest.raises(RuntimeError):
        jf(torch.randn(3))
    assert jf.cache_info().currsize == 0


# -- dynamic shapes -----------------------------------------------------------------------------


def test_dynamic_one_trace_serves_every_batch_size():
    params, loss = _mlp()
    psg = ft.vmap(ft.grad(loss), in_dims=(None, 0, 0))
    jpsg = ft.jit(psg, dynamic=True)
    for B in (7, 9, 16, 33):
        xs = torch.randn(B, 6, dtype=D)
        ys = torch.randint(0, 3, (B,))
        _close(jpsg(params, xs, ys), psg(params, xs, ys))
    assert jpsg.cache_info().misses == 1 and jpsg.cache_info().hits == 3


def test_dynamic_guards_retrace_when_violated():
    def f(x, y):
        return x + y.sum(0)  # duck sizing: x and y's dims are the same symbol when equal

    jf = ft.jit(f, dynamic=True)
    x, y = torch.randn(4, dtype=D), torch.randn(4, 4, dtype=D)
    _close(jf(x, y), f(x, y))
    x2, y2 = torch.randn(5, dtype=D), torch.randn(3, 5, dtype=D)
    _close(jf(x2, y2), f(x2, y2))
    x3, y3 = torch.randn(6, dtype=D), torch.randn(3, 6, dtype=D)
    _close(jf(x3, y3), f(x3, y3))
    assert jf.cache_info().misses <= 2


# -- graph clean-up and captured tensors --------------------------------------------------------


def test_graph_holds_only_aten_ops_and_folds_factories():
    W = torch.randn(4, 4, dtype=D)
    jf = ft.jit(ft.jacrev(lambda x: torch.tanh(W @ x)))
    x = torch.randn(4, dtype=D)
    gm = ft.jit(ft.jacrev(lambda x: torch.tanh(W @ x))).graph(x)
    assert isinstance(gm, torch.fx.GraphModule)
    targets = [
        n.target for n in gm.graph.nodes if n.op == "call_function" and n.target is not getitem
    ]
    assert all(isinstance(t, torch._ops.OpOverload) for t in targets), targets
    assert not any(t.__name__.startswith(("eye", "arange", "zeros")) for t in targets), targets
    assert all(len(n.users) > 0 for n in gm.graph.nodes if n.op == "call_function")  # no dead code
    _close(jf(x), torch.func.jacrev(lambda x: torch.tanh(W @ x))(x))
    _close(jf(x), torch.func.jacrev(lambda x: torch.tanh(W @ x))(x))


def test_captured_weight_updated_in_place_is_seen_by_replay():
    W = torch.randn(3, 3, dtype=D)
    b = torch.randn(3, dtype=D)
    f = lambda x: torch.tanh(W @ x + b * 2)  # noqa: E731 - b * 2: a subgraph of a captured tensor
    jf = ft.jit(ft.vmap(ft.grad(lambda x: f(x).sum())))
    xs = torch.randn(4, 3, dtype=D)
    jf(xs)
    with torch.no_grad():
        W.add_(1.0)
        b.mul_(-3.0)
    ref = torch.func.vmap(torch.func.grad(lambda x: f(x).sum()))(xs)
    _close(jf(xs), ref)
    assert jf.cache_info().hits == 1


def test_jacfwd_graph_copies_instead_of_multiplying_by_the_identity_basis():
    W = torch.randn(5, 5, dtype=D)
    f = lambda x: torch.tanh(W @ x)  # noqa: E731
    jf = ft.jit(ft.jacfwd(f))
    x = torch.randn(5, dtype=D)
    gm = jf.graph(x)
    assert aten.mm.default not in [n.target for n in gm.graph.nodes], gm.code
    _close(jf(x), torch.func.jacfwd(f)(x))
    with torch.no_grad():
        W.mul_(-2.0)  # the copy reads the live weight
    _close(jf(x), torch.func.jacfwd(f)(x))
    # a product with a folded matrix that is not the identity stays a product
    g = lambda x: (torch.eye(5, dtype=D) * 2) @ (W @ x)  # noqa: E731
    assert aten.mm.default in [n.target for n in ft.jit(ft.jacfwd(g)).graph(x).graph.nodes]
    _close(ft.jit(ft.jacfwd(g))(x), torch.func.jacfwd(g)(x))


def test_product_plus_bias_becomes_one_gemm():
    g = torch.Generator().manual_seed(3)
    W = torch.randn(4, 3, 6, generator=g, dtype=D)  # an ensemble of 4 linear layers
    b = torch.randn(4, 3, generator=g, dtype=D)
    x = torch.randn(5, 6, generator=g, dtype=D)
    ens = ft.vmap(F.linear, in_dims=(None, 0, 0))
    jens = ft.jit(ens)
    targets = [n.target for n in jens.graph(x, W, b).graph.nodes]
    assert aten.baddbmm.default in targets and aten.bmm.default not in targets
    _close(jens(x, W, b), torch.func.vmap(F.linear, in_dims=(None, 0, 0))(x, W, b))
    seen = []  # a compiler backend gets the plain ops (it fuses the add itself)
    jc = ft.jit(ens, backend=lambda gm, ts: seen.append(gm) or gm)
    _close(jc(x, W, b), torch.func.vmap(F.linear, in_dims=(None, 0, 0))(x, W, b))
    assert aten.bmm.default in [n.target for n in seen[0].graph.nodes]
    W2 = torch.randn(3, 6, generator=g, dtype=D)
    jf = ft.jit(lambda x, c: x @ W2.T + c)
    for c in (torch.randn(3, dtype=D), torch.randn(5, 3, dtype=D)):
        assert aten.addmm.default in [n.target for n in jf.graph(x, c).graph.nodes]
        _close(jf(x, c), x @ W2.T + c)
    # left alone: a bias that grows the product, a product read twice, another dtype
    c = torch.randn(2, 5, 3, dtype=D)
    assert aten.mm.default in [n.target for n in jf.graph(x, c).graph.nodes]
    _close(jf(x, c), x @ W2.T + c)
    c = torch.randn(3, dtype=D)
    jt = ft.jit(lambda x, c: (lambda p: (p + c, p * 2))(x @ W2.T))
    assert aten.mm.default in [n.target for n in jt.graph(x, c).graph.nodes]
    _close(jt(x, c), ((x @ W2.T) + c, (x @ W2.T) * 2))
    c32 = torch.randn(3, dtype=torch.float32)
    assert aten.mm.default in [n.target for n in jf.graph(x, c32).graph.nodes]
    _close(jf(x, c32), x @ W2.T + c32)


def test_folded_constants_are_not_shared_between_calls():
    def f(x):
        buf = torch.zeros(3, dtype=D)  # a factory, written in place below: never folded
        buf.add_(x)
        return buf, torch.eye(3, dtype=D)  # returned: never folded

    jf = ft.jit(f)
    x = torch.randn(3, dtype=D)
    a = jf(x)
    b = jf(x)
    b[1].add_(1.0)
    c = jf(x)
    _close(a, f(x))
    _close(c, f(x))


def test_in_place_update_of_an_argument_and_aliasing():
    def f(x, y):
        x.add_(y)
        return x * 2

    jf = ft.jit(f)
    x, y = torch.randn(3, dtype=D), torch.randn(3, dtype=D)
    x0 = x.clone()
    jf(x, y)
    jf(x, y)
    _close(x, x0 + 2 * y)
    z = torch.randn(3, dtype=D)
    z0 = z.clone()
    out = jf(z, z)  # aliased arguments: a different signature
    _close(out, 4 * z0)
    _close(z, 2 * z0)


# -- randomness ---------------------------------------------------------------------------------


def test_randomness_fresh_draws_and_same_stream_as_eager():
    f = lambda x: x + torch.randn(3, dtype=D)  # noqa: E731
    jf = ft.jit(f)
    x = torch.zeros(3, dtype=D)
    torch.manual_seed(1)
    eager = [f(x) for _ in range(3)]
    torch.manual_seed(1)
    jitted = [jf(x) for _ in range(3)]
    for a, b in zip(eager, jitted):
        torch.testing.assert_close(a, b)
    assert not torch.equal(jitted[1], jitted[2])


@pytest.mark.parametrize("randomness", ["different", "same"])
def test_vmap_randomness_modes(randomness):
    def f(x):
        return x + torch.rand(3, dtype=D) + F.dropout(x + 1, 0.5)

    g = ft.vmap(f, randomness=randomness)
    jg = ft.jit(g)
    xs = torch.zeros(4, 3, dtype=D)
    torch.manual_seed(3)
    eager = [g(xs) for _ in range(2)]
    torch.manual_seed(3)
    jitted = [jg(xs) for _ in range(2)]
    for a, b in zip(eager, jitted):
        torch.testing.assert_close(a, b)
    rows_equal = torch.equal(jitted[1][0], jitted[1][1])
    assert rows_equal == (randomness == "same")


@pytest.mark.parametrize("dynamic", [False, True])
def test_vmap_randomness_error_raises_under_jit(dynamic):
    jg = ft.jit(ft.vmap(lambda x: x + torch.rand(3)), dynamic=dynamic)
    with pytest.raises(RandomnessError):
        jg(torch.zeros(4, 3))


# -- fallbacks ----------------------------------------------------------------------------------


def _branch(x):
    if x.sum() > 0:
        return x.sin()
    return x.cos()


@pytest.mark.parametrize(
    "f, needle",
    [
        (_branch, "if x.sum() > 0"),
        (lambda x: x * x.sum().item(), "item()"),
        (lambda x: torch.nonzero(x > 0).double().sum(), "nonzero"),
        (lambda x: torch.masked_select(x, x > 0).sum(), "masked_select"),
        (lambda x: x[x > 0].sum() * 2, "x[x > 0]"),
        (lambda x: x * x.tolist()[0], "tolist"),
        (lambda x: x * float(x.numpy()[0]), "numpy"),
    ],
    ids=["control-flow", "item", "nonzero", "masked_select", "bool-index", "tolist", "numpy"],
)
@pytest.mark.parametrize("dynamic", [False, True])
def test_fallback_is_eager_once_with_reason_and_line(f, needle, dynamic):
    jf = ft.jit(f, dynamic=dynamic)
    x = torch.randn(5, dtype=D)
    with pytest.warns(JitFallbackWarning) as rec:
        first = jf(x)
    msg = str(rec[0].message)
    assert "test_jit.py" in msg or dynamic, msg
    if not dynamic:
        assert needle in msg, msg
    _close(first, f(x))
    with warnings.catch_warnings():
        warnings.simplefilter("error", JitFallbackWarning)  # warned once per signature
        _close(jf(-x), f(-x))  # the other branch / other values: still right
        _close(jf(x), f(x))
    info = jf.cache_info()
    assert info.hits == 0 and info.fallbacks == 3 and info.currsize == 1
    with pytest.raises(ValueError, match="eagerly"):
        jf.graph(x)


def test_fallback_for_no_grad_region_on_tensors_that_require_grad():
    def f(x):
        with torch.no_grad():
            m = x.mean()
        return x - m

    jf = ft.jit(f)
    x = torch.randn(4, dtype=D, requires_grad=True)
    with pytest.warns(JitFallbackWarning, match="grad mode"):
        y = jf(x)
    (g,) = torch.autograd.grad(y.pow(2).sum(), x)
    (ref,) = torch.autograd.grad(f(x).pow(2).sum(), x)
    _close(g, ref)


def test_torch_autograd_through_replay():
    W = torch.randn(3, 3, dtype=D, requires_grad=True)
    f = lambda x: torch.tanh(W @ x).sum()  # noqa: E731
    jf = ft.jit(f)
    x = torch.randn(3, dtype=D, requires_grad=True)
    with _Raises():
        jf(x)
        out = jf(x)
    gx, gW = torch.autograd.grad(out, (x, W))
    rx, rW = torch.autograd.grad(f(x), (x, W))
    _close((gx, gW), (rx, rW))


def test_library_code_does_not_force_a_fallback():
    def g(x):
        buf = torch.zeros(3, dtype=D)
        buf[1] = x.sin().sum()  # written through a view of a plain buffer: promoted
        buf[2:] = x[:1] * 2
        return buf.sum()

    jg = ft.jit(ft.grad(g))
    x = torch.randn(4, dtype=D)
    with _Raises():
        _close(jg(x), ft.grad(g)(x))
        _close(jg(x), ft.grad(g)(x))
    assert jg.cache_info().hits == 1


def test_unhashable_leaf_runs_eagerly():
    class Opaque:
        __hash__ = None

    jf = ft.jit(lambda x, o: x + 1)
    x = torch.randn(2)
    _close(jf(x, Opaque()), x + 1)
    assert jf.cache_info().fallbacks == 1


# -- composition ---------------------------------------------------------------------------------


def test_inside_vmap_grad_and_jit():
    f = lambda x: (x.sin() * x).sum()  # noqa: E731
    jf = ft.jit(f)
    xs = torch.randn(4, 3, dtype=D)
    _close(ft.vmap(jf)(xs), ft.vmap(f)(xs))
    _close(ft.grad(jf)(xs[0]), ft.grad(f)(xs[0]))
    _close(ft.vmap(ft.grad(jf))(xs), torch.func.vmap(torch.func.grad(f))(xs))
    outer = ft.jit(lambda x: jf(x) * 2)
    _close(outer(xs), 2 * f(xs))
    _close(outer(xs), 2 * f(xs))
    assert outer.cache_info().hits == 1


def test_one_op_graph_replays_through_fast_path(monkeypatch):
    jf = ft.jit(torch.sin)
    x = torch.randn(5)
    jf(x)

    def slow_path(*a):
        raise AssertionError("a flat tuple of tensors must hit the fast path")

    monkeypatch.setattr(jf, "_signature", slow_path)
    for _ in range(3):
        _close(jf(x), torch.sin(x))
    assert jf.cache_info().hits == 3


def test_inductor_backend():
    pytest.importorskip("torch._inductor")
    params, loss = _mlp()
    psg = ft.vmap(ft.grad(loss), in_dims=(None, 0, 0))
    jpsg = ft.jit(psg, backend="inductor")
    xs = torch.randn(4, 6, dtype=D)
    ys = torch.randint(0, 3, (4,))
    ref = psg(params, xs, ys)
    try:
        out = jpsg(params, xs, ys)
    except Exception as e:  # no C++ compiler on the machine
        if "compiler" in str(e).lower() or "cpp" in str(e).lower():
            pytest.skip(f"inductor cannot compile here: {e}")
        raise
    _close(out, ref)
    _close(jpsg(params, xs, ys), ref)
    with torch.no_grad():  # captured tensors stay live under inductor too
        params["w0"].mul_(2.0)
    _close(jpsg(params, xs, ys), psg(params, xs, ys))
    W = torch.randn(3, 3, dtype=D)
    jf = ft.jit(lambda x: torch.tanh(W @ x) * 2, backend="inductor")
    x = torch.randn(3, dtype=D)
    _close(jf(x), torch.tanh(W @ x) * 2)
    with torch.no_grad():
        W.add_(1.0)
    _close(jf(x), torch.tanh(W @ x) * 2)
    jd = ft.jit(lambda x: x.sin() * 2, backend="inductor", dynamic=True)
    for n in (3, 7):
        _close(jd(torch.ones(n, dtype=D)), torch.ones(n, dtype=D).sin() * 2)


def _cnn():
    g = torch.Generator().manual_seed(0)
    p = {
        "w1": torch.randn(4, 1, 3, 3, generator=g, dtype=D),
        "w2": torch.randn(6, 4, 3, 3, generator=g, dtype=D),
        "w3": torch.randn(3, 6 * 2 * 2, generator=g, dtype=D),
    }

    def loss(p, x, y):  # x [1, 8, 8]
        h = F.relu(F.conv2d(x.unsqueeze(0), p["w1"]))  # [1, 4, 6, 6]
        h = F.max_pool2d(F.relu(F.conv2d(h, p["w2"])), 2)  # [1, 6, 2, 2]
        return F.nll_loss(F.log_softmax(h.flatten(1) @ p["w3"].T, 1), y.unsqueeze(0))

    xs = torch.randn(5, 1, 8, 8, generator=g, dtype=D)
    ys = torch.randint(0, 3, (5,), generator=g)
    return ft.vmap(ft.grad(loss), in_dims=(None, 0, 0)), (p, xs, ys)


def test_inductor_graph_has_no_stored_placeholders():
    # Note [Shape-only convolution_backward arguments under inductor]: the graph handed to
    # inductor passes empty([]).expand(shape) where convolution_backward only reads a shape,
    # and uniform folded constants (max_pool2d's scattered zeros) are `full` nodes again.
    from functransforms._jit._passes import _for_inductor

    psg, args = _cnn()
    gm = ft.jit(psg).graph(*args)
    cbs = [n for n in gm.graph.nodes if n.target is aten.convolution_backward.default]
    folded = [
        a for n in cbs for a in n.args[1:3] if isinstance(a, torch.fx.Node) and a.op == "get_attr"
    ]
    assert folded, "the eager replay keeps the folded (contiguous) placeholders"
    _for_inductor(gm)
    for n in gm.graph.nodes:
        if n.target is aten.convolution_backward.default:
            mask = n.args[10]
            for pos, used in ((1, mask[1]), (2, mask[0])):
                if not used and n.args[pos].op != "placeholder":
                    assert n.args[pos].target is aten.expand.default, n.format_node()
    assert any(n.target is aten.full.default for n in gm.graph.nodes)
    assert not any(
        n.op == "get_attr" and n.target in [a.target for a in folded] for n in gm.graph.nodes
    )
    _close(gm(*torch.utils._pytree.tree_leaves(args)), psg(*args))


def test_inductor_backend_cnn_per_sample_grads():
    pytest.importorskip("torch._inductor")
    psg, args = _cnn()
    jpsg = ft.jit(psg, backend="inductor")
    try:
        out = jpsg(*args)
    except Exception as e:  # no C++ compiler on the machine
        if "compiler" in str(e).lower() or "cpp" in str(e).lower():
            pytest.skip(f"inductor cannot compile here: {e}")
        raise
    _close(out, psg(*args))
    _close(jpsg(*args), psg(*args))


def test_dynamic_python_number_from_a_size_is_right():
    jf = ft.jit(lambda x: (x * 2, x.shape[0] * 3), dynamic=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", JitFallbackWarning)
        for n in (3, 5):
            out, k = jf(torch.ones(n))
            assert k == 3 * n and isinstance(k, int)
            _close(out, 2 * torch.ones(n))
