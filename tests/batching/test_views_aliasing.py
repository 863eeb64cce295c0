"""Views and aliasing under vmap against torch.func: many-view ops (unbind, split,
chunk, tensor_split) and views of a lazy conjugate. Each test runs ours and torch.func on the
same input and compares values, strides, ``_base``, ``is_conj()`` and memory sharing."""

import pytest
import torch
import torch.func as tf

import functransforms as ft
from functransforms.errors import InplaceError
from functransforms.testing import check_vmap


def _shares(t, x):
    return t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()


def _leaves(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _same_views(ours, ref, x):
    """Values, strides, conj bit, ``_base is x`` and memory sharing, output by output."""
    ours, ref = _leaves(ours), _leaves(ref)
    assert len(ours) == len(ref)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.resolve_conj(), b.resolve_conj())
        assert a.shape == b.shape
        if _shares(b, x):  # a copy's layout is the kernel's (torch.func's may be a loop's)
            assert a.stride() == b.stride()
        assert a.is_conj() == b.is_conj()
        assert (a._base is x) == (b._base is x)
        assert _shares(a, x) == _shares(b, x)


MANY = {
    "unbind": lambda t: t.unbind(),
    "unbind_last": lambda t: t.unbind(-1),
    "torch.unbind_kw": lambda t: torch.unbind(t, dim=1),
    "split_int": lambda t: t.split(2),
    "split_uneven_dim1": lambda t: t.split(2, 1),
    "torch.split_kw": lambda t: torch.split(t, 3, dim=-1),
    "split_sizes": lambda t: t.split([1, 3, 1]),
    "split_with_sizes": lambda t: t.split_with_sizes([2, 2, 1]),
    "chunk": lambda t: t.chunk(3),
    "chunk_dim": lambda t: torch.chunk(t, 2, 1),
    "tensor_split_n": lambda t: t.tensor_split(3),
    "tensor_split_idx": lambda t: t.tensor_split([1, 1, 4, 9], 1),
    "split_whole": lambda t: t.split(5),
}


@pytest.mark.parametrize("name", sorted(MANY))
@pytest.mark.parametrize("in_dim", [0, 1, 2])
def test_many_views_are_views_of_the_input_as_in_torch_func(name, in_dim):
    f = MANY[name]
    x = torch.randn(4, 5, 6).movedim(0, in_dim)  # the batch (size 4) at in_dim
    ours, ref = ft.vmap(f, in_dims=in_dim)(x), tf.vmap(f, in_dims=in_dim)(x)
    assert type(ours) is type(ref)
    _same_views(ours, ref, x)


def test_many_views_write_through_and_base_inside_vmap():
    seen = {}

    def f(t):
        pieces = t.unbind(0)
        seen["base"] = pieces[1]._base  # torch.func: None (its BatchedTensors are not views)
        seen["offset"] = pieces[1].storage_offset()
        pieces[1].mul_(10)  # a write through one piece reaches the input
        return t.sum(0), pieces[2]

    for lib in (ft, tf):
        x = torch.arange(24.0).reshape(2, 3, 4).clone()  # not itself a view
        s, p = lib.vmap(f)(x)
        expected = torch.arange(24.0).reshape(2, 3, 4)
        expected[:, 1] *= 10
        torch.testing.assert_close(x, expected)
        torch.testing.assert_close(s, expected.sum(1))
        assert p._base is x
        assert seen["base"] is None
    # as every wrapper reports: offset 0 within the example (as_strided offsets are relative)
    assert ft.vmap(lambda t: t.unbind(0)[2].as_strided((2,), (1,)))(x).tolist() == [
        [8.0, 9.0],
        [20.0, 21.0],
    ]


def test_many_views_errors_are_torchs():
    x = torch.randn(2, 3, 4)
    for f in (
        lambda t: t.unbind(2),
        lambda t: t.split(0),
        lambda t: t.chunk(0),
        lambda t: t.split([1, 1]),
    ):
        with pytest.raises(Exception) as ref:
            tf.vmap(f)(x)
        with pytest.raises(type(ref.value)):
            ft.vmap(f)(x)


def test_many_views_compose_with_other_transforms():
    x = torch.randn(3, 4, 5, dtype=torch.float64)

    def loss(t):
        a, b = t.split(2)
        return (a.sin() * b[:2].cos()).sum() + sum(r.pow(2).sum() for r in t.unbind(1))

    torch.testing.assert_close(ft.vmap(ft.grad(loss))(x), tf.vmap(tf.grad(loss))(x))
    torch.testing.assert_close(
        ft.grad(lambda t: ft.vmap(loss)(t).sum())(x), tf.grad(lambda t: tf.vmap(loss)(t).sum())(x)
    )
    nested = lambda t: t.unbind(-1)  # noqa: E731
    _same_views(ft.vmap(ft.vmap(nested))(x), tf.vmap(tf.vmap(nested))(x), x)
    check_vmap(lambda t: torch.stack(t.chunk(2, -1)[::-1], 0).sum(0), (x[..., :4],))
    # torch's autograd sees through: the pieces of a requires-grad input
    w = x.clone().requires_grad_()
    out = ft.vmap(lambda t: t.unbind(0)[1] * 2)(w)
    out.sum().backward()
    expected = torch.zeros_like(x)
    expected[:, 1] = 2
    torch.testing.assert_close(w.grad, expected)


# -- views of a lazy conjugate -------------------------------------------------------------
CONJ_VIEWS = {
    "conj": lambda t: t.conj(),
    "slice": lambda t: t.conj()[1:],
    "select": lambda t: t.conj()[1],
    "narrow": lambda t: t.conj().narrow(1, 1, 2),
    "transpose": lambda t: t.conj().transpose(0, 1),
    "permute": lambda t: t.conj().permute(1, 0),
    "t": lambda t: t.conj().t(),
    "mT": lambda t: t.conj().mT,
    "view": lambda t: t.conj().view(12),
    "reshape": lambda t: t.conj().reshape(2, 6),
    "reshape_copy": lambda t: t.conj().t().reshape(12),
    "diagonal": lambda t: t.conj().diagonal(),
    "unbind": lambda t: t.conj().unbind(),
    "split": lambda t: t.conj().split(2, 1),
    "expand": lambda t: t.conj().expand(2, 3, 4),
    "unsqueeze": lambda t: t.conj().unsqueeze(0),
    "conj_of_view": lambda t: t[1:].conj(),
    "conj_conj": lambda t: t.conj()[1:].conj(),
    "real": lambda t: t.conj().real,
    "resolve_conj": lambda t: t.conj()[1:].resolve_conj(),
    "conj_physical": lambda t: t.conj().t().conj_physical(),
    "movedim": lambda t: t.conj().movedim(0, 1),
}


@pytest.mark.parametrize("name", sorted(CONJ_VIEWS))
@pytest.mark.parametrize("in_dim", [0, 1])
def test_views_of_conj_stay_lazy_views_as_in_torch_func(name, in_dim):
    f = CONJ_VIEWS[name]
    z = torch.randn(5, 3, 4, dtype=torch.complex128).movedim(0, in_dim)
    ours, ref = ft.vmap(f, in_dims=in_dim)(z), tf.vmap(f, in_dims=in_dim)(z)
    _same_views(ours, ref, z)


CONSUMERS = {
    "mul": lambda t: t.conj()[1:] * t[1:],
    "matmul": lambda t: t.conj().t() @ t,
    "sum": lambda t: t.conj().transpose(0, 1).sum(0),
    "abs": lambda t: t.conj()[0].abs(),
    "add_scalar": lambda t: t.conj().unbind()[1] + 1j,
    "mv": lambda t: torch.mv(t.conj(), t[0]),
    "pinv": lambda t: torch.linalg.pinv(t.conj()[:, :3]),
    "real_sum": lambda t: t.conj().real.sum() + t.conj()[1:].real.t().sum(0),
    "cat": lambda t: torch.cat([t.conj()[1:], t[:1]]),
    "stack": lambda t: torch.stack([t.conj(), t]),
    "where": lambda t: torch.where(t.real > 0, t.conj(), t),
    "copy_into": lambda t: torch.zeros_like(t).copy_(t.conj().t().t()),
    "einsum": lambda t: torch.einsum("ij,kj->ik", t.conj(), t),
    "fft": lambda t: torch.fft.fft(t.conj()[1:]),
    "flatten_copy": lambda t: t.conj().t().flatten(),
    "index": lambda t: t.conj()[torch.tensor([0, 2])],
}


@pytest.mark.parametrize("name", sorted(CONSUMERS))
def test_ops_on_conj_views_give_torchs_values(name):
    f = CONSUMERS[name]
    z = torch.randn(5, 3, 4, dtype=torch.complex128)
    torch.testing.assert_close(ft.vmap(f)(z), tf.vmap(f)(z))


def test_imag_of_conj_views_against_a_loop():
    # torch.func has no batching rule for _neg_view (conj().imag raises there): a loop decides
    z = torch.randn(5, 3, 4, dtype=torch.complex128)
    check_vmap(lambda t: t.conj().imag, (z,))
    check_vmap(lambda t: t.conj()[1:].t().imag * 2 + t.conj().real[1:].t(), (z,))


def test_view_as_real_of_a_conj_view_raises_as_torch():
    z = torch.randn(2, 3, dtype=torch.complex64)
    f = lambda t: torch.view_as_real(t.conj()[1:])  # noqa: E731
    with pytest.raises(RuntimeError, match="conjugate"):
        tf.vmap(f)(z)
    with pytest.raises(RuntimeError, match="conjugate"):
        ft.vmap(f)(z)
    g = lambda t: torch.view_as_real(t.conj().resolve_conj())  # noqa: E731
    torch.testing.assert_close(ft.vmap(g)(z), tf.vmap(g)(z))


def test_a_write_into_the_base_shows_in_its_conj_views():
    def f(t):
        c = t.conj()
        s = c[1:]
        before = s * 1
        t.mul_(2)  # c and s are views of t: they see it
        return before, c * 1, s.sum()

    z = torch.randn(3, 4, dtype=torch.complex128)
    ours, ref = ft.vmap(f)(z.clone()), tf.vmap(f)(z.clone())
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b)


def test_a_resolved_copy_is_a_copy():
    def f(t):
        c = t.conj()
        r = c.resolve_conj()
        r.mul_(2)  # a copy: c does not change
        return c * 1, r

    z = torch.randn(3, 4, dtype=torch.complex128)
    for a, b in zip(ft.vmap(f)(z.clone()), tf.vmap(f)(z.clone())):
        torch.testing.assert_close(a, b)


def test_inplace_into_views_of_conj_raises():
    # torch.func writes through the conjugate view; ours raises (docs/torch_func_differences.md)
    z = torch.randn(3, 4, dtype=torch.complex128)
    for f in (lambda t: t.conj()[1:].mul_(2), lambda t: t.conj().unbind()[0].add_(1)):
        with pytest.raises(InplaceError, match=r"writes in place into the result of `conj\(\)`"):
            ft.vmap(f)(z.clone())


def test_is_conj_inside_vmap_as_torch_func():
    seen = []
    for lib in (ft, tf):
        lib.vmap(
            lambda t: seen.append((t.conj().is_conj(), t.conj()[1:].is_conj(), t.is_conj())) or t
        )(torch.randn(2, 3, dtype=torch.complex64))
    assert seen[0] == seen[1] == (True, True, False)


def test_conj_views_compose_with_grad_and_nested_vmap():
    z = torch.randn(3, 4, 5, dtype=torch.complex128)

    def loss(t):
        c = t.conj()
        return (c.unbind(0)[1] * t[1]).real.sum() + (c.t()[2:] * 1j).imag.sum()

    torch.testing.assert_close(ft.vmap(ft.grad(loss))(z), tf.vmap(tf.grad(loss))(z))
    torch.testing.assert_close(
        ft.grad(lambda t: ft.vmap(loss)(t).sum())(z), tf.grad(lambda t: tf.vmap(loss)(t).sum())(z)
    )
    nested = lambda t: t.conj()[1:]  # noqa: E731
    _same_views(ft.vmap(ft.vmap(nested))(z), tf.vmap(tf.vmap(nested))(z), z)


def test_a_piece_read_after_its_input_was_written_with_a_grad_requiring_value():
    # the piece's view is made when first read (Note [Pieces made when first read]); made
    # after the write, it must be on torch's graph through the written input
    x = torch.randn(3, 4, 5)
    w = torch.randn(4, 5, requires_grad=True)

    def f(t):
        p = t.unbind(0)[1]
        t.mul_(w)
        return torch.stack([p, p]).sum()

    ft.vmap(f)(x.clone()).sum().backward()
    expected = torch.zeros(4, 5)
    expected[1] = 2 * x[:, 1].sum(0)
    torch.testing.assert_close(w.grad, expected)


def test_pieces_see_writes_made_before_they_are_read():
    def f(t):
        a, b = t.split(2)
        c = t.unbind(0)[3]
        t.add_(1)
        return a * 1, b.sum(0), c + 0

    x = torch.randn(3, 4, 5)
    for p, q in zip(ft.vmap(f)(x.clone()), tf.vmap(f)(x.clone())):
        torch.testing.assert_close(p, q)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64, torch.bool, torch.complex64])
def test_many_views_keep_dtype(dtype):
    x = torch.randn(3, 4, 5).to(dtype)
    for f in (MANY["unbind"], MANY["split_uneven_dim1"], MANY["tensor_split_idx"]):
        ours, ref = ft.vmap(f)(x), tf.vmap(f)(x)
        _same_views(ours, ref, x)
        assert all(o.dtype == dtype for o in ours)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # the wrappers' default dtype changes with it
    try:
        y = torch.randn(3, 4, dtype=torch.float32)
        assert all(o.dtype == torch.float32 for o in ft.vmap(lambda t: t.unbind())(y))
        seen = []
        ft.vmap(lambda t: seen.append(t.unbind()[1].dtype) or t)(y)  # the wrapper's dtype
        assert seen == [torch.float32]
    finally:
        torch.set_default_dtype(previous)


@pytest.mark.parametrize(
    "f",
    [
        lambda t: t.clone().resize_((5, 25)),
        lambda t: t.clone().resize_((125,)) * 2,
        lambda t: t.clone().as_strided_((5, 5), (1, 5)),
        lambda t: t.clone().as_strided_((4, 3), (2, 7), 3).mul_(2),
    ],
    ids=["resize_", "resize_same", "as_strided_", "as_strided_offset"],
)
def test_inplace_view_ops_reshape_the_batch_as_a_loop(f):
    """resize_ and as_strided_ had no rule: the per-example loop reshaped views of each
    example and the batched tensor kept its shape (silently; torch.func too for as_strided_)."""
    x = torch.randn(3, 125)
    torch.testing.assert_close(ft.vmap(f)(x), torch.stack([f(r) for r in x]))


def test_inplace_view_ops_that_cannot_batch_raise():
    x = torch.randn(3, 125)
    with pytest.raises(InplaceError, match=r"resize_ to \[200\]"):
        ft.vmap(lambda t: t.clone().resize_((200,)))(x)
    with pytest.raises(InplaceError, match=r"resize_as_.*no batching rule"):
        ft.vmap(lambda t: t.clone().resize_as_(torch.empty(5, 25)))(x)
