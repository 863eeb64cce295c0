"""Realistic programs run with functransforms and with torch.func (or plain autograd where
torch.func raises or is wrong), compared leaf by leaf: values, dtypes, shapes and requires_grad.

Each program is ``prog(lib)`` with ``lib`` either module, so both libraries run the same code.
Programs that found bugs are marked in their names' comments; the others guard behaviour that
agrees today.
"""

import copy

import pytest
import torch
import torch.func as tf
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten

import functransforms as ft

D = torch.float64


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def rnd(*shape, dtype=D, seed=0):
    return torch.randn(shape, generator=_gen(seed), dtype=dtype)


def assert_same(ours, ref, rtol=1e-6, atol=1e-8):
    lo, so = tree_flatten(ours)
    lr, sr = tree_flatten(ref)
    assert so == sr
    for a, b in zip(lo, lr):
        if not isinstance(b, torch.Tensor):
            assert a == b
            continue
        assert isinstance(a, torch.Tensor)
        assert (a.dtype, a.shape, a.requires_grad) == (b.dtype, b.shape, b.requires_grad)
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, equal_nan=True)


def run_both(prog, **tol):
    torch.manual_seed(0)
    ref = prog(tf)
    torch.manual_seed(0)
    ours = prog(ft)
    assert_same(ours, ref, **tol)


# -- models with buffers ------------------------------------------------------------------------
def _bn_model():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 2)).double()


X, Y = rnd(8, 4, seed=1), rnd(8, 2, seed=2)


def _params_bufs(model):
    params = {k: v.detach() for k, v in model.named_parameters()}
    return params, {k: v.clone() for k, v in model.named_buffers()}


def bn_eval_hessian(m):
    model = _bn_model().eval()
    with torch.no_grad():
        model[1].running_mean.copy_(rnd(6, seed=3))
        model[1].running_var.copy_(rnd(6, seed=4).abs() + 0.5)
    params, bufs = _params_bufs(model)
    loss = lambda p: F.mse_loss(m.functional_call(model, (p, bufs), (X,)), Y)  # noqa: E731
    return m.hessian(loss)(params), bufs


def ensemble_bn_train_stacked_buffers(m):
    models = [_bn_model() for _ in range(3)]
    for i, mm in enumerate(models):
        with torch.no_grad():
            mm[1].running_mean.fill_(i)
    params, bufs = m.stack_module_state(models)
    base = copy.deepcopy(models[0]).to("meta")
    f = lambda p, b, x: m.functional_call(base, (p, b), (x,))  # noqa: E731
    return m.vmap(f, in_dims=(0, 0, None))(params, bufs, X), bufs


def ensemble_bn_eval_grad(m):
    models = [_bn_model().eval() for _ in range(3)]
    for i, mm in enumerate(models):
        with torch.no_grad():
            mm[1].running_mean.fill_(i)
            mm[1].running_var.fill_(i + 1)
    params, bufs = m.stack_module_state(models)
    base = copy.deepcopy(models[0]).to("meta")

    def loss(p, b, x, y):
        return F.mse_loss(m.functional_call(base, (p, b), (x,)), y)

    return m.vmap(m.grad(loss), in_dims=(0, 0, None, None))(params, bufs, X, Y)


def per_sample_grads_bn_eval(m):
    model = _bn_model().eval()
    params, bufs = _params_bufs(model)

    def loss(p, x, y):
        return F.mse_loss(m.functional_call(model, (p, bufs), (x[None],)), y[None])

    return m.vmap(m.grad(loss), in_dims=(None, 0, 0))(params, X, Y)


# -- transform API details --------------------------------------------------------------------
def linearize_twice(m):
    out, jf = m.linearize(lambda a: (a.sin() * a.cumsum(0)).exp(), rnd(5))
    return out, jf(torch.ones(5, dtype=D)), jf(torch.arange(5.0, dtype=D))


def vjp_has_aux_pytree(m):
    f = lambda a, b: ((a @ b).tanh(), {"n": a.norm(), "s": [b.sum()]})  # noqa: E731
    out, fn, aux = m.vjp(f, rnd(3, 4), rnd(4, 2, seed=1), has_aux=True)
    return out, fn(torch.ones(3, 2, dtype=D)), aux


def jac_argnums_has_aux(m):
    f = lambda a, b: ((a[:, None] * b).sum(0), (a.sum(), b.max()))  # noqa: E731
    a, b = rnd(3), rnd(3, 2, seed=1)
    return m.jacrev(f, argnums=(0, 1), has_aux=True)(a, b), m.jacfwd(
        f, argnums=(0, 1), has_aux=True
    )(a, b)


def jacrev_chunked(m):
    f = lambda a: (a.outer(a).softmax(-1), a.sum())  # noqa: E731
    return m.jacrev(f, chunk_size=2)(rnd(5)), m.jacrev(f, chunk_size=1)(rnd(5))


def vmap_pytree_in_out_dims(m):
    def f(d, s):
        return {"o": d["a"] * s + d["b"], "t": (d["a"].sum(), d["c"])}

    d = {"a": rnd(4, 3), "b": rnd(3, seed=1), "c": rnd(2, 4, seed=2)}
    dims = ({"a": 0, "b": None, "c": 1}, None)
    return m.vmap(f, in_dims=dims, out_dims={"o": 1, "t": (0, 0)})(d, 2.0)


def dropout_module_randomness(m):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(3, 5), nn.Dropout(0.5), nn.Linear(5, 1))
    params = dict(model.named_parameters())
    xs = torch.randn(4, 3)
    f = lambda x: m.functional_call(model, params, (x,))  # noqa: E731
    outs = []
    for r in ("different", "same"):
        torch.manual_seed(0)
        outs.append(m.vmap(f, randomness=r)(xs))
    torch.manual_seed(0)
    g = m.grad(lambda p, x: m.functional_call(model, p, (x,)).sum())
    outs.append(m.vmap(g, in_dims=(None, 0), randomness="different")(params, xs))
    return outs


# -- low precision and complex ------------------------------------------------------------------
def _lowp(dt):
    x, w = rnd(4, 3).to(dt), rnd(3, 2, seed=1).to(dt)

    def prog(m):
        gelu_grads = m.vmap(m.grad(lambda w, x: F.gelu(x @ w).sum()), (None, 0))(w, x)
        jvp = m.jvp(lambda w: (x @ w).softmax(-1), (w,), (torch.ones_like(w),))
        return gelu_grads, m.grad(lambda w: (x @ w).relu().sum())(w), jvp

    return prog


Z, WC = rnd(3, dtype=torch.complex128), rnd(3, 3, dtype=torch.complex128, seed=1)


def complex_real_losses(m):
    return (
        m.grad(lambda W: (W @ Z).abs().sum())(WC),
        m.grad(lambda z: torch.vdot(z, WC @ z).real)(Z),
        m.grad(lambda z: torch.view_as_real(z * z).pow(2).sum())(Z),
        m.grad(lambda z: torch.fft.fft(z).abs().pow(2).sum())(Z),
        m.grad(lambda W: torch.linalg.slogdet(W)[1])(WC),
        m.grad(lambda W: torch.linalg.solve(W, Z).abs().sum())(WC),
        m.vmap(m.grad(lambda z, w: (w * z).abs().sum()), (None, 0))(Z, WC),
        m.jvp(lambda z: (z * z.conj()).exp() * z, (Z,), (Z.flip(0),)),
    )


PROGRAMS = {
    "bn_eval_hessian": bn_eval_hessian,
    "ensemble_bn_train_stacked_buffers": ensemble_bn_train_stacked_buffers,
    "ensemble_bn_eval_grad": ensemble_bn_eval_grad,
    "per_sample_grads_bn_eval": per_sample_grads_bn_eval,
    "linearize_twice": linearize_twice,
    "vjp_has_aux_pytree": vjp_has_aux_pytree,
    "jac_argnums_has_aux": jac_argnums_has_aux,
    "jacrev_chunked": jacrev_chunked,
    "vmap_pytree_in_out_dims": vmap_pytree_in_out_dims,
    "dropout_module_randomness": dropout_module_randomness,
    # vmap(grad(gelu)) crashed the process (oneDNN's gelu_backward got an unbatched stride-0
    # gradient of shape [3] beside the batched [B, 3] input)
    "vmap_grad_gelu_float32": _lowp(torch.float32),
    "vmap_grad_gelu_bfloat16": _lowp(torch.bfloat16),
    "vmap_grad_gelu_float16": _lowp(torch.float16),
    "complex_real_losses": complex_real_losses,
}
_TOL = {"vmap_grad_gelu_bfloat16": 2e-2, "vmap_grad_gelu_float16": 1e-2}


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_program_matches_torch_func(name):
    t = _TOL.get(name)
    run_both(PROGRAMS[name], **({} if t is None else {"rtol": t, "atol": t}))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_vmap_grad_gelu_float32_unbatched_gradient(approximate):
    x = rnd(4, 3, dtype=torch.float32)
    f = lambda a: F.gelu(a, approximate=approximate).sum()  # noqa: E731
    assert torch.equal(ft.vmap(ft.grad(f))(x), tf.vmap(tf.grad(f))(x))


def test_vmap_grad_masked_scatter_source_with_batched_mask():
    # raised DataDependentError: the source's vjp used masked_select (a size per example)
    a, src = rnd(3, 4), rnd(3, 5, seed=1)
    mask = torch.rand(3, 4, generator=_gen(2)) > 0.5
    loss = lambda a, m, s: a.masked_scatter(m, s).pow(2).sum()  # noqa: E731
    for argnums in (0, 2, (0, 2)):
        ours = ft.vmap(ft.grad(loss, argnums=argnums))(a, mask, src)
        assert_same(ours, tf.vmap(tf.grad(loss, argnums=argnums))(a, mask, src))
    cube = lambda s, m: a[0].masked_scatter(m, s).pow(3).sum()  # noqa: E731
    hess = torch.autograd.functional.hessian
    loop = [hess(lambda s, m=m: cube(s, m), s) for s, m in zip(src, mask)]
    torch.testing.assert_close(ft.vmap(ft.hessian(cube))(src, mask), torch.stack(loop))


_INPLACE_POW = {
    # raised "aten::pow() Expected a value of type 'number'": pow_.Scalar(Tensor, Scalar) was
    # run as pow.Scalar(Scalar, Tensor), the functional overload of the same name
    "pow_scalar": lambda b, e: b[0].pow_(2),
    "ipow": lambda b, e: b.__ipow__(3),
    "float_power_scalar": lambda b, e: b[0].float_power_(2.5),
    # raised a missing rule: pow_.Tensor's functional form is pow.Tensor_Tensor
    "pow_tensor": lambda b, e: b[1].pow_(e),
    "float_power_tensor": lambda b, e: b[0].float_power_(e),
    "ldexp": lambda b, e: b.ldexp_(torch.tensor([1, 2, 0, 1])),
}


@pytest.mark.parametrize("name", list(_INPLACE_POW))
def test_inplace_overloads_with_renamed_functional_form(name):
    x, e = rnd(3, 4).abs() + 0.5, rnd(4, seed=1).abs() + 0.5
    xs = torch.stack([x, 1.1 * x])

    def f(a):
        b = a.clone()
        _INPLACE_POW[name](b, e)
        return (b * b).sum()

    def prog(m):
        return m.grad(f)(x), m.hessian(f)(x), m.vmap(m.grad(f))(xs)

    run_both(prog)


# -- programs where torch.func is wrong: ours against plain autograd / the eager values --------
@pytest.mark.parametrize("p", [1.0, 2.0, 3.0, float("inf")])
def test_jacobian_of_cdist_matches_autograd(p):
    # torch.func's jacrev of cdist is wrong (torch 2.13 and 2.15: vmap over _cdist_backward's
    # cotangent); torch.func.vmap(grad) agrees with the loop
    x, y = rnd(5, 3), rnd(4, 3, seed=1)
    f = lambda x: torch.cdist(x, y, p=p)  # noqa: E731
    ref = torch.autograd.functional.jacobian(f, x)
    torch.testing.assert_close(ft.jacrev(f)(x), ref)
    torch.testing.assert_close(ft.jacfwd(f)(x), ref)  # torch.func: no forward rule


def test_linearize_with_dropout_uses_the_outputs_mask():
    # torch.func's linearize draws a new dropout mask on every jvp_fn call, so its tangents
    # belong to no mask of the output; ours are the derivative of the function that ran
    x = torch.ones(4, 6, dtype=D)
    torch.manual_seed(0)
    out, jvp_fn = ft.linearize(lambda a: F.dropout(a, 0.5), x)
    t = jvp_fn(torch.ones_like(x))
    assert torch.equal(t, out) and torch.equal(jvp_fn(torch.ones_like(x)), t)
    torch.manual_seed(0)
    assert torch.equal(out, F.dropout(x, 0.5))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "loss",
    [
        lambda t: F.softmax(t, -1).pow(2).sum(),
        lambda t: (F.log_softmax(t, -1) * torch.arange(40.0, dtype=t.dtype)).sum(),
        lambda t: F.cross_entropy(t, torch.arange(6)),
    ],
    ids=["softmax", "log_softmax", "cross_entropy"],
)
def test_half_precision_softmax_gradients_match_torch(dtype, loss):
    # the vjp rounded every step in float16/bfloat16 (log_softmax 1 ulp off torch.func's);
    # torch's kernels accumulate in float32 and round once
    # (before: ~45% of the entries differed; now at most a rare float32 -> half rounding tie)
    w = rnd(6, 40, dtype=torch.float32).to(dtype)
    ws = torch.stack([w, w.flip(0)])
    for ours, ref in (
        (ft.grad(loss)(w), tf.grad(loss)(w)),
        (ft.vmap(ft.grad(loss))(ws), tf.vmap(tf.grad(loss))(ws)),
    ):
        assert ours.dtype == ref.dtype and (ours != ref).float().mean() <= 0.01
        torch.testing.assert_close(ours, ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_layer_norm_input_gradient_matches_torch(dtype):
    # 179 of 240 entries of a bfloat16 layer norm's input gradient were 1-3 ulp off torch.func's
    w = rnd(6, 40, dtype=torch.float32).to(dtype)
    scale = torch.linspace(0.5, 1.5, 40, dtype=dtype)
    coef = torch.linspace(-1, 1, 240).view(6, 40)
    loss = lambda t: (F.layer_norm(t, (40,), scale).float() * coef).sum()  # noqa: E731
    ours, ref = ft.grad(loss)(w), tf.grad(loss)(w)
    assert ours.dtype == ref.dtype and (ours != ref).float().mean() <= 0.01
    # torch.func's own vmap rounds differently from its per-example calls; ours equals those
    ws = torch.stack([w, 2 * w])
    loop = torch.stack([tf.grad(loss)(x) for x in ws])
    assert (ft.vmap(ft.grad(loss))(ws) != loop).float().mean() <= 0.01


def test_gamma_rsample_reparameterization_gradients():
    # raised MissingRuleError (no rule for _standard_gamma); torch differentiates the draw in
    # its concentration (implicit reparameterization), as Gamma/Chi2 rsample in VAEs rely on
    dist = torch.distributions
    a = rnd(3, 6).abs() + 1

    def prog(m):
        f = lambda a: dist.Gamma(a, 2.0).rsample().pow(2).sum()  # noqa: E731
        g = lambda r: dist.Gamma(2.0 + 0 * r, r).rsample().sum() + dist.Chi2(r).rsample().sum()  # noqa: E731
        torch.manual_seed(0)
        per_sample = m.vmap(m.grad(f), randomness="different")(a)
        torch.manual_seed(0)
        return per_sample, m.grad(g)(a[0]), m.jacrev(torch._standard_gamma)(a[0])

    run_both(prog)


def test_poisson_draw_has_torchs_zero_derivative():
    # raised MissingRuleError; torch's derivative in the rate is 0
    mu = rnd(3, 4).abs() + 0.5

    def prog(m):
        f = lambda a: (torch.poisson(a) * a).sum()  # noqa: E731
        torch.manual_seed(0)
        g = m.grad(f)(mu)
        per_sample = m.vmap(m.grad(f), randomness="different")(torch.stack([mu, 2 * mu]))
        return g, per_sample, m.jvp(torch.poisson, (mu,), (torch.ones_like(mu),))

    run_both(prog)


@pytest.mark.parametrize(
    "draw",
    [lambda a: torch.normal(a, a), lambda a: torch.normal(0.0, a)],
    ids=["normal_tensor_tensor", "normal_float_tensor"],
)
def test_vmap_normal_with_batched_tensor_parameters_draws_torch_funcs_bits(draw):
    # fell to the per-example loop (no rule): other values than torch.func for the same seed.
    # (Its derivative is reparameterised on purpose: torch_func_differences.md 8.)
    mu = rnd(3, 4).abs() + 0.5

    def prog(m):
        torch.manual_seed(0)
        return m.vmap(draw, randomness="different")(torch.stack([mu, 2 * mu]))

    run_both(prog)


_SHARED = rnd(3, 4).abs() + 0.5
_DRAWS_FROM_SHARED = {
    "rand_like": lambda: torch.rand_like(_SHARED),
    "randn_like": lambda: torch.randn_like(_SHARED),
    "randint_like": lambda: torch.randint_like(_SHARED, 3, 9),
    "bernoulli": lambda: torch.bernoulli(_SHARED.sigmoid()),
    "multinomial": lambda: torch.multinomial(_SHARED, 2),
    "poisson": lambda: torch.poisson(_SHARED),
    "normal": lambda: torch.normal(_SHARED, 1.0),
    "gamma": lambda: torch._standard_gamma(_SHARED),
    "Normal.sample": lambda: torch.distributions.Normal(_SHARED, 1.0).sample(),
    "Categorical.sample": lambda: torch.distributions.Categorical(probs=_SHARED).sample(),
}


@pytest.mark.parametrize("name", list(_DRAWS_FROM_SHARED))
def test_different_randomness_draws_from_an_unbatched_tensor(name):
    # every example got the same values: a draw from plain tensors reached no batching rule
    draw = _DRAWS_FROM_SHARED[name]

    def prog(m):
        torch.manual_seed(0)
        flat = m.vmap(lambda b: draw() * b, randomness="different")(torch.ones(3, dtype=D))
        torch.manual_seed(0)
        nested = m.vmap(m.vmap(lambda b: draw() * b, randomness="different"), randomness="same")(
            torch.ones(2, 3, dtype=D)
        )
        return flat, nested

    run_both(prog)
    torch.manual_seed(0)
    out = ft.vmap(lambda b: draw() * b, randomness="different")(torch.ones(3, dtype=D))
    assert not torch.equal(out[0], out[1])


def test_jvp_integer_tangent_raises_as_torch_func():
    # was cast to the primal's dtype silently (torch.func: ValueError)
    x = rnd(3)
    for lib in (tf, ft):
        with pytest.raises(ValueError):
            lib.jvp(torch.sin, (x,), (torch.ones(3, dtype=torch.long),))


def test_linearize_tangent_keeps_autograd_history_of_captured_weights():
    # torch.func's linearize tangents have no history to w (autograd.grad gives None)
    w = rnd(3, 3).requires_grad_()
    x = rnd(4, 3, seed=1)
    f = lambda a: (a @ w).tanh()  # noqa: E731
    t = ft.linearize(f, x)[1](torch.ones_like(x))
    ref = tf.jvp(f, (x,), (torch.ones_like(x),))[1]
    g, g_ref = (torch.autograd.grad(v.sum(), w)[0] for v in (t, ref))
    torch.testing.assert_close(g, g_ref)


@pytest.mark.parametrize("in_dims", [0, 1, 2])
@pytest.mark.parametrize(
    "drop",
    [
        lambda a: F.dropout(a, 0.5),
        lambda a: torch.dropout(a, 0.5, True),
        lambda a: F.alpha_dropout(a, 0.5, True),
        lambda a: F.dropout2d(a, 0.5),
        lambda a: torch.ops.aten.native_dropout(a, 0.5, True),
    ],
    ids=["F.dropout", "torch.dropout", "alpha_dropout", "dropout2d", "native_dropout"],
)
def test_dropout_masks_match_torch_func_for_any_in_dim(drop, in_dims):
    # in_dims=1/2: the mask was drawn in the input's layout (torch.func draws [B, ...] in
    # row-major order); aten.native_dropout under vmap raised TypeError (its two outputs)
    x = torch.rand(3, 4, 5, generator=_gen(0))

    def prog(m):
        torch.manual_seed(0)
        return m.vmap(drop, in_dims=in_dims, randomness="different")(x)

    run_both(prog)


def test_where_promotion_under_vmap_is_the_per_example_dtype():
    # torch.func promotes by the physical ranks (float32 here); ours as eager per example
    a, b = torch.ones(2, dtype=torch.float16), torch.ones(3, dtype=torch.bfloat16)
    f = lambda a: torch.where(a > 0, a, b)  # noqa: E731
    assert ft.vmap(f)(a).dtype == f(a[0]).dtype == torch.bfloat16
    assert ft.vmap(lambda b: f(a[0] * 0 + b[0]))(b[None].expand(2, 3)).dtype == torch.bfloat16
