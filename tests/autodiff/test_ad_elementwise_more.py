"""Pointwise derivatives written as torch writes them (Note [Rounding as torch]): float32 results
equal torch.func's bitwise; complex and second-order results agree with torch.func; the special
cases (norm at zero, xlogy at x = 0, index_fill, normal, masked.logaddexp, cumsum on 0-d
examples) give the right values."""

import pytest
import torch
import torch.nn.functional as F
from torch import func as tf

import functransforms as ft
from functransforms.testing import check_grads

F64, C128 = torch.float64, torch.complex128


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _x(kind, dtype=torch.float32, n=512, seed=0):
    u = torch.rand(n, generator=_gen(seed), dtype=dtype)
    return {"unit": u * 1.8 - 0.9, "pos": u * 3 + 0.1, "prob": u * 0.9 + 0.05, "wide": u * 8 - 4}[
        kind
    ]


UNARY = {
    "exp2": (torch.exp2, "unit"),
    "log": (torch.log, "pos"),
    "log2": (torch.log2, "pos"),
    "log10": (torch.log10, "pos"),
    "log1p": (torch.log1p, "pos"),
    "tanh": (torch.tanh, "unit"),
    "atan": (torch.atan, "unit"),
    "atanh": (torch.atanh, "unit"),
    "sigmoid": (torch.sigmoid, "unit"),
    "sqrt": (torch.sqrt, "pos"),
    "sinc": (torch.sinc, "unit"),
    "gelu": (F.gelu, "wide"),
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), "wide"),
    "silu": (F.silu, "wide"),
    "softplus": (F.softplus, "wide"),
    "elu": (F.elu, "wide"),
    # alpha exact in float32: torch's celu backward uses 1 / float(alpha) (celu(x, 0.7) rounds)
    "celu": (lambda x: F.celu(x, 0.5), "wide"),
    "logit": (torch.logit, "prob"),
    "logit_eps": (lambda x: torch.logit(x, 0.2), "prob"),
    "hardswish": (F.hardswish, "wide"),
    "hardsigmoid": (F.hardsigmoid, "wide"),
    "div_scalar": (lambda x: x / 1.7, "unit"),
    "exp": (torch.exp, "unit"),
    "rsqrt": (torch.rsqrt, "pos"),
}

BINARY = {
    "div": (torch.div, "unit", "pos"),
    "hypot": (torch.hypot, "unit", "pos"),
    "atan2": (torch.atan2, "unit", "pos"),
    "xlogy": (torch.xlogy, "unit", "pos"),
    "mul": (torch.mul, "unit", "pos"),
}


@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary_float32_bitwise(name):
    f, kind = UNARY[name]
    x = _x(kind)
    ct = torch.randn(x.shape, generator=_gen(1))
    assert torch.equal(ft.vjp(f, x)[1](ct)[0], tf.vjp(f, x)[1](ct)[0])
    assert torch.equal(ft.jvp(f, (x,), (ct,))[1], tf.jvp(f, (x,), (ct,))[1])


@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary_vjp_float32_bitwise(name):
    f, kx, ky = BINARY[name]
    x, y = _x(kx), _x(ky, seed=3)
    ct = torch.randn(x.shape, generator=_gen(1))
    ours = ft.vjp(f, x, y)[1](ct)
    ref = tf.vjp(f, x, y)[1](ct)
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])


def _second(f, x, t, w):
    def loss(lib):
        def scalar_loss(a):
            o = f(a)
            return (w.conj() * o).real.sum() + (o * o.conj()).real.sum() / 2

        return scalar_loss

    a = ft.jvp(ft.grad(loss(ft)), (x,), (t,))[1]
    b = tf.jvp(tf.grad(loss(tf)), (x,), (t,))[1]
    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary_second_order_float64(name):
    f, kind = UNARY[name]
    x = _x(kind, F64, n=16)
    t, w = (torch.randn(16, generator=_gen(s), dtype=F64) for s in (2, 3))
    if name == "hardsigmoid":  # torch has no forward-mode hardsigmoid_backward: ours only
        check_grads(f, (x,), order=2)
        return
    _second(f, x, t, w)


COMPLEX = ["exp2", "log", "log2", "log10", "log1p", "tanh", "atan", "atanh", "sigmoid", "sqrt"]


@pytest.mark.parametrize("name", COMPLEX + ["sinc", "div_scalar"])
def test_unary_complex_first_and_second_order(name):
    f, _ = UNARY[name]
    g = _gen(4)
    x, t, w = (torch.randn(8, generator=g, dtype=C128) * 0.5 for _ in range(3))
    ct = torch.randn(8, generator=g, dtype=C128)
    torch.testing.assert_close(ft.vjp(f, x)[1](ct)[0], tf.vjp(f, x)[1](ct)[0])
    torch.testing.assert_close(ft.jvp(f, (x,), (t,))[1], tf.jvp(f, (x,), (t,))[1])
    _second(f, x, t, w)


@pytest.mark.parametrize("dtype", [F64, C128])
def test_div_second_order(dtype):
    g = _gen(5)
    x, t, w = (torch.randn(6, generator=g, dtype=dtype) for _ in range(3))
    y = torch.randn(6, generator=g, dtype=dtype) + 3
    _second(lambda b: x / b, y, t, w)
    _second(lambda a: a / y, x, t, w)


@pytest.mark.parametrize(
    "kernel",
    [
        lambda g, s: torch.ops.aten.tanh_backward(g, s),
        lambda g, s: torch.ops.aten.sigmoid_backward(g, s),
        lambda g, s: torch.ops.aten.gelu_backward(g, s, approximate="tanh"),
        lambda g, s: torch.ops.aten.softplus_backward(g, s, 2.0, 1.0),
        lambda g, s: torch.ops.aten.elu_backward(g, 1.3, 1.1, 0.9, False, s),
        lambda g, s: torch.ops.aten.hardswish_backward(g, s),
    ],
)
def test_backward_kernels_check_grads(kernel):
    gen = _gen(6)
    g = torch.randn(7, generator=gen, dtype=F64)
    s = torch.randn(7, generator=gen, dtype=F64) * 0.8 + 0.1
    check_grads(kernel, (g, s), order=2)


def test_xlogy_at_zero_x():
    """d/dx x log y = log y, also at x = 0 (we returned 0 there)."""
    x = torch.tensor([0.0, 0.0, 1.0], dtype=F64)
    y = torch.tensor([2.0, -1.0, 3.0], dtype=F64)
    ours = ft.grad(lambda a: torch.xlogy(a, y).sum())(x)
    torch.testing.assert_close(ours, tf.grad(lambda a: torch.xlogy(a, y).sum())(x))
    assert ours[0] == torch.log(torch.tensor(2.0, dtype=F64))


@pytest.mark.parametrize(
    "f",
    [
        torch.linalg.norm,
        torch.linalg.vector_norm,
        lambda x: torch.linalg.vector_norm(x, 3),
        lambda x: torch.linalg.norm(x.reshape(2, 2)),
    ],
)
@pytest.mark.parametrize("dtype", [F64, C128])
def test_norm_hessian_at_zero(f, dtype):
    z = torch.zeros(4, dtype=dtype)
    torch.testing.assert_close(ft.hessian(f)(z.real), tf.hessian(f)(z.real))
    torch.testing.assert_close(ft.grad(f)(z), tf.grad(f)(z))


@pytest.mark.parametrize("in_dims", [(0, 0), (None, 0), (0, None)])
@pytest.mark.parametrize(
    "f, shape",
    [
        (lambda x: x.cumsum(0), (5,)),
        (lambda x: x.cumsum(1), (5, 3, 4)),
        (lambda x: x.gather(0, torch.tensor(0)), (5,)),
        (lambda x: x.gather(1, torch.tensor([[0, 1], [2, 2], [1, 0]])), (5, 3, 4)),
    ],
)
def test_vmap_vjp_cumsum_gather(f, shape, in_dims):
    x = torch.randn(shape, generator=_gen(7), dtype=F64)
    c = torch.randn((5,) + f(x[0]).shape, generator=_gen(8), dtype=F64)
    xa = x if in_dims[0] == 0 else x[0]
    ca = c if in_dims[1] == 0 else c[0]
    ours = ft.vmap(lambda x, c: ft.vjp(f, x)[1](c)[0], in_dims)(xa, ca)
    ref = tf.vmap(lambda x, c: tf.vjp(f, x)[1](c)[0], in_dims)(xa, ca)
    torch.testing.assert_close(ours, ref)


@pytest.mark.parametrize("in_dims", [(0, 0, 0), (None, 0, 0), (0, 0, None), (0, None, 0)])
def test_index_fill_batched_value(in_dims):
    idx = torch.tensor([0, 2])

    def f(x, v):
        return x.index_fill(1, idx, v)

    g = _gen(9)
    args = [
        torch.randn(5, 3, 4, generator=g, dtype=F64),
        torch.randn(5, generator=g, dtype=F64),
        torch.randn(5, 3, 4, generator=g, dtype=F64),
    ]
    args = [a if d == 0 else a[0] for a, d in zip(args, in_dims)]

    def body(lib):
        return lambda x, v, ct: lib.vjp(f, x, v)[1](ct)

    ours = ft.vmap(body(ft), in_dims)(*args)
    ref = tf.vmap(body(tf), in_dims)(*args)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    "mean_shape, std_shape", [((4,), (4,)), ((3, 1), (4,)), ((), (4,)), ((4,), ())]
)
def test_normal_is_reparameterised(mean_shape, std_shape):
    """normal(mean, std) = mean + std * eps: d/d mean = 1, d/d std = eps (torch.func gives 0)."""
    g = _gen(10)
    m = torch.randn(mean_shape, generator=g, dtype=F64)
    s = torch.rand(std_shape, generator=g, dtype=F64) + 0.5
    torch.manual_seed(3)
    out, fn = ft.vjp(torch.normal, m, s)
    torch.manual_seed(3)
    assert torch.equal(out, torch.normal(m, s))
    eps = (out - m) / s
    ct = torch.randn(out.shape, generator=g, dtype=F64)
    gm, gs = fn(ct)
    torch.testing.assert_close(gm, ct.sum_to_size(m.shape))
    torch.testing.assert_close(gs, (ct * eps).sum_to_size(s.shape))
    torch.manual_seed(3)
    tm, ts = (
        torch.randn(m.shape, generator=g, dtype=F64),
        torch.randn(s.shape, generator=g, dtype=F64),
    )
    _, t = ft.jvp(torch.normal, (m, s), (tm, ts))
    torch.testing.assert_close(t, tm + ts * eps)


def test_masked_logaddexp_jvp_is_finite():
    """Where both inputs are masked out the output is a constant -inf: tangent 0, not NaN."""
    g = _gen(11)
    x, y, tx, ty = (torch.randn(3, 4, generator=g, dtype=F64) for _ in range(4))
    m1 = torch.tensor([[1, 0, 1, 0]] * 3, dtype=torch.bool)
    m2 = torch.tensor([[1, 1, 0, 0]] * 3, dtype=torch.bool)

    def f(x, y):
        return torch.masked._ops.logaddexp(x, y, input_mask=m1, other_mask=m2)

    _, t = ft.jvp(f, (x, y), (tx, ty))
    _, ref = tf.jvp(f, (x, y), (tx, ty))
    live = m1 | m2
    assert torch.isfinite(t).all()
    torch.testing.assert_close(t[live], ref[live])
    assert (t[~live] == 0).all()


SPECIAL = {
    "i0": (torch.special.i0, "wide"),
    "i0e": (torch.special.i0e, "wide"),
    "i1": (torch.special.i1, "wide"),
    "i1e": (torch.special.i1e, "wide"),
    "erfcx": (torch.special.erfcx, "wide"),
    "log_ndtr": (torch.special.log_ndtr, "wide"),
    "ndtri": (torch.special.ndtri, "prob"),
    "polygamma0": (lambda x: torch.polygamma(0, x), "pos"),
    "polygamma3": (lambda x: torch.special.polygamma(3, x), "pos"),
    "digamma": (torch.digamma, "pos"),
    "copysign_scalar": (lambda x: torch.copysign(x, -1.0), "unit"),
    "frexp": (lambda x: torch.frexp(x)[0], "wide"),
    "div_floor": (lambda x: torch.div(x, 0.3, rounding_mode="floor"), "wide"),
}


@pytest.mark.parametrize("name", sorted(SPECIAL))
def test_special_functions(name):
    """First order against torch.func (float32 bitwise), second order against finite
    differences (digamma and polygamma are twice differentiable)."""
    f, kind = SPECIAL[name]
    x = _x(kind)
    ct = torch.randn(x.shape, generator=_gen(1))
    assert torch.equal(ft.vjp(f, x)[1](ct)[0], tf.vjp(f, x)[1](ct)[0])
    assert torch.equal(ft.jvp(f, (x,), (ct,))[1], tf.jvp(f, (x,), (ct,))[1])
    x64 = _x(kind, F64, n=12, seed=5)
    check_grads(f, (x64,), order=2)


@pytest.mark.parametrize(
    "f",
    [
        torch.copysign,
        torch.fmax,
        torch.fmin,
        torch.nextafter,
        lambda x, y: torch.div(x, y, rounding_mode="trunc"),
        lambda x, y: torch.div(x, y, rounding_mode=None),
    ],
)
def test_binary_special(f):
    g = _gen(12)
    x = torch.randn(4, 5, generator=g, dtype=F64)
    y = torch.randn(5, generator=g, dtype=F64)
    y[3] = float("nan")  # fmax/fmin ignore NaN operands
    tied = x.clone()
    tied[0, :2] = y[:2]  # ties: torch's own routing per version (2.13: vjp x, fmax jvp y)
    for args in ((x, y), (x, y[:1].clone()), (tied, y)):
        ct = torch.randn(x.shape, generator=g, dtype=F64)
        for a, b in zip(ft.vjp(f, *args)[1](ct), tf.vjp(f, *args)[1](ct)):
            torch.testing.assert_close(a, b, equal_nan=True)
        t = tuple(torch.randn(a.shape, generator=g, dtype=F64) for a in args)
        torch.testing.assert_close(ft.jvp(f, args, t)[1], tf.jvp(f, args, t)[1], equal_nan=True)


_BESSEL = [
    "bessel_j0",
    "bessel_j1",
    "bessel_y0",
    "bessel_y1",
    "modified_bessel_i0",
    "modified_bessel_i1",
    "modified_bessel_k0",
    "modified_bessel_k1",
]


@pytest.mark.parametrize("name", _BESSEL)
def test_bessel_derivatives(name):
    """torch 2.15 differentiates torch.special's Bessel functions: float32 bitwise as torch.func
    there; on every torch, central differences (step 1e-3: torch's float64 Bessel kernels are
    accurate to ~1e-8 only, so a smaller step measures their noise)."""
    from functransforms._compat import TORCH_VERSION

    f = getattr(torch.special, name)
    x = torch.linspace(0.1, 5, 20)
    ct = torch.randn(x.shape, generator=_gen(2))
    if TORCH_VERSION >= (2, 15):
        assert torch.equal(ft.vjp(f, x)[1](ct)[0], tf.vjp(f, x)[1](ct)[0])
        assert torch.equal(ft.jvp(f, (x,), (ct,))[1], tf.jvp(f, (x,), (ct,))[1])
    x64, h = x.to(F64), 1e-3
    fd = (f(x64 + h) - f(x64 - h)) / (2 * h)
    torch.testing.assert_close(ft.vmap(ft.grad(f))(x64), fd, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("training", [False, True])
def test_rrelu_matches_torch_func(training):
    """rrelu_with_noise: the slope is the drawn noise in training, (lower + upper) / 2 in eval;
    the same seed gives torch.func's values and derivatives."""
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    t = torch.randn(5, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def f(x):
        return F.rrelu(x, 0.1, 0.4, training=training)

    def loss(x):
        return (f(x) * t).sum()

    for ours, ref in ((ft.grad(loss), tf.grad(loss)), (lambda x: ft.jvp(f, (x,), (t,)), None)):
        torch.manual_seed(2)
        got = ours(x)
        torch.manual_seed(2)
        want = ref(x) if ref is not None else tf.jvp(f, (x,), (t,))
        torch.testing.assert_close(got, want)
