"""The shaped fast path (Note [Shaped fast path] in batching/_fastpath.py): transpose, matmul,
dim reductions and softmax give exactly what the ordinary dispatch path gives, for every batch
dim position, dim spelling and operand rank, and step aside where they must."""

import pytest
import torch
from functransforms.batching import _tensor

import functransforms as ft


@pytest.fixture
def dispatch_count(monkeypatch):
    calls = []
    process = _tensor.VmapInterpreter.process

    def counting(self, func, args, kwargs):
        calls.append(func)
        return process(self, func, args, kwargs)

    monkeypatch.setattr(_tensor.VmapInterpreter, "process", counting)
    return calls


def _both_paths(fn, args, in_dims, monkeypatch):
    fast = ft.vmap(fn, in_dims=in_dims)(*args)
    with monkeypatch.context() as m:
        m.setattr(_tensor, "SHAPED_FUNCS", {})
        slow = ft.vmap(fn, in_dims=in_dims)(*args)
    ref = torch.func.vmap(fn, in_dims=in_dims)(*args)
    for out in (fast, slow):
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        assert out.shape == ref.shape and out.dtype == ref.dtype
    return fast


_UNARY = [
    lambda v: v.transpose(0, -1),
    lambda v: torch.transpose(v, -2, 1),
    lambda v: v.swapaxes(0, 1),
    lambda v: v.sum(),
    lambda v: v.sum(-1),
    lambda v: v.sum((0, 2), True),
    lambda v: torch.sum(v, dim=[1], keepdim=True),
    lambda v: v.sum(dim=()),
    lambda v: v.mean(1),
    lambda v: torch.mean(v, (-1, 0)),
    lambda v: v.amax(-1, keepdim=True),
    lambda v: torch.amax(v, (0, 1)),
    lambda v: v.amax(),
    lambda v: v.amin(dim=2),
    lambda v: torch.softmax(v, -1),
    lambda v: v.softmax(0),
    lambda v: torch.log_softmax(v, 1),
    lambda v: v.log_softmax(dim=-2),  # a keyword: the ordinary path
    lambda v: v.sum(1, dtype=torch.float64),  # dtype: the ordinary path
    lambda v: v.reshape(-1),
    lambda v: v.reshape(5, 6),
    lambda v: torch.reshape(v, (2, -1, 5)),
    lambda v: v.view(3, 10),
    lambda v: v.view([3, -1]),
    lambda v: v.unsqueeze(0),
    lambda v: v.unsqueeze(-1),
    lambda v: torch.unsqueeze(v, 2),
    lambda v: v.mT,
    lambda v: v.mH,
    lambda v: v.adjoint(),
    lambda v: torch.adjoint(v),
    lambda v: v.to(torch.float64),
    lambda v: v * float(v.to(torch.float32) is v),  # torch returns self: the fast path too
    lambda v: v.to(torch.int64) + v.to(torch.bool),
    lambda v: v.to(torch.complex64).mH,
    lambda v: v.to(torch.float16, copy=True),  # a keyword: the ordinary path
]


@pytest.mark.parametrize("bdim", [0, 1, 3])
@pytest.mark.parametrize("i", range(len(_UNARY)))
def test_unary_same_answer_as_the_dispatch_path(i, bdim, monkeypatch):
    x = torch.randn(4, 3, 5, 2).movedim(0, bdim)
    _both_paths(_UNARY[i], (x,), bdim, monkeypatch)


_SWAPS = [
    lambda v: v.t(),
    lambda v: torch.t(v),
    lambda v: v.T,
    lambda v: v.mT,
    lambda v: v.mH,
    lambda v: v.adjoint(),
    lambda v: v.mT.mul_(2),  # writes through the view into the batched input's clone
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64])
@pytest.mark.parametrize("shape", [(3,), (3, 5), (2, 3, 5)])
@pytest.mark.parametrize("bdim", [0, 1])
@pytest.mark.parametrize("i", range(len(_SWAPS)))
def test_matrix_transposes_same_answer_as_the_dispatch_path(i, bdim, shape, dtype, monkeypatch):
    x = torch.randn(4, *shape, dtype=dtype).movedim(0, bdim)
    fn = _SWAPS[i]
    f = lambda v: fn(v.clone())  # noqa: E731
    try:
        ref = torch.func.vmap(f, in_dims=bdim)(x)
    except RuntimeError:  # t() of a 3-d value, mT of a vector
        for m in (None, {}):
            with monkeypatch.context() as c:
                if m is not None:
                    c.setattr(_tensor, "SHAPED_FUNCS", m)
                with pytest.raises(RuntimeError):
                    ft.vmap(f, in_dims=bdim)(x)
        return
    out = _both_paths(f, (x,), bdim, monkeypatch)
    assert out.is_conj() == ref.is_conj()


def test_matrix_transposes_are_views(dispatch_count):
    x = torch.randn(4, 3, 5)

    def f(v):
        v = v.clone()
        v.mT.mul_(2)
        v.t().add_(1)
        return v.mH + v.T.t().mT

    torch.testing.assert_close(ft.vmap(f)(x), torch.func.vmap(f)(x))
    assert torch.ops.aten.transpose.int not in dispatch_count
    assert torch.ops.aten.t.default not in dispatch_count


_MM = [  # (logical shape of a or None when plain, its plain shape; same for b)
    ((3, 4), (4, 2)),
    ((2, 3, 4), (2, 4, 5)),
    ((4,), (4, 2)),
    ((3, 4), (4,)),
    ((2, 3, 4), (4, 5)),
    ((2, 3, 4), (2, 4, 5)),
    ((3, 4), (2, 4, 5)),  # plain of higher rank: must not align with the mapped dim
    ((4,), (2, 4, 5)),
    ((4,), (4,)),
    ((3, 4), (1, 4, 5)),
]


@pytest.mark.parametrize("batched", ["a", "b", "ab"])
@pytest.mark.parametrize("bdim", [0, -1])
@pytest.mark.parametrize("shapes", _MM)
def test_matmul_same_answer_as_the_dispatch_path(shapes, bdim, batched, monkeypatch):
    sa, sb = shapes
    B = 3
    a = torch.randn(B, *sa).movedim(0, bdim) if "a" in batched else torch.randn(*sa)
    b = torch.randn(B, *sb).movedim(0, bdim) if "b" in batched else torch.randn(*sb)
    in_dims = (
        (bdim % a.dim()) if "a" in batched else None,
        (bdim % b.dim()) if "b" in batched else None,
    )
    for fn in (torch.matmul, lambda x, y: x @ y, torch.Tensor.matmul, torch.mm, torch.Tensor.mm):
        try:
            ref = torch.func.vmap(fn, in_dims=in_dims)(a, b)
        except RuntimeError:
            with pytest.raises(RuntimeError):
                ft.vmap(fn, in_dims=in_dims)(a, b)
            continue
        out = _both_paths(fn, (a, b), in_dims, monkeypatch)
        assert out.shape == ref.shape


def test_taken_for_an_attention_block(dispatch_count):
    q, k, v = (torch.randn(4, 6, 8) for _ in range(3))

    def attention(q, k, v):
        s = q @ k.transpose(-2, -1) / 8**0.5
        p = torch.exp(s - s.amax(-1, keepdim=True))
        return (p / p.sum(-1, keepdim=True)) @ torch.softmax(v, -1)

    out = ft.vmap(attention)(q, k, v)
    torch.testing.assert_close(out, torch.func.vmap(attention)(q, k, v))
    assert dispatch_count == []


def test_errors_name_logical_dims():
    x = torch.randn(4, 3)
    with pytest.raises(IndexError, match=r"range of \[-1, 0\], but got 1"):
        ft.vmap(lambda v: v.sum(1))(x)
    with pytest.raises(IndexError):
        ft.vmap(lambda v: v.transpose(0, 2))(x)
    with pytest.raises(RuntimeError):
        ft.vmap(lambda v: v.sum((0, 0)))(torch.randn(4, 3, 2))
    with pytest.raises(RuntimeError, match="is invalid for input of size"):
        ft.vmap(lambda v: v.reshape(7))(x)
    with pytest.raises(IndexError):
        ft.vmap(lambda v: v.unsqueeze(3))(x)


def test_torch_autograd_sees_the_fast_path():
    w = torch.randn(3, 2, requires_grad=True)
    x = torch.randn(5, 4, 3)
    out = ft.vmap(lambda v: (v @ w).softmax(-1).sum(0))(x)
    (g,) = torch.autograd.grad(out.sum(), w)
    torch.testing.assert_close(g, torch.autograd.grad((x @ w).softmax(-1).sum(1).sum(), w)[0])


def test_composes_under_grad_and_nested_vmap():
    x = torch.randn(3, 4, 5)
    w = torch.randn(5, 5)

    def f(v):
        return (v @ w).softmax(-1).transpose(0, 1).amax(0).sum()

    torch.testing.assert_close(ft.vmap(ft.grad(f))(x), torch.func.vmap(torch.func.grad(f))(x))
    y = torch.randn(2, 3, 4, 5)
    torch.testing.assert_close(
        ft.vmap(ft.vmap(f), in_dims=1)(y), torch.func.vmap(torch.func.vmap(f), in_dims=1)(y)
    )


_SDPA = [
    dict(),
    dict(is_causal=True),
    dict(scale=0.3),
    dict(attn_mask=torch.ones(6, 6, dtype=torch.bool).tril()),  # the ordinary path
]


@pytest.mark.parametrize("kw", range(len(_SDPA)))
@pytest.mark.parametrize("shape", [(6, 8), (2, 6, 8)])
@pytest.mark.parametrize("bdim", [0, 1])
def test_sdpa_same_answer_as_the_dispatch_path(shape, bdim, kw, monkeypatch):
    q, k, v = (torch.randn(3, *shape).movedim(0, bdim) for _ in range(3))

    def f(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, **_SDPA[kw])

    _both_paths(f, (q, k, v), bdim, monkeypatch)


def test_sdpa_is_one_op(dispatch_count):
    q, k, v = (torch.randn(4, 6, 8) for _ in range(3))
    out = ft.vmap(torch.nn.functional.scaled_dot_product_attention)(q, k, v)
    ref = torch.func.vmap(torch.nn.functional.scaled_dot_product_attention)(q, k, v)
    torch.testing.assert_close(out, ref)
    assert dispatch_count == []


# -- Note [Batched matrix products as bmm] ----------------------------------------------------


def _bits(a, b):
    return (
        a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) and a.stride() == b.stride()
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.complex64])
@pytest.mark.parametrize("bdims", [(0, 0), (1, 0), (2, 2)])
def test_batched_matrix_product_is_matmuls_bmm(dtype, bdims, monkeypatch):
    g = torch.Generator().manual_seed(3)
    a = torch.randn(5, 3, 7, generator=g, dtype=dtype).movedim(0, bdims[0])
    b = torch.randn(5, 7, 4, generator=g, dtype=dtype).movedim(0, bdims[1])
    for fn in (torch.matmul, lambda x, y: x @ y, lambda x, y: x.conj() @ y.mT.mT):
        fast = ft.vmap(fn, in_dims=bdims)(a, b)
        with monkeypatch.context() as m:
            m.setattr(_tensor, "SHAPED_FUNCS", {})
            slow = ft.vmap(fn, in_dims=bdims)(a, b)
        loop = torch.stack([fn(a.select(bdims[0], i), b.select(bdims[1], i)) for i in range(5)])
        assert _bits(fast.resolve_conj(), slow.resolve_conj())
        torch.testing.assert_close(fast, loop)
    with pytest.raises(RuntimeError):  # inner sizes that do not match: matmul's error
        ft.vmap(torch.matmul)(a.movedim(bdims[0], 0), a.movedim(bdims[0], 0))


def test_batched_matrix_product_reaches_a_lower_level_whole(monkeypatch):
    # grad(vmap(f)) with f a product of two batched values that the grad level tracks: one
    # bmm node there (matmul would arrive decomposed into six), and the same gradient
    from functransforms.autodiff import reverse

    seen = []
    process = reverse.GradInterpreter.process

    def counting(self, func, args, kwargs):
        seen.append(func)
        return process(self, func, args, kwargs)

    g = torch.Generator().manual_seed(4)
    a = torch.randn(5, 3, 7, generator=g, dtype=torch.float64)
    b = torch.randn(5, 7, 4, generator=g, dtype=torch.float64)
    f = lambda a, b: ft.vmap(torch.matmul)(a, b).sin().sum()  # noqa: E731
    monkeypatch.setattr(reverse.GradInterpreter, "process", counting)
    fast = ft.grad(f, argnums=(0, 1))(a, b)
    assert torch.ops.aten.bmm.default in seen and torch.ops.aten.expand.default not in seen
    monkeypatch.setattr(_tensor, "SHAPED_FUNCS", {})
    slow = ft.grad(f, argnums=(0, 1))(a, b)
    theirs = torch.func.grad(lambda a, b: torch.func.vmap(torch.matmul)(a, b).sin().sum(), (0, 1))
    for x, y, z in zip(fast, slow, theirs(a, b)):
        assert _bits(x, y)
        torch.testing.assert_close(x, z)
