"""jit writes large buffers into transparent-huge-page memory (Note [Large buffers in huge
pages], functransforms/_jit_hugepages.py): same values, same layouts, autograd untouched."""

import pytest
import torch
import torch.func as tf

import functransforms as ft
from functransforms import _jit_hugepages as hp

aten = torch.ops.aten


@pytest.fixture
def counted(monkeypatch):
    """Large means >= 1 MB here (32 MB in the library), and every huge-page buffer is counted."""
    monkeypatch.setattr(hp, "LARGE_BYTES", 1 << 20)
    calls = []
    real = hp.empty_huge

    def empty_huge(size, stride, dtype):
        calls.append(tuple(size))
        return real(size, stride, dtype)

    monkeypatch.setattr(hp, "empty_huge", empty_huge)
    if not hp.enabled():
        monkeypatch.setattr(hp, "_madvise", lambda *a: 0)  # the rewrite, without the advice
    return calls


def per_sample_grads(lib):
    def loss(w, x, y):
        return torch.nn.functional.cross_entropy(torch.tanh(x @ w.T)[None], y[None])

    return lib.vmap(lib.grad(loss), in_dims=(None, 0, 0))


def data(B=32, out=96, inp=200):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(out, inp, generator=g) / inp**0.5
    return w, torch.randn(B, inp, generator=g), torch.randint(0, out, (B,), generator=g)


def test_replay_writes_large_results_into_huge_pages_bit_identically(counted):
    args = data()  # the per-sample gradient: [32, 96, 200] floats, 2.4 MB
    eager = per_sample_grads(ft)(*args)
    jitted = ft.jit(per_sample_grads(ft))
    first, second = jitted(*args), jitted(*args)  # trace, then replay
    assert counted, "no buffer went to huge pages"
    assert torch.equal(second, eager) and second.stride() == eager.stride()
    torch.testing.assert_close(second, per_sample_grads(tf)(*args))
    assert second.data_ptr() != jitted(*args).data_ptr()  # a fresh buffer per call
    assert torch.equal(first, eager)


def test_inductor_writes_large_outputs_into_callers_buffers(counted):
    def f(w, x, y):
        g = per_sample_grads(ft)(w, x, y)
        # several outputs: a large one through a view, the same large one again, small ones
        return {"t": g.transpose(1, 2), "g": g, "norm": g.norm(), "x": x * 2}

    args = data()
    eager = f(*args)
    jitted = ft.jit(f, backend="inductor")
    jitted(*args)
    counted.clear()
    out = jitted(*args)
    assert counted == [(32, 96, 200)]
    for k in eager:  # inductor sums the 600k squares of the norm in its own order
        torch.testing.assert_close(out[k], eager[k], rtol=1e-4, atol=1e-6)
        assert out[k].shape == eager[k].shape and out[k].stride() == eager[k].stride(), k
    assert out["t"].data_ptr() == out["g"].data_ptr()  # one buffer, two views of it
    again = jitted(*args)
    assert again["g"].data_ptr() != out["g"].data_ptr()
    torch.testing.assert_close(out["g"], again["g"])


def test_replay_keeps_autograd_when_an_argument_requires_grad(counted):
    w, x, _ = data()

    def f(w, x):
        return (x[:, :, None] * w.T[None]).tanh()  # [32, 200, 96]: large

    jitted = ft.jit(f)
    wg = w.clone().requires_grad_()
    jitted(wg, x)
    counted.clear()
    out = jitted(wg, x)
    assert not counted  # autograd records the op: the functional overload ran
    (gw,) = torch.autograd.grad(out.sum(), wg)
    ref = w.clone().requires_grad_()
    (gref,) = torch.autograd.grad(f(ref, x).sum(), ref)
    torch.testing.assert_close(gw, gref)
    with torch.no_grad():
        jitted(wg, x)  # a new signature: traced
        assert torch.equal(jitted(wg, x), f(w, x))
    assert counted  # the no-grad signature writes into huge pages


def test_nothing_changes_where_huge_pages_cannot_be_advised(monkeypatch):
    monkeypatch.setattr(hp, "LARGE_BYTES", 1 << 20)
    monkeypatch.setattr(hp, "_madvise", False)  # not Linux, or THP "never"/"always"
    called = []
    monkeypatch.setattr(hp, "empty_huge", lambda *a: called.append(a))
    args = data()
    jitted = ft.jit(per_sample_grads(ft))
    jitted(*args)
    assert torch.equal(jitted(*args), per_sample_grads(ft)(*args))
    assert not called


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
    assert hp._out_overload(op) is expected


def test_advised_buffers_are_eligible_for_huge_pages():
    if not hp.enabled():
        pytest.skip("no transparent huge pages in madvise mode on this machine")
    t = hp.empty_huge((16 << 20,), (1,), torch.float32)  # 64 MB
    ptr = t.data_ptr() + (8 << 20)
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        lo, _, hi = line.partition(" ")[0].partition("-")
        if hi and all(c in "0123456789abcdef" for c in lo + hi):
            if int(lo, 16) <= ptr < int(hi, 16):
                fields = dict(
                    ln.split(":", 1)
                    for ln in lines[i + 1 : i + 40]
                    if ":" in ln and " " not in ln.split(":")[0]
                )
                assert fields["THPeligible"].strip() == "1"
                return
    pytest.fail("the buffer's mapping is not in /proc/self/smaps")
