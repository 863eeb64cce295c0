"""The per-sample-gradient MLP's shortcuts (bench_core's row (a) at B=8) give what the ordinary path
gives: outer products as broadcast products (Note [Outer products as products])."""

import pytest
import torch
import torch.func as tf
import torch.nn.functional as F

import functransforms as ft

_G = torch.Generator().manual_seed(0)


def _bits_equal(a, b):
    """Same values and the same zero signs (``torch.equal`` treats -0 and +0 as equal)."""
    if a.is_complex():
        return a.is_conj() == b.is_conj() and _bits_equal(
            torch.view_as_real(a.resolve_conj()), torch.view_as_real(b.resolve_conj())
        )
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.signbit(), b.signbit())
        and torch.equal(a, b)
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
def test_outer_product_cotangent_matches_mm(dtype):
    # [n, 1] @ [1, m]: the weight cotangent of a linear layer on one example
    a = torch.randn(1, 5, generator=_G, dtype=dtype)
    b = torch.randn(5, 3, generator=_G, dtype=dtype)

    def f(a, b):
        y = a @ b
        return (y * y.conj()).real.sum() if dtype.is_complex else (y * y).sum()

    ours = ft.grad(f, argnums=(0, 1))(a, b)
    theirs = tf.grad(f, argnums=(0, 1))(a, b)
    for o, t in zip(ours, theirs):
        torch.testing.assert_close(o, t)


def test_per_sample_outer_products_keep_per_example_bits():
    # zeros in the input and negative cotangents: -1 * 0 is -0 per example (mm) and in the
    # broadcast product; a batched bmm would give +0
    w = torch.randn(4, 6, generator=_G, dtype=torch.float64)
    b = torch.randn(4, generator=_G, dtype=torch.float64)
    xs = torch.randn(3, 6, generator=_G, dtype=torch.float64)
    xs[:, :2] = 0.0

    def loss(w, b, x):
        return F.linear(x, w, b).sin().sum()

    g = ft.vmap(ft.grad(loss, argnums=(0, 1)), in_dims=(None, None, 0))(w, b, xs)
    for i in range(xs.shape[0]):
        one = ft.grad(loss, argnums=(0, 1))(w, b, xs[i])
        assert _bits_equal(g[0][i], one[0])
        assert _bits_equal(g[1][i], one[1])
    theirs = tf.vmap(tf.grad(loss, argnums=(0, 1)), in_dims=(None, None, 0))(w, b, xs)
    torch.testing.assert_close(g, theirs)


def test_pointwise_inline_results_carry_no_lazy_bits():
    # the inline pointwise path wraps results without wrap_batched's conj/neg check (its
    # functions return fresh tensors): complex values, a lazily conjugated plain operand
    z = torch.randn(4, 3, generator=_G, dtype=torch.complex128)
    c = torch.randn(3, generator=_G, dtype=torch.complex128).conj()
    assert c.is_conj()
    seen = []

    def f(x):
        outs = (torch.sin(x), x * 2.0, x * x, x * c, torch.neg(x))
        seen.extend(o._value for o in outs)
        return torch.stack(outs)

    ours = ft.vmap(f)(z)
    assert not any(v.is_conj() or v.is_neg() for v in seen)
    expected = torch.stack([torch.stack((x.sin(), x * 2.0, x * x, x * c, -x)) for x in z])
    # (complex x * x is vectorized differently for 12 and 3 elements: last-bit differences)
    torch.testing.assert_close(ours, expected, rtol=1e-15, atol=1e-15)


# -- F.linear as one node under vmap(grad) (Note [F.linear as one node]) ---------------------


@pytest.fixture
def linear_paths(monkeypatch):
    """``run(fn)``: ``fn()`` through the grad level's fast paths (asserting that F.linear's was
    taken, or not, per ``taken``) and through the ordinary path (the table emptied)."""
    from functransforms.autodiff import reverse

    table = dict(reverse.GRAD_FAST)
    hits = []

    unary = []

    def spy(fast, linear):
        def fn(args, kwargs):
            out = fast(args, kwargs)
            (hits if linear else unary).append(out is not None)
            return out

        return fn

    def run(fn, taken=True, unary_taken=None):
        for k, v in table.items():
            monkeypatch.setitem(reverse.GRAD_FAST, k, spy(v, k is F.linear))
        hits.clear()
        unary.clear()
        a = _outcome(fn)
        assert any(hits) == taken, hits
        assert unary_taken is None or any(unary) == unary_taken, unary
        reverse.GRAD_FAST.clear()
        b = _outcome(fn)
        reverse.GRAD_FAST.update(table)
        return a, b

    yield run
    reverse.GRAD_FAST.clear()
    reverse.GRAD_FAST.update(table)


def _outcome(fn):
    try:
        return fn()
    except Exception as e:  # the same error on both paths
        return (type(e), str(e))


def _assert_same(a, b):
    if isinstance(a, tuple) and len(a) == 2 and isinstance(a[0], type):
        assert a == b
        return
    fa, fb = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    assert len(fa) == len(fb)
    for x, y in zip(fa, fb):
        assert _bits_equal(x, y)
        assert x.stride() == y.stride()


def _mlp_params(dtype, n_in=7, hidden=5, n_out=3):
    g = torch.Generator().manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    return {"w0": r(hidden, n_in), "b0": r(hidden), "w1": r(n_out, hidden), "b1": r(n_out)}


def _mlp_loss(p, x, y):
    h = F.relu(F.linear(x, p["w0"], p["b0"]))
    out = F.linear(h, p["w1"], bias=p["b1"])
    return F.cross_entropy(out.unsqueeze(0) if out.dim() == 1 else out, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("per_example", ["vector", "matrix"])
def test_linear_fast_path_matches_ordinary_path(linear_paths, dtype, per_example):
    p = _mlp_params(dtype)
    g = torch.Generator().manual_seed(2)
    if per_example == "vector":  # one example per call: 1-d x
        xs = torch.randn(6, 7, generator=g, dtype=dtype)
        xs[:, :3] = 0.0  # zero signs of the outer products
        ys = torch.randint(0, 3, (6, 1), generator=g)
    else:  # a small batch per call: 2-d x, the addmm decomposition
        xs = torch.randn(6, 4, 7, generator=g, dtype=dtype)
        ys = torch.randint(0, 3, (6, 4), generator=g)
    f = ft.vmap(ft.grad(_mlp_loss), in_dims=(None, 0, 0))
    _assert_same(*linear_paths(lambda: f(p, xs, ys)))
    theirs = tf.vmap(tf.grad(_mlp_loss), in_dims=(None, 0, 0))(p, xs, ys)
    torch.testing.assert_close(f(p, xs, ys), theirs)


def test_linear_fast_path_complex_and_batched_weights(linear_paths):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(4, 3, 5, generator=g, dtype=torch.complex128)  # a weight per example
    b = torch.randn(3, generator=g, dtype=torch.complex128)
    xs = torch.randn(4, 5, generator=g, dtype=torch.complex128)

    def loss(w, b, x):
        y = F.linear(x, w, b)
        return (y * y.conj()).real.sum()

    f = ft.vmap(ft.grad(loss, argnums=(0, 1, 2)))
    _assert_same(*linear_paths(lambda: f(w, b.expand(4, 3), xs)))
    theirs = tf.vmap(tf.grad(loss, argnums=(0, 1, 2)))(w, b.expand(4, 3), xs)
    torch.testing.assert_close(f(w, b.expand(4, 3), xs), theirs)


@pytest.mark.parametrize(
    "case",
    ["no_bias", "strided_x", "mixed_dtype", "bad_shape", "x_3d", "empty_batch", "torch_autograd"],
)
def test_linear_fast_path_declines_or_agrees(linear_paths, case):
    p = _mlp_params(torch.float64)
    g = torch.Generator().manual_seed(4)
    xs = torch.randn(5, 7, generator=g, dtype=torch.float64)
    w, b = p["w0"], p["b0"]
    taken = True
    if case == "no_bias":
        fn, taken = (lambda w, b, x: F.linear(x, w).sum()), False
    elif case == "strided_x":
        xs = torch.randn(5, 14, generator=g, dtype=torch.float64)
        fn, taken = (lambda w, b, x: F.linear(x[::2], w, b).sin().sum()), False
    elif case == "mixed_dtype":
        fn, taken = (lambda w, b, x: F.linear(x.float(), w, b).sum()), False
    elif case == "bad_shape":
        w = torch.randn(5, 6, dtype=torch.float64)
        fn, taken = (lambda w, b, x: F.linear(x, w, b).sum()), False
    elif case == "x_3d":
        xs = torch.randn(5, 2, 3, 7, generator=g, dtype=torch.float64)
        fn, taken = (lambda w, b, x: F.linear(x, w, b).tanh().sum()), False
    elif case == "empty_batch":
        xs = xs[:0]
        fn = lambda w, b, x: F.linear(x, w, b).tanh().sum()  # noqa: E731
    else:  # a weight torch's autograd records on: the ordinary path re-enables its keys
        w = w.clone().requires_grad_()
        fn, taken = (lambda w, b, x: F.linear(x, w, b).tanh().sum()), False

    def run():
        out = ft.vmap(ft.grad(fn, argnums=(0, 1)), in_dims=(None, None, 0))(w, b, xs)
        if case == "torch_autograd":  # and backward through our result reaches w
            (gw,) = torch.autograd.grad(out[1].sum(), w)
            return out[0].detach(), out[1].detach(), gw
        return out

    _assert_same(*linear_paths(run, taken=taken))


def test_linear_fast_path_higher_order_and_grad_fn(linear_paths):
    p = _mlp_params(torch.float64)
    g = torch.Generator().manual_seed(5)
    xs = torch.randn(3, 7, generator=g, dtype=torch.float64)
    names = []

    def inner(w, x):
        y = F.linear(x, w, p["b0"])
        names.append(y.grad_fn.name())
        return y.tanh().sum()

    def outer(w, x):  # the inner grad is not directly inside the vmap: its values keep the
        return ft.grad(inner)(w, x).pow(2).sum()  # plain class, and the outer one's linear...

    f = ft.vmap(ft.grad(outer), in_dims=(None, 0))
    _assert_same(*linear_paths(lambda: f(p["w0"], xs), taken=False))
    theirs = tf.vmap(tf.grad(lambda w, x: tf.grad(inner)(w, x).pow(2).sum()), in_dims=(None, 0))
    torch.testing.assert_close(f(p["w0"], xs), theirs(p["w0"], xs))
    names.clear()
    h = ft.vmap(ft.grad(inner), in_dims=(None, 0))
    _assert_same(*linear_paths(lambda: h(p["w0"], xs)))
    # both paths name the node after the decomposition's last op (torch 2.15: _unsafe_view)
    assert len(set(names)) == 1 and names[0] in ("ViewBackward", "UnsafeViewBackward"), names


# -- F.linear under vmap alone: the shaped fast path (batching/_fastpath.py, _linear) ---------


def _vmap_both(monkeypatch, fn, *args, in_dims=0, taken=True):
    from functransforms.batching import _fastpath, _tensor

    fast = _fastpath.SHAPED_FUNCS[F.linear]
    hits = []

    def spy(*a):
        out = fast(*a)
        hits.append(out is not None)
        return out

    monkeypatch.setitem(_tensor.SHAPED_FUNCS, F.linear, spy)
    a = _outcome(lambda: ft.vmap(fn, in_dims=in_dims)(*args))
    assert any(hits) == taken, hits
    monkeypatch.delitem(_tensor.SHAPED_FUNCS, F.linear)
    b = _outcome(lambda: ft.vmap(fn, in_dims=in_dims)(*args))
    monkeypatch.setitem(_tensor.SHAPED_FUNCS, F.linear, fast)
    _assert_same(a, b)
    return a


@pytest.mark.parametrize(
    "case",
    [
        "plain",
        "bias_kw",
        "float32",
        "empty",
        "bdim1",
        "strided",
        "no_bias",
        "mixed",
        "bad",
        "conj",
        "batched_w",
    ],
)
def test_vmap_linear_fast_path_matches_ordinary_path(monkeypatch, case):
    g = torch.Generator().manual_seed(6)
    dt = torch.float32 if case == "float32" else torch.float64
    xs = torch.randn(5, 7, generator=g, dtype=dt)
    xs[:, 0] = 0.0
    w = torch.randn(4, 7, generator=g, dtype=dt)
    b = torch.randn(4, generator=g, dtype=dt)
    fn, args, in_dims, taken = (lambda x, w, b: F.linear(x, w, b)), (xs, w, b), (0, None, None), 1
    if case == "bias_kw":
        fn = lambda x, w, b: F.linear(x, w, bias=b)  # noqa: E731
    elif case == "empty":
        args = (xs[:0], w, b)
    elif case == "bdim1":
        args, in_dims, taken = (xs.T.contiguous(), w, b), (1, None, None), 0
    elif case == "strided":
        xs2 = torch.randn(5, 14, generator=g, dtype=dt)
        fn, args, taken = (lambda x, w, b: F.linear(x[::2], w, b)), (xs2, w, b), 0
    elif case == "no_bias":
        fn, taken = (lambda x, w, b: F.linear(x, w)), 0
    elif case == "mixed":
        args, taken = (xs.float(), w, b), 0
    elif case == "bad":
        args, taken = (xs, w[:, :5], b), 0
    elif case == "conj":
        wc = torch.randn(4, 7, generator=g, dtype=torch.complex128)
        bc = torch.randn(4, generator=g, dtype=torch.complex128)
        args, taken = (xs.to(torch.complex128), wc.conj(), bc), 0
    elif case == "batched_w":
        args, in_dims, taken = (xs, w.expand(5, 4, 7), b), (0, 0, None), 0
    _vmap_both(monkeypatch, fn, *args, in_dims=in_dims, taken=bool(taken))


def test_vmap_linear_fast_path_under_torch_autograd(monkeypatch):
    # a weight that requires grad, at top level: torch records the fast path's ops as it
    # records the ordinary path's, and backward gives the same gradient
    g = torch.Generator().manual_seed(7)
    xs = torch.randn(5, 7, generator=g, dtype=torch.float64)
    w = torch.randn(4, 7, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, generator=g, dtype=torch.float64)

    def run():
        y = ft.vmap(F.linear, in_dims=(0, None, None))(xs, w, b)
        (gw,) = torch.autograd.grad(y.sin().sum(), w)
        return y.detach(), gw

    from functransforms.batching import _tensor

    fast = _tensor.SHAPED_FUNCS[F.linear]
    a = run()
    monkeypatch.delitem(_tensor.SHAPED_FUNCS, F.linear)
    b2 = run()
    monkeypatch.setitem(_tensor.SHAPED_FUNCS, F.linear, fast)
    _assert_same(a, b2)


@pytest.mark.parametrize(
    "case",
    [
        "relu",
        "F.relu",
        "method",
        "tanh",
        "sigmoid",
        "sin",
        "exp",
        "log",
        "abs",
        "neg",
        "rsqrt",
        "int",
        "inplace",
        "torch_autograd",
    ],
)
def test_unary_fast_paths_match_ordinary_path(linear_paths, case):
    g = torch.Generator().manual_seed(8)
    xs = torch.randn(4, 6, generator=g, dtype=torch.float64)
    xs[:, 0] = 0.0  # relu's kink
    w = torch.randn(6, generator=g, dtype=torch.float64)
    taken = True
    act = {
        "relu": torch.relu,
        "F.relu": F.relu,
        "method": lambda h: h.relu(),
        "tanh": torch.tanh,
        "sigmoid": lambda h: h.sigmoid(),
        "sin": torch.sin,
        "exp": lambda h: h.exp(),
        "log": lambda h: torch.log(h.abs() + 1),
        "abs": torch.abs,
        "neg": lambda h: h.neg(),
        "rsqrt": lambda h: (h * h + 1).rsqrt(),
    }.get(case)
    if case == "int":  # an integer value is not tracked: relu sees the vmap level's value
        act, taken = (lambda h: h + torch.relu(h.round().long()).to(h.dtype)), False
    elif case == "inplace":
        act, taken = (lambda h: F.relu(h * 1.0, inplace=True)), False
    elif case == "torch_autograd":  # torch records below: tanh's primal is a batched value,
        w = w.clone().requires_grad_()  # whose level re-enables torch's autograd itself
        act = torch.tanh

    def loss(w, x):
        return (act(x * w) * x).sum()

    def run():
        out = ft.vmap(ft.grad(loss), in_dims=(None, 0))(w, xs)
        if case == "torch_autograd":
            (gw,) = torch.autograd.grad(out.sum(), w)
            return out.detach(), gw
        return out

    _assert_same(*linear_paths(run, taken=False, unary_taken=taken))
    theirs = tf.vmap(tf.grad(loss), in_dims=(None, 0))(w.detach(), xs)
    torch.testing.assert_close(run()[0] if case == "torch_autograd" else run(), theirs)


# -- a plain 0-d tensor with logical 0-d values of one dtype (the root cotangent) ------------


@pytest.mark.parametrize(
    "case", ["div", "rdiv", "mul", "mixed_dtype", "int_and_float", "bool", "alpha"]
)
def test_pointwise_plain_0d_with_logical_0d(monkeypatch, case):
    from functransforms.batching import _tensor

    g = torch.Generator().manual_seed(9)
    xs = torch.randn(5, generator=g, dtype=torch.float64)
    c = torch.tensor(3.0, dtype=torch.float64)
    fn = {
        "div": lambda x, c: x / c,
        "rdiv": lambda x, c: c / x,
        "mul": lambda x, c: torch.mul(c, x),
        "mixed_dtype": lambda x, c: x.float() * c,  # float32 0-d with float64 0-d: float64
        "int_and_float": lambda x, c: (x > 0).int() * c.int() + 0.5,
        "bool": lambda x, c: torch.logical_and(x > 0, c > 0),
        "alpha": lambda x, c: torch.add(c, x, alpha=2),
    }[case]
    fast = _outcome(lambda: ft.vmap(fn, in_dims=(0, None))(xs, c))
    monkeypatch.setattr(_tensor, "POINTWISE_FUNCS", {})
    slow = _outcome(lambda: ft.vmap(fn, in_dims=(0, None))(xs, c))
    _assert_same(fast, slow)
    expected = torch.stack([fn(x, c) for x in xs])
    assert fast.dtype == expected.dtype
    torch.testing.assert_close(fast, expected)


def test_unary_fast_path_complex(linear_paths):
    # abs of a complex value is real, sin stays complex: the node and the wrapper as the
    # ordinary path makes them
    g = torch.Generator().manual_seed(10)
    zs = torch.randn(4, 3, generator=g, dtype=torch.complex128)
    w = torch.randn(3, generator=g, dtype=torch.complex128)

    def loss(w, z):
        return (torch.sin(z * w).abs() + torch.exp(z * w).real).sum()

    f = ft.vmap(ft.grad(loss), in_dims=(None, 0))
    _assert_same(*linear_paths(lambda: f(w, zs), taken=False, unary_taken=True))
    torch.testing.assert_close(f(w, zs), tf.vmap(tf.grad(loss), in_dims=(None, 0))(w, zs))


# -- Note [Real linear cotangents without the views that cancel] -----------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.complex128])
@pytest.mark.parametrize("w_layout", ["row_major", "column_major"])
@pytest.mark.parametrize("x_layout", ["vector", "row_major", "column_major"])
def test_linear_fast_path_cotangents_every_layout(linear_paths, dtype, w_layout, x_layout):
    # each branch of the real-weight rule (row-major weight or not, column-major x or not, one
    # example or a batch of rows) against the decomposition's rules: same bits, same strides
    g = torch.Generator().manual_seed(11)
    w = torch.randn(4, 6, generator=g, dtype=dtype)
    if w_layout == "column_major":
        w = torch.randn(6, 4, generator=g, dtype=dtype).t()
    b = torch.randn(4, generator=g, dtype=dtype)
    if x_layout == "vector":
        xs = torch.randn(3, 6, generator=g, dtype=dtype)
        prep = lambda x: x  # noqa: E731
    elif x_layout == "row_major":
        xs = torch.randn(3, 5, 6, generator=g, dtype=dtype)
        prep = lambda x: x  # noqa: E731
    else:  # a column-major batch of rows per example
        xs = torch.randn(3, 6, 5, generator=g, dtype=dtype)
        prep = lambda x: x.mT  # noqa: E731

    def loss(w, b, x):
        y = F.linear(prep(x) * 1.5, w, b)
        return (y * y.conj()).real.sum() if dtype.is_complex else (y * y.tanh()).sum()

    f = ft.vmap(ft.grad(loss, argnums=(0, 1, 2)), in_dims=(None, None, 0))
    _assert_same(*linear_paths(lambda: f(w, b, xs)))
    theirs = tf.vmap(tf.grad(loss, argnums=(0, 1, 2)), in_dims=(None, None, 0))(w, b, xs)
    torch.testing.assert_close(f(w, b, xs), theirs)


def test_maml_meta_gradient_same_with_and_without_the_linear_node(linear_paths):
    # grad(vmap(grad)): the inner level's F.linear node runs its rule on the outer grad level's
    # values, so the rule's ops are recorded there and differentiated again
    g = torch.Generator().manual_seed(12)
    p = {
        "w0": torch.randn(8, 1, generator=g, dtype=torch.float64),
        "b0": torch.randn(8, generator=g, dtype=torch.float64),
        "w1": torch.randn(1, 8, generator=g, dtype=torch.float64),
        "b1": torch.randn(1, generator=g, dtype=torch.float64),
    }
    xs = torch.randn(4, 5, 1, generator=g, dtype=torch.float64)
    ys = torch.sin(xs)

    def mse(p, x, y):
        h = torch.relu(F.linear(x, p["w0"], p["b0"]))
        return ((F.linear(h, p["w1"], p["b1"]) - y) ** 2).mean()

    def task(p, x, y):
        gr = ft.grad(mse)(p, x, y)
        return mse({k: p[k] - 0.1 * gr[k] for k in p}, x, y)

    meta = ft.grad(lambda p: ft.vmap(task, in_dims=(None, 0, 0))(p, xs, ys).mean())
    # the outer sweep differentiates the node's rule, whose ops are not the decomposition's
    # one for one (its views that cancel are skipped): equal to rounding, not bit for bit
    fast, ordinary = linear_paths(lambda: meta(p))
    torch.testing.assert_close(fast, ordinary, rtol=1e-13, atol=1e-15)

    def task_tf(p, x, y):
        gr = tf.grad(mse)(p, x, y)
        return mse({k: p[k] - 0.1 * gr[k] for k in p}, x, y)

    theirs = tf.grad(lambda p: tf.vmap(task_tf, in_dims=(None, 0, 0))(p, xs, ys).mean())(p)
    torch.testing.assert_close(meta(p), theirs)
