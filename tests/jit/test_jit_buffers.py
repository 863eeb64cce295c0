"""jit reuses the large buffers of earlier calls once their caller dropped them (Note [Large
buffers reused across calls], functransforms/_jit/_buffers.py): same values and layouts, never
a buffer somebody still holds, autograd untouched, memory released on request."""

import threading

import pytest
import torch
import torch.func as tf

import functransforms as ft
from functransforms import _compat
from functransforms._jit import _buffers as jb

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def small_large(monkeypatch):
    """Large means >= 1 MB here (32 MB in the library): the same code on small tensors."""
    monkeypatch.setattr(jb, "LARGE_BYTES", 1 << 20)


def per_sample_grads(lib):
    def loss(w, x, y):
        return torch.nn.functional.cross_entropy(torch.tanh(x @ w.T)[None], y[None])

    return lib.vmap(lib.grad(loss), in_dims=(None, 0, 0))


def data(B=32, out=96, inp=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) / inp**0.5
    return w, torch.randn(B, inp, generator=g), torch.randint(0, out, (B,), generator=g)


@pytest.mark.parametrize("backend", [None, "inductor"])
def test_a_dropped_result_is_reused_and_a_held_one_never(backend):
    args = data()  # the per-sample gradient: [32, 96, 200] floats, 2.4 MB
    eager = per_sample_grads(ft)(*args)
    jitted = ft.jit(per_sample_grads(ft), backend=backend)
    jitted(*args)  # the trace
    first = jitted(*args)
    ptr = first.data_ptr()
    del first
    held = jitted(*args)
    assert held.data_ptr() == ptr  # dropped: its memory is written again
    tol = {} if backend is None else {"rtol": 1e-4, "atol": 1e-6}
    torch.testing.assert_close(held, per_sample_grads(tf)(*args), **tol)
    if backend is None:  # replayed op by op: the same kernels, bit-identical
        assert torch.equal(held, eager)
    assert held.shape == eager.shape and held.stride() == eager.stride()
    before = held.clone()
    others = [jitted(*data(seed=s)) for s in (1, 2, 3)]  # while `held` is alive
    assert torch.equal(held, before)
    assert held.data_ptr() not in {o.data_ptr() for o in others}
    for s, o in zip((1, 2, 3), others):
        torch.testing.assert_close(o, per_sample_grads(ft)(*data(seed=s)), **tol)


HOLDERS = {  # something referring to a result's memory, and that memory read back from it
    "view": (lambda r: r[3], lambda k, v: torch.equal(k, v[3])),
    "numpy": (lambda r: r.numpy(), lambda k, v: torch.equal(torch.from_numpy(k), v)),
    "storage": (
        lambda r: r.untyped_storage(),
        lambda k, v: torch.equal(torch.empty(0).set_(k, 0, v.shape, v.stride()), v),
    ),
    "autograd": (  # the product saves r for its backward
        lambda r: (r.requires_grad_() * 2.0).exp(),
        lambda k, v: True,
    ),
}


@pytest.mark.parametrize("name", HOLDERS)
def test_anything_still_referring_to_a_result_keeps_it(name):
    hold, read = HOLDERS[name]
    args = data()
    jitted = ft.jit(per_sample_grads(ft))
    jitted(*args)
    r = jitted(*args)
    ptr, value = r.data_ptr(), r.detach().clone()
    keep = hold(r)
    del r
    for s in (1, 2, 3):
        assert jitted(*data(seed=s)).data_ptr() != ptr
    assert read(keep, value)


def test_a_training_loop_alternates_two_buffers():
    args = data()
    jitted = ft.jit(per_sample_grads(ft))
    g = jitted(*args)
    ptrs = []
    for _ in range(6):
        g = jitted(*args)  # the previous g is alive during the call
        ptrs.append(g.data_ptr())
    assert len(set(ptrs[1:])) == 2


def test_another_signature_or_cache_clear_releases_the_kept_buffers():
    def refs(t):  # references to t's storage: t, and the jitted function's if it keeps it
        return _compat.storage_use_count(_compat.storage_address(t))

    args = data()
    jitted = ft.jit(per_sample_grads(ft))
    jitted(*args)
    mine = jitted(*args).detach()
    assert refs(mine) == 2
    jitted(*data(B=40))  # a new signature: traced
    jitted(*data(B=40))  # and replayed: its buffers replace the B=32 ones
    assert refs(mine) == 1
    mine = jitted(*data(B=40)).detach()
    assert refs(mine) == 2
    jitted.cache_clear()
    assert refs(mine) == 1


@pytest.mark.parametrize("backend", [None, "inductor"])
def test_intermediates_are_not_kept(backend):
    def f(w, x, y):
        return per_sample_grads(ft)(w, x, y).square().sum((1, 2))  # large inside, small out

    args = data()
    jitted = ft.jit(f, backend=backend)
    jitted(*args)
    torch.testing.assert_close(jitted(*args), f(*args), rtol=1e-4, atol=1e-6)
    assert not jitted._spares._kept


def test_replay_keeps_autograd_when_an_argument_requires_grad():
    w, x, _ = data()

    def f(w, x):
        return (x[:, :, None] * w.T[None]).tanh()  # [32, 200, 96]: large

    jitted = ft.jit(f)
    wg = w.clone().requires_grad_()
    jitted(wg, x)
    out = jitted(wg, x)  # autograd records the product: the functional overload runs
    (gw,) = torch.autograd.grad(out.sum(), wg)
    ref = w.clone().requires_grad_()
    (gref,) = torch.autograd.grad(f(ref, x).sum(), ref)
    torch.testing.assert_close(gw, gref)
    with torch.no_grad():
        jitted(wg, x)  # a new signature: traced
        a = jitted(wg, x)
        ptr = a.data_ptr()
        del a
        b = jitted(wg, x)
        assert b.data_ptr() == ptr and torch.equal(b, f(w, x))


def test_inductor_outputs_viewing_one_large_buffer():
    def f(w, x, y):
        g = per_sample_grads(ft)(w, x, y)
        return {"t": g.transpose(1, 2), "g": g, "norm": g.norm(), "x": x * 2}

    args = data()
    eager = f(*args)
    jitted = ft.jit(f, backend="inductor")
    jitted(*args)
    out = jitted(*args)
    for k in eager:  # inductor sums the 600k squares of the norm in its own order
        torch.testing.assert_close(out[k], eager[k], rtol=1e-4, atol=1e-6)
        assert out[k].shape == eager[k].shape and out[k].stride() == eager[k].stride(), k
    assert out["t"].data_ptr() == out["g"].data_ptr()  # one buffer, two views of it
    again = jitted(*args)
    assert again["g"].data_ptr() != out["g"].data_ptr()
    torch.testing.assert_close(out["g"], again["g"])


def test_a_default_device_around_the_call_does_not_move_kept_buffers():
    args = data()
    jitted = ft.jit(per_sample_grads(ft))
    with torch.device("meta"):
        jitted(*args)
        jitted(*args).data_ptr()
        out = jitted(*args)
    assert out.device.type == "cpu"
    assert torch.equal(out, per_sample_grads(ft)(*args))


def test_threads_calling_one_jitted_function_never_share_a_buffer():
    jitted = ft.jit(per_sample_grads(ft))
    jitted(*data())
    expected = {s: per_sample_grads(ft)(*data(seed=s)) for s in range(8)}
    errors = []

    def work(s):
        for _ in range(10):
            r = jitted(*data(seed=s))
            if not torch.equal(r, expected[s]):
                errors.append(s)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


@pytest.mark.parametrize(
    "op, expected",
    [
        (aten.mul.Tensor, aten.mul.out),
        (aten.mm.default, aten.mm.out),
        (aten.baddbmm.default, aten.baddbmm.out),
        (aten.exp.default, aten.exp.out),
        (aten.relu.default, None),  # its out= is generated: relu, then a copy
        (aten.mul.Scalar, None),  # mul.out takes a tensor where mul.Scalar takes a number
        (aten.bernoulli.p, None),  # random
        (aten.sum.dim_IntList, None),  # not pointwise
        (aten.add_.Tensor, None),  # in place
    ],
)
def test_only_ops_whose_out_kernel_is_their_own(op, expected):
    assert jb._out_overload(op) is expected
