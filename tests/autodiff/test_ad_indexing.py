"""Indexing ops that select, scatter or reduce (masked_select / masked_scatter, put,
scatter_reduce and index_reduce in every mode, as_strided / as_strided_scatter, addbmm, unfold)
against torch.func and finite differences."""

import pytest
import torch
from _ad_helpers import compare_with_torch_func
from torch import func as tf

import functransforms as ft
from functransforms.testing import check_grads

F64, C128 = torch.float64, torch.complex128


def _x(*shape, dtype=F64, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


MASK = torch.tensor([[True, False, True, True, False]] * 2 + [[False, True, False, True, True]])


@pytest.mark.parametrize("dtype", [F64, C128])
def test_masked_select_and_scatter(dtype):
    x = _x(3, 5, dtype=dtype)
    compare_with_torch_func(lambda x: x.masked_select(MASK), (x,), order=2)
    compare_with_torch_func(lambda x: x[0].masked_select(MASK), (x,), order=1)  # broadcast
    src = _x(12, dtype=dtype, seed=1)  # more source than masked positions
    compare_with_torch_func(lambda x, s: x.masked_scatter(MASK, s), (x, src), order=2)
    compare_with_torch_func(lambda x, s: x[0].masked_scatter(MASK[0], s), (x, src[:4]))


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("dtype", [F64, C128])
def test_put(accumulate, dtype):
    idx = torch.tensor([[1, 7], [3, 7]]) if accumulate else torch.tensor([[1, 7], [3, 9]])
    x, s = _x(3, 4, dtype=dtype), _x(2, 2, dtype=dtype, seed=1)
    compare_with_torch_func(lambda x, s: x.put(idx, s, accumulate=accumulate), (x, s), order=2)


def _scatter_case():
    x = _x(3, 4)
    src = _x(2, 4, seed=1)
    index = torch.tensor([[0, 1, 0, 2], [0, 1, 2, 2]])
    src[1, 0] = x[0, 0] = src[0, 0] = 2.5  # a three-way tie in group (0, 0)
    src[0, 2] = 0.0  # a zero in the prod group (0, 2)
    x[2, 3] = 0.0  # two zeros in group (2, 3)
    src[1, 3] = 0.0
    return x, index, src


@pytest.mark.parametrize("reduce", ["sum", "prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
def test_scatter_reduce(reduce, include_self):
    x, index, src = _scatter_case()
    if not include_self:
        # torch counts x[0, 0] among the tied maxima although include_self=False leaves it out
        # of the reduction (its src weights then sum to 2/3); ours split among the members
        x[0, 0] = x[2, 3] = 1.0

    def f(x, s):
        return x.scatter_reduce(0, index, s, reduce, include_self=include_self)

    _vjp_vs_torch_and_dot_test(f, (x, src))
    if reduce != "prod":  # torch has no forward mode for prod
        compare_with_torch_func(f, (x, src), check=False)
    if reduce in ("sum", "mean"):
        check_grads(f, (x, src), order=2)
    elif reduce == "prod":  # smooth away from zeros
        check_grads(f, (x + 3, src + 3), order=2)


def _vjp_vs_torch_and_dot_test(f, args, positive_ct=False):
    """vjp against torch.func, and the jvp against our vjp: <J t, c> = <t, J^T c> (for ops
    where torch has no forward mode: ours only)."""
    gen = torch.Generator().manual_seed(5)
    out, fn = ft.vjp(f, *args)
    ct = torch.randn(out.shape, generator=gen, dtype=out.dtype)
    if positive_ct:
        ct = ct.abs()
    cts = fn(ct)
    for a, b in zip(cts, tf.vjp(f, *args)[1](ct)):
        torch.testing.assert_close(a, b)
    ts = tuple(torch.randn(a.shape, generator=gen, dtype=a.dtype) for a in args)
    jt = ft.jvp(f, args, ts)[1]
    lhs = (jt * ct).sum()
    rhs = sum((t * c).sum() for t, c in zip(ts, cts))
    torch.testing.assert_close(lhs, rhs)


def test_scatter_reduce_ties_without_self():
    """amax with include_self=False: the tied src members share the derivative (weights sum
    to 1: a shift of every input shifts the max by as much), whatever x holds."""
    x, index, src = _scatter_case()
    ones = torch.ones_like(src)

    def f(s):
        return x.scatter_reduce(0, index, s, "amax", include_self=False)

    t = ft.jvp(f, (src,), (ones,))[1]
    torch.testing.assert_close(t[0, 0], torch.tensor(1.0, dtype=F64))
    assert ft.vjp(f, src)[1](torch.ones(3, 4, dtype=F64))[0][:, 0].tolist() == [0.5, 0.5]


@pytest.mark.parametrize("reduce", ["prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
def test_index_reduce(reduce, include_self):
    x, s = _x(4, 3), _x(5, 3, seed=1)
    index = torch.tensor([0, 2, 0, 3, 0])

    def f(x, s):
        return x.index_reduce(0, index, s, reduce, include_self=include_self)

    # torch has no forward mode for index_reduce: ours only
    _vjp_vs_torch_and_dot_test(f, (x, s))
    _vjp_vs_torch_and_dot_test(lambda x, s: x.index_reduce(1, index[:2], s[:4, :2], reduce), (x, s))
    if reduce in ("mean", "prod"):
        check_grads(f, (x, s), order=2)


@pytest.mark.parametrize("dtype", [F64, C128])
def test_as_strided(dtype):
    x = _x(4, 3, dtype=dtype)
    compare_with_torch_func(lambda x: x.as_strided((2, 2), (3, 1), 1), (x,), order=2)
    compare_with_torch_func(lambda x: x.as_strided((3, 4), (0, 1)), (x,))  # overlapping
    compare_with_torch_func(lambda x: torch.as_strided_copy(x, (5,), (2,)), (x,))
    compare_with_torch_func(lambda x: x.as_strided((), ()), (x,))


def test_as_strided_of_a_noncontiguous_input():
    # each element read is mapped back to the element of x stored there (torch.func computes
    # these; a rule that assumed a contiguous input raised)
    base = _x(4, 6)
    for x in (base.T, base[1:, 2:], base.T[1:]):
        compare_with_torch_func(lambda x: x.as_strided((2, 2), (1, 2)), (x,), order=2)
    # an expanded x has several elements at one memory location: no derivative is defined
    with pytest.raises(NotImplementedError, match="overlaps itself"):
        ft.grad(lambda x: x.as_strided((2,), (1,)).sum())(_x(1, 3).expand(4, 3))


def test_as_strided_scatter_vs_finite_differences():
    """torch.func's vjp of as_strided_scatter gives x's cotangent at the *written* positions
    (out = [x0, s0, x2, s1] below: it returns [0, ct1, 0, ct3]); ours, [ct0, 0, ct2, 0],
    agrees with finite differences."""
    x, s = _x(4), _x(2, seed=1)

    def f(x, s):
        return torch.as_strided_scatter(x, s, (2,), (2,), storage_offset=1)

    check_grads(f, (x, s), order=2)
    ct = _x(4, seed=2)
    gx, gs = ft.vjp(f, x, s)[1](ct)
    torch.testing.assert_close(gx, ct * torch.tensor([1.0, 0, 1, 0], dtype=F64))
    torch.testing.assert_close(gs, ct[1::2])
    torch.testing.assert_close(ft.jvp(f, (x, s), (x, s))[1], tf.jvp(f, (x, s), (x, s))[1])


@pytest.mark.parametrize("beta", [0.0, 0.5])
@pytest.mark.parametrize("dtype", [F64, C128])
def test_addbmm(beta, dtype):
    c, A, B = (
        _x(3, 4, dtype=dtype),
        _x(2, 3, 5, dtype=dtype, seed=1),
        _x(2, 5, 4, dtype=dtype, seed=2),
    )
    compare_with_torch_func(
        lambda c, A, B: torch.addbmm(c, A, B, beta=beta, alpha=1.5), (c, A, B), order=2
    )
    compare_with_torch_func(lambda c, A, B: torch.addbmm(c, A, B), (c[0], A, B))  # broadcast


@pytest.mark.parametrize("x", [_x(), _x(5)], ids=["0-d", "1-d"])
def test_unfold(x):
    compare_with_torch_func(lambda x: x.unfold(0, 1, 1), (x,), order=2)


@pytest.mark.parametrize(
    "f",
    [
        lambda x: x.masked_select(MASK),
        lambda x: x.scatter_reduce(0, torch.tensor([[0, 1, 0, 2, 1]]), x[:1] * 2, "amax"),
        lambda x: x.put(torch.tensor([1, 7]), x[0, :2]),
        lambda x: x.as_strided((2, 2), (3, 1), 1),
    ],
)
def test_vmap_of_vjp(f):
    xs = _x(4, 3, 5)
    cts = torch.stack([f(x) for x in _x(4, 3, 5, seed=1)])
    ours = ft.vmap(lambda x, c: ft.vjp(f, x)[1](c)[0])(xs, cts)
    ref = tf.vmap(lambda x, c: tf.vjp(f, x)[1](c)[0])(xs, cts)
    torch.testing.assert_close(ours, ref)


@pytest.mark.parametrize("reduce", ["sum", "mean", "max", "min", "prod"])
@pytest.mark.parametrize("how", ["lengths", "offsets", "axis1", "initial"])
def test_segment_reduce(reduce, how):
    """vjp against torch.func; the jvp (ours only) by the dot-product test and, where smooth,
    by finite differences."""
    data = _x(6, 3)
    data[4, 1] = data[5, 1]  # a tie in the last segment
    lengths = torch.tensor([2, 0, 4])
    kw = {"lengths": lengths}
    if how == "offsets":
        kw = {"offsets": torch.tensor([0, 2, 2, 6])}
    elif how == "axis1":
        data = data.T.contiguous()
        kw = {"lengths": lengths.expand(3, 3).contiguous(), "axis": 1}
    elif how == "initial":
        kw = {"lengths": lengths, "initial": 0.5 if reduce != "max" else 10.0}

    def f(d):
        return torch.segment_reduce(d, reduce, **kw)

    # torch's segment max/min vjp splits a tie only for a positive cotangent (a negative one
    # goes whole to every tied element); ours always splits
    _vjp_vs_torch_and_dot_test(f, (data,), positive_ct=reduce in ("max", "min"))
    if reduce in ("sum", "mean") and how != "axis1":  # (an empty segment's mean is NaN)
        kw["lengths"] = torch.tensor([2, 4])
        kw.pop("offsets", None)
        check_grads(f, (data,), order=2)


@pytest.mark.parametrize("include_self", [True, False])
def test_scatter_reduce_prod_second_order(include_self):
    """jvp of the vjp against finite differences of torch's vjp (torch.func's own jvp(vjp) is
    wrong with include_self=False)."""
    x, src = _x(6, 3) + 2, _x(5, 3, seed=1) + 2
    index = torch.tensor([[0, 1, 2], [0, 0, 2], [3, 1, 2], [0, 4, 4], [5, 1, 0]])
    ct, tx, ts = _x(6, 3, seed=2), _x(6, 3, seed=3), _x(5, 3, seed=4)

    def pull(lib):
        def g(x, s):
            f = lambda x, s: x.scatter_reduce(0, index, s, "prod", include_self=include_self)  # noqa: E731
            return lib.vjp(f, x, s)[1](ct)

        return g

    ours = ft.jvp(pull(ft), (x, src), (tx, ts))[1]
    eps = 1e-6
    hi, lo = pull(tf)(x + eps * tx, src + eps * ts), pull(tf)(x - eps * tx, src - eps * ts)
    for a, h, l in zip(ours, hi, lo):
        torch.testing.assert_close(a, (h - l) / (2 * eps), atol=1e-6, rtol=1e-6)


# groups of x's slots 0-4 with 0, 1 (in src), 1 (x itself), 2 and 3 zero members
_PROD_INDEX = torch.tensor([0, 0, 1, 1, 2, 3, 3, 4, 4, 4])
_PROD_X = torch.tensor([1.5, -2.0, 0.0, 0.0, 0.0], dtype=F64)
_PROD_SRC = torch.tensor([0.5, 3.0, 0.0, -1.5, 2.0, 0.0, 0.7, 0.0, 1.2, 0.0], dtype=F64)


def _group_products(x, src):
    """index_reduce(x, 0, _PROD_INDEX, src, 'prod') as products written out: the polynomial
    itself, so plain autograd's derivatives of it are exact at every order."""
    out = list(x.unbind())
    for k, i in enumerate(_PROD_INDEX.tolist()):
        out[i] = out[i] * src[k]
    return torch.stack(out)


@pytest.mark.parametrize("op", ["index_reduce", "scatter_reduce"])
def test_prod_second_derivative_through_zeros(op):
    """The prod weight of a member moves with the group's zeros: torch's autograd over our vjp
    (double backward), our own vjp(vjp) and hessian equal the polynomial's derivatives with 0,
    1, 2 and 3 zeros in a group (a nonzero member of a group with one zero has weight 0, whose
    derivative in the zero is not)."""
    if op == "index_reduce":
        f = lambda x, s: x.index_reduce(0, _PROD_INDEX, s, "prod")  # noqa: E731
    else:
        f = lambda x, s: x.scatter_reduce(0, _PROD_INDEX, s, "prod")  # noqa: E731
    torch.testing.assert_close(f(_PROD_X, _PROD_SRC), _group_products(_PROD_X, _PROD_SRC))
    c, wx, ws = _x(5, seed=1), _x(5, seed=2), _x(10, seed=3)

    def second(pullback):
        x, s = _PROD_X.clone().requires_grad_(), _PROD_SRC.clone().requires_grad_()
        gx, gs = pullback(x, s)
        return torch.autograd.grad((gx * wx).sum() + (gs * ws).sum(), (x, s))

    ours = second(lambda x, s: ft.vjp(f, x, s)[1](c))
    exact = second(
        lambda x, s: torch.autograd.grad(_group_products(x, s), (x, s), c, create_graph=True)
    )
    torch.testing.assert_close(ours, exact)

    def scalar(x, s):
        return (c * f(x, s)).sum()

    H = ft.hessian(scalar, argnums=(0, 1))(_PROD_X, _PROD_SRC)
    H_exact = torch.autograd.functional.hessian(
        lambda x, s: (c * _group_products(x, s)).sum(), (_PROD_X, _PROD_SRC)
    )
    for row, row_exact in zip(H, H_exact):
        torch.testing.assert_close(row, row_exact)


def test_prod_third_derivative_through_two_zeros():
    """With at most two zeros in a group the prod weights are exact at every order: the third
    derivative (jacfwd of our hessian) in x and src together equals the polynomial's."""
    index, c = _PROD_INDEX[:7], _x(4, seed=1)  # the groups with 0, 1, 1 and 2 zeros

    def split(z):
        return z[:4], z[4:]

    def ours(z):
        x, s = split(z)
        return (c * x.index_reduce(0, index, s, "prod")).sum()

    def exact(z):
        x, s = split(z)
        out = list(x.unbind())
        for k, i in enumerate(index.tolist()):
            out[i] = out[i] * s[k]
        return (c * torch.stack(out)).sum()

    z = torch.cat([_PROD_X[:4], _PROD_SRC[:7]])
    D3 = torch.autograd.functional.jacobian(
        lambda z: torch.autograd.functional.hessian(exact, z, create_graph=True), z
    )
    assert D3.abs().max() > 0  # the groups of three members have third derivatives
    torch.testing.assert_close(ft.jacfwd(ft.hessian(ours))(z), D3)


@pytest.mark.parametrize("dtype", [F64, C128])
def test_index_add_and_embedding_with_a_0d_index(dtype):
    """index_select treats a 0-d index as 1-d, so its transpose, index_add, gets a 0-d index
    with a source of shape (1, ...): torch's decomposition of index_add (an index_put) broke
    on it, which failed the second derivative of embedding with one index."""
    w, src = _x(10, 5, dtype=dtype), _x(1, 5, dtype=dtype, seed=1)
    one = torch.tensor(3)
    if dtype == F64:  # torch differentiates no complex embedding
        compare_with_torch_func(lambda w: torch.nn.functional.embedding(one, w), (w,), order=2)
    compare_with_torch_func(lambda w, s: w.index_add(0, one, s, alpha=2), (w, src), order=2)
    idx = torch.tensor([1, 4, 1])
    s3 = _x(3, 5, dtype=dtype, seed=2)
    compare_with_torch_func(lambda w, s: w.index_add(0, idx, s, alpha=0.5), (w, s3), order=2)
    s2 = _x(10, 2, dtype=dtype, seed=3)
    check_grads(lambda w, s: w.index_add(1, torch.tensor([0, 4]), s), (w, s2), order=2)


@pytest.mark.parametrize(
    "kw",
    [
        dict(padding_idx=0),
        dict(scale_grad_by_freq=True),
        dict(padding_idx=2, scale_grad_by_freq=True),
    ],
)
def test_embedding_padding_idx_and_scale_grad_by_freq(kw):
    """The rows of padding_idx get no gradient and scale_grad_by_freq divides by each index's
    count, as torch's embedding backward (the decomposition weight[indices] dropped both: the
    per-sample gradients of an nn.Embedding(padding_idx=0) were nonzero on the padding row)."""
    w = _x(6, 3)
    idx = torch.tensor([[0, 0, 2], [1, 0, 3], [2, 2, 5]])
    # torch's jvp is embedding of the tangent: not the transpose of its vjp (no check_grads)
    f = lambda w: torch.nn.functional.embedding(idx, w, **kw)
    compare_with_torch_func(f, (w,), check=False)

    def loss(w, i):
        return torch.nn.functional.embedding(i, w, **kw).pow(2).sum()

    torch.testing.assert_close(
        ft.vmap(ft.grad(loss), (None, 0))(w, idx), tf.vmap(tf.grad(loss), (None, 0))(w, idx)
    )
    torch.testing.assert_close(ft.hessian(loss)(w, idx), tf.hessian(loss)(w, idx))
    torch.testing.assert_close(ft.jacrev(f)(w), tf.jacrev(f)(w))


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_embedding_bag_scale_grad_by_freq(mode):
    """scale_grad_by_freq divides each index's gradient by its count in the batch (ignored
    before). torch's CPU kernel misplaces the counts for unsorted indices
    (torch_func_differences.md 18), so the oracle is embedding's, whose backward is right."""
    w = _x(6, 3)
    idx = torch.tensor([[5, 4, 4], [1, 0, 4]])
    bag = lambda w: torch.nn.functional.embedding_bag(idx, w, mode=mode, scale_grad_by_freq=True)
    rows = lambda w: torch.nn.functional.embedding(idx, w, scale_grad_by_freq=True)
    pool = (lambda r: r.sum(1)) if mode == "sum" else (lambda r: r.mean(1))
    ct = _x(2, 3, seed=1)
    ours = ft.vjp(bag, w)[1](ct)[0]
    torch.testing.assert_close(ours, tf.vjp(lambda w: pool(rows(w)), w)[1](ct)[0])
