"""Our transforms where they meet torch's own autograd and nn.Module machinery
(docs/design/interop.md, "torch's autograd on both sides, autograd.Function and nn.Module
machinery"). Every test runs
torch.func (or plain autograd) beside us and fails if the bug it names came back."""

import pytest
import torch
import torch.func as tf

import functransforms as ft

D = torch.float64
_g = torch.Generator().manual_seed(0)
X = torch.randn(5, 3, dtype=D, generator=_g)
Y = torch.randn(3, dtype=D, generator=_g)


def assert_same(ours, ref, check_requires_grad=True):
    la, lb = torch.utils._pytree.tree_leaves(ours), torch.utils._pytree.tree_leaves(ref)
    assert len(la) == len(lb)
    for a, b in zip(la, lb):
        if isinstance(b, torch.Tensor):
            torch.testing.assert_close(a.detach(), b.detach())
            if check_requires_grad:
                assert a.requires_grad == b.requires_grad
        else:
            assert a == b


# --- autograd.Function: what setup_context saved, and for which inputs -----------------------


class MulSavedTwice(torch.autograd.Function):
    """``backward`` needs both inputs, ``jvp`` only ``y``: two different saved lists."""

    @staticmethod
    def forward(x, y):
        return x * y

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, y = inputs
        ctx.save_for_backward(x, y)
        ctx.save_for_forward(y)

    @staticmethod
    def backward(ctx, g):
        x, y = ctx.saved_tensors
        return g * y, g * x

    @staticmethod
    def jvp(ctx, tx, ty):
        (y,) = ctx.saved_tensors
        return tx * y

    generate_vmap_rule = True


@pytest.mark.parametrize(
    "call",
    [
        lambda L: L.grad(lambda a: MulSavedTwice.apply(a, Y).sum())(X[0]),
        lambda L: L.vmap(L.grad(lambda a: MulSavedTwice.apply(a, Y).sum()))(X),
        lambda L: L.jacrev(lambda a: MulSavedTwice.apply(a, Y))(X[0]),
        lambda L: L.jvp(lambda a: MulSavedTwice.apply(a, Y), (X[0],), (X[1],)),
        lambda L: L.jacfwd(lambda a: MulSavedTwice.apply(a, Y))(X[0]),
    ],
    ids=["grad", "vmap(grad)", "jacrev", "jvp", "jacfwd"],
)
def test_save_for_forward_does_not_replace_save_for_backward(call):
    # ctx kept one list: backward unpacked jvp's one tensor ("not enough values to unpack")
    assert_same(call(ft), call(tf))


class NeedsInputGrad(torch.autograd.Function):
    @staticmethod
    def forward(z, w):
        return z * w

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g):
        z, w = ctx.saved_tensors
        return (
            g * w.conj() if ctx.needs_input_grad[0] else None,
            g * z.conj() if ctx.needs_input_grad[1] else None,
        )

    generate_vmap_rule = True


def test_needs_input_grad_of_complex_inputs():
    # complex inputs read as needs_input_grad=False: backward returned None, a zero gradient
    z = torch.randn(4, dtype=torch.complex128, generator=_g)
    w = torch.randn(4, dtype=torch.complex128, generator=_g)
    f = lambda z: NeedsInputGrad.apply(z, w).abs().sum()  # noqa: E731
    g = ft.grad(f)(z)
    assert g.abs().min() > 0
    assert_same(g, tf.grad(f)(z))
    h = lambda w: NeedsInputGrad.apply(z, w).abs().sum()  # noqa: E731
    assert_same(
        ft.vmap(ft.grad(h))(torch.stack([w, 2 * w])), tf.vmap(tf.grad(h))(torch.stack([w, 2 * w]))
    )


# --- tensor hooks on values a grad level tracks ---------------------------------------------


def hooked(where):
    def f(x):
        y = x.sin()
        z = y * y
        if where == "intermediate":
            y.register_hook(lambda g: g * 10)
        elif where == "input":
            x.register_hook(lambda g: g + 1)
        elif where == "removed":
            handle = y.register_hook(lambda g: g * 10)
            y.register_hook(lambda g: g - 1)
            handle.remove()
        elif where == "output":
            z.register_hook(lambda g: g * 3)
        elif where == "observer":  # returns None: the cotangent is kept
            y.register_hook(lambda g: None)
        return (z + y).sum()

    return f


@pytest.mark.parametrize("where", ["intermediate", "input", "removed", "output", "observer"])
@pytest.mark.parametrize(
    "call",
    [
        lambda L, f: L.grad(f)(X[0]),
        lambda L, f: L.vmap(L.grad(f))(X),
        lambda L, f: L.jacrev(f)(X[0]),
        lambda L, f: L.hessian(f)(X[0]),
        lambda L, f: L.grad(lambda a: L.grad(f)(a).sum())(X[0]),
    ],
    ids=["grad", "vmap(grad)", "jacrev", "hessian", "grad(grad)"],
)
def test_register_hook_inside_grad(where, call):
    # register_hook reached for torch's C++ grad_fn: AttributeError '_register_hook_dict'
    assert_same(call(ft, hooked(where)), call(tf, hooked(where)))


# --- torch.utils.checkpoint inside and around our transforms --------------------------------

W = torch.randn(3, 3, dtype=D, generator=_g)


def block(x, w):
    return (x @ w).tanh().sin()


@pytest.mark.parametrize(
    "call",
    [
        lambda L, f: L.grad(lambda x: f(x, W).sum())(X[0]),
        lambda L, f: L.vmap(L.grad(lambda x: f(x, W).sum()))(X),
        lambda L, f: L.hessian(lambda x: f(x, W).sum())(X[0]),
        lambda L, f: L.jvp(lambda x: f(x, W), (X[0],), (X[1],)),
        lambda L, f: L.vmap(lambda x: f(x, W))(X),
    ],
    ids=["grad", "vmap(grad)", "hessian", "jvp", "vmap"],
)
def test_torch_checkpoint_inside_is_the_function(call):
    # torch.func's grad raises for saved-tensor hooks; ours computes the function's derivative
    ckpt = lambda x, w: torch.utils.checkpoint.checkpoint(block, x, w, use_reentrant=False)  # noqa: E731
    assert_same(call(ft, ckpt), call(tf, block))


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_torch_checkpoint_around_our_transforms(reentrant, transform):
    def run(L, checkpointed):
        w = W.clone().requires_grad_()
        if transform == "grad":
            fn = lambda w: L.grad(lambda x: block(x, w).sum())(X)  # noqa: E731
        else:
            fn = lambda w: L.vmap(lambda x: block(x, w))(X)  # noqa: E731
        out = (
            torch.utils.checkpoint.checkpoint(fn, w, use_reentrant=reentrant)
            if checkpointed
            else fn(w)
        )
        out.pow(2).sum().backward()
        return out, w.grad

    assert_same(run(ft, True), run(tf, False))


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_torch_checkpoint_inside_then_torch_backward_names_the_cause(transform):
    # torch.func raises too; ours said a value "leaked out" of the function
    from functransforms.errors import EscapedTracerError

    w = W.clone().requires_grad_()
    ckpt = lambda x: torch.utils.checkpoint.checkpoint(block, x, w, use_reentrant=False).sum()  # noqa: E731
    out = ft.grad(ckpt)(X) if transform == "grad" else ft.vmap(ckpt)(X)
    with pytest.raises(EscapedTracerError, match="torch.utils.checkpoint"):
        out.sum().backward()
    # functransforms.checkpoint works there
    w.grad = None
    ours = ft.grad(lambda x: ft.checkpoint(block)(x, w).sum())(X)
    ours.sum().backward()
    w2 = W.clone().requires_grad_()
    tf.grad(lambda x: block(x, w2).sum())(X).sum().backward()
    torch.testing.assert_close(w.grad, w2.grad)


# --- autograd.Function: defaults, non-tensor tangents, missing jvp, mark_dirty ---------------


class ScaleBy(torch.autograd.Function):
    """a Python-number argument and a defaulted flag: torch binds the default, and jvp gets
    None as the tangent of each non-tensor input"""

    @staticmethod
    def forward(x, k, y, flag=True):
        return x * k * y if flag else x

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.k = inputs[1]
        ctx.save_for_backward(inputs[2])
        ctx.save_for_forward(inputs[2])

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * ctx.k * y, None, None, None

    @staticmethod
    def jvp(ctx, tx, tk, ty, tflag):
        assert tk is None and tflag is None and ty is not None
        (y,) = ctx.saved_tensors
        return tx * ctx.k * y

    generate_vmap_rule = True


@pytest.mark.parametrize(
    "call",
    [
        lambda L: L.jvp(lambda x: ScaleBy.apply(x, 3.0, Y), (X,), (X,)),
        lambda L: L.jacfwd(lambda x: ScaleBy.apply(x, 3.0, Y))(X[0]),
        lambda L: L.grad(lambda x: ScaleBy.apply(x, 3.0, Y).sum())(X[0]),
        lambda L: L.vmap(L.grad(lambda x: ScaleBy.apply(x, 3.0, Y).sum()))(X),
    ],
    ids=["jvp", "jacfwd", "grad", "vmap(grad)"],
)
def test_function_defaults_and_non_tensor_tangents(call):
    # ours passed jvp one tangent too few (defaults unbound) and 3.0 as the tangent of 3.0
    assert_same(call(ft), call(tf))


class SinNoJvp(torch.autograd.Function):
    @staticmethod
    def forward(x):
        return x.sin()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, g):
        return g * ctx.saved_tensors[0].cos()

    generate_vmap_rule = True


@pytest.mark.parametrize(
    "call",
    [
        lambda L: L.jvp(SinNoJvp.apply, (X,), (X,)),
        lambda L: L.jacfwd(SinNoJvp.apply)(X[0]),
        lambda L: L.hessian(lambda x: SinNoJvp.apply(x).sum())(X[0]),
    ],
    ids=["jvp", "jacfwd", "hessian"],
)
def test_forward_mode_of_function_without_jvp_raises_torch_funcs_class(call):
    with pytest.raises(NotImplementedError):
        call(tf)
    with pytest.raises(NotImplementedError, match="no jvp staticmethod"):  # was TypeError
        call(ft)


class DoubleInPlace(torch.autograd.Function):
    @staticmethod
    def forward(x):
        return x.mul_(2)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_dirty(inputs[0])

    @staticmethod
    def backward(ctx, g):
        return 2 * g

    @staticmethod
    def jvp(ctx, t):
        return t.mul_(2)

    generate_vmap_rule = True


def uses_dirty_input(x):
    y = x.clone()
    z = DoubleInPlace.apply(y)
    assert z is y  # torch returns the input itself
    return torch.stack([y, z, y * z])


def eager_grad(f, x):
    x = x.clone().requires_grad_()
    f(x).backward()
    return x.grad


def test_mark_dirty_rebases_the_input_under_grad():
    # the input kept its history from before the write: 6x instead of 8x, silently
    f = lambda x: uses_dirty_input(x)[2].sum()  # noqa: E731  (2x)^2 -> 8x
    g = ft.grad(f)(X[0])
    torch.testing.assert_close(g, eager_grad(f, X[0]))
    torch.testing.assert_close(g, 8 * X[0])


@pytest.mark.parametrize("transform", ["jacrev", "jacfwd", "hessian"])
def test_mark_dirty_against_torch_func(transform):
    f = uses_dirty_input if transform != "hessian" else lambda x: uses_dirty_input(x)[2].sum()
    assert_same(getattr(ft, transform)(f)(X[0]), getattr(tf, transform)(f)(X[0]))


def test_mark_dirty_under_vmap_against_the_loop():
    # torch.func's generated vmap rule raises ("marked as dirty ... not returned as output")
    f = lambda x: uses_dirty_input(x)[2].sum()  # noqa: E731
    loop = torch.stack([ft.grad(f)(x) for x in X])
    torch.testing.assert_close(ft.vmap(ft.grad(f))(X), loop)
    torch.testing.assert_close(
        ft.vmap(ft.jacrev(uses_dirty_input))(X),
        torch.stack([tf.jacrev(uses_dirty_input)(x) for x in X]),
    )
    xs = X.clone()
    out = ft.vmap(DoubleInPlace.apply)(xs)
    assert out is xs and torch.equal(xs, 2 * X)


# --- torch.autograd.grad inside our transforms: torch's saved outputs stay tracked ------------


def inner_torch_grad(op):
    def g(x):
        w = Y.clone().requires_grad_()  # a leaf of torch's, made inside (differences.md 24)
        y = op(x * w)
        (gw,) = torch.autograd.grad(y.sum(), w, create_graph=True)
        return (gw * w).sum()

    return g


def eager_grad_of(g, x):
    x = x.clone().requires_grad_()
    (h,) = torch.autograd.grad(g(x), x)
    return h


@pytest.mark.parametrize(
    "op",
    [
        lambda t: t.logsumexp(0),
        torch.exp,
        torch.tanh,
        torch.sigmoid,
        lambda t: (t * t + 1).sqrt(),
        torch.sin,
    ],
    ids=["logsumexp", "exp", "tanh", "sigmoid", "sqrt", "sin"],
)
def test_torch_autograd_grad_inside_grad(op):
    # torch saved its nodes' outputs through aten.detach, a constant at our levels: the
    # gradient lost the outputs' dependence on x (8% off for logsumexp), silently
    g = inner_torch_grad(op)
    x = X[0].abs() + 0.5
    ref = eager_grad_of(g, x)
    torch.testing.assert_close(ft.grad(g)(x).detach(), ref)
    torch.testing.assert_close(ft.jvp(g, (x,), (X[1],))[1].detach(), ref @ X[1])
    torch.testing.assert_close(ft.jacrev(g)(x).detach(), ref)


def test_user_detach_inside_grad_is_still_a_constant():
    f = lambda x: (x * x.detach()).sum()  # noqa: E731
    assert_same(ft.grad(f)(X[0]), tf.grad(f)(X[0]))
    assert_same(ft.jvp(f, (X[0],), (X[1],)), tf.jvp(f, (X[0],), (X[1],)))


# --- torch's forward AD (dual tensors) meeting our transforms ----------------------------------


@pytest.mark.parametrize(
    "call",
    [
        lambda g, w: ft.grad(g)(X[0]),
        lambda g, w: ft.vmap(ft.grad(g))(X),
        lambda g, w: ft.jacrev(g)(X[0]),
        lambda g, w: ft.jvp(g, (X[0],), (X[1],)),
        lambda g, w: ft.vmap(lambda x: torch.outer(x, w).logsumexp(0))(X),
    ],
    ids=["grad", "vmap(grad)", "jacrev", "jvp", "vmap-rule"],
)
def test_torch_forward_ad_tangent_inside_our_transforms_raises(call):
    # the tangent was dropped (vmap's rules) or halved (x @ w.diag() under grad), silently
    import torch.autograd.forward_ad as fwAD

    from functransforms.errors import TransformError

    with fwAD.dual_level():
        w = fwAD.make_dual(Y, torch.ones(3, dtype=D))
        g = lambda x: (x @ w.diag()).pow(2).sum()  # noqa: E731
        with pytest.raises(TransformError, match="forward AD"):
            call(g, w)


def test_torch_forward_ad_through_vmaps_fast_paths_still_works():
    import torch.autograd.forward_ad as fwAD

    def run(L):
        with fwAD.dual_level():
            w = fwAD.make_dual(Y, torch.ones(3, dtype=D))
            out = L.vmap(lambda x: (x * w).sin() + w)(X)
            p, t = fwAD.unpack_dual(out)
            return p, t

    ours, ref = run(ft), run(tf)
    assert ours[1] is not None
    assert_same(ours, ref, check_requires_grad=False)


# --- hooks on values inside jvp -------------------------------------------------------------


def test_register_hook_inside_jvp_raises_as_in_torch_func():
    # with a captured tensor that requires grad, ours accepted the hook and never ran it
    def probe(L):
        w = Y.clone().requires_grad_()

        def f(x):
            z = x * w
            with pytest.raises(RuntimeError, match="register_hook|doesn't require gradient"):
                z.register_hook(lambda g: g * 2)
            return z.logsumexp(0)

        out, t = L.jvp(f, (X[0],), (X[1],))
        (gw,) = torch.autograd.grad(out + t, w)
        return out, t, gw

    assert_same(probe(ft), probe(tf))


# --- set_materialize_grads(False): None for outputs without a cotangent -----------------------


def two_outputs(materialize, log):
    class TwoOut(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return x * 2, x * 3

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.set_materialize_grads(materialize)

        @staticmethod
        def backward(ctx, g1, g2):
            log.append((g1 is None, g2 is None))
            return sum(k * g for k, g in ((2, g1), (3, g2)) if g is not None)

        generate_vmap_rule = True

    return TwoOut


@pytest.mark.parametrize("materialize", [True, False])
@pytest.mark.parametrize(
    "call",
    [
        lambda L, F: L.grad(lambda x: F.apply(x)[0].sum())(X[0]),
        lambda L, F: L.vmap(L.grad(lambda x: F.apply(x)[0].sum()))(X),
        lambda L, F: L.jacrev(lambda x: F.apply(x)[0])(X[0]),
        # the vmap inside: its batched Function keeps the flag (zeros were passed before)
        lambda L, F: L.grad(lambda x: L.vmap(F.apply)(x)[0].sum())(X),
        lambda L, F: L.vjp(lambda x: L.vmap(F.apply)(x)[1], X)[1](torch.ones_like(X)),
        lambda L, F: L.jacrev(lambda x: L.vmap(F.apply)(x)[0])(X),
        lambda L, F: L.grad(lambda x: L.vmap(L.vmap(F.apply))(x)[0].sum())(X[None]),
    ],
    ids=["grad", "vmap(grad)", "jacrev", "grad(vmap)", "vjp(vmap)", "jacrev(vmap)", "grad(vmap2)"],
)
def test_set_materialize_grads_false(materialize, call):
    ours_log, ref_log = [], []
    assert_same(
        call(ft, two_outputs(materialize, ours_log)), call(tf, two_outputs(materialize, ref_log))
    )
    assert ours_log == ref_log  # zeros were passed where torch passes None


# --- nn.MultiheadAttention's fused kernel under jvp ---------------------------------------------

_B, _L, _E, _H = 2, 5, 8, 2
_KPM = torch.tensor([[False] * 3 + [True] * 2, [False] * 4 + [True]])
_CAUSAL = torch.ones(_L, _L, dtype=torch.bool).triu(1)


@pytest.mark.parametrize(
    "mask, mask_type",
    [
        (None, None),
        (_KPM, 1),
        (_CAUSAL, 0),
        ((_CAUSAL.view(1, 1, _L, _L) | _KPM.view(_B, 1, 1, _L)).expand(_B, _H, _L, _L), 2),
        (torch.zeros(_B, _L, dtype=D).masked_fill(_KPM, float("-inf")), 1),
    ],
    ids=["none", "key-padding", "causal", "merged", "float-key-padding"],
)
@pytest.mark.parametrize("need_weights, average", [(True, True), (True, False), (False, True)])
def test_native_multi_head_attention_decomposition_is_the_kernel(
    mask, mask_type, need_weights, average
):
    from functransforms.autodiff.nn import _native_multi_head_attention

    g = torch.Generator().manual_seed(5)
    x = torch.randn(_B, _L, _E, dtype=D, generator=g)
    w, b = torch.randn(3 * _E, _E, dtype=D, generator=g), torch.randn(3 * _E, dtype=D, generator=g)
    pw, pb = torch.randn(_E, _E, dtype=D, generator=g), torch.randn(_E, dtype=D, generator=g)
    args = (x, x + 1, 2 * x, _E, _H, w, b, pw, pb, mask, need_weights, average, mask_type)
    kernel = torch.ops.aten._native_multi_head_attention.default(*args)
    ours = _native_multi_head_attention(*args)
    torch.testing.assert_close(ours[0], kernel[0])
    if need_weights:
        torch.testing.assert_close(ours[1], kernel[1])
    else:
        assert ours[1] is None and kernel[1] is None


@pytest.mark.parametrize("transform", ["jvp", "jacfwd"])
def test_jvp_of_frozen_attention_in_eval(transform):
    # eval mode, frozen parameters: the fused kernel had no jvp rule (MissingRuleError; torch.func
    # raises too). Reference: torch.func through the unfused path.
    torch.manual_seed(0)
    m = torch.nn.MultiheadAttention(_E, _H, batch_first=True).double().eval().requires_grad_(False)
    s = torch.randn(_B, _L, _E, dtype=D, generator=torch.Generator().manual_seed(1))

    def f(x, kpm=_KPM):
        return m(x, x, x, key_padding_mask=kpm)[0]

    def run(L):
        if transform == "jvp":
            return L.jvp(f, (s,), (s.flip(0),))
        return L.jacfwd(lambda x: f(x[None], _KPM[:1])[0].sum(0))(s[0])

    ours = run(ft)
    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        ref = run(tf)
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
    assert_same(ours, ref, check_requires_grad=False)


def test_register_hook_inside_linearize_raises_as_in_torch_func():
    # linearize records reverse mode to transpose it: the hook scaled the tangents, silently
    def f(x):
        y = x.sin()
        y.register_hook(lambda g: g * 3)
        return y * y

    for L in (tf, ft):
        with pytest.raises(RuntimeError, match="hook"):
            L.linearize(f, X[0])[1](X[1])


def test_module_backward_hooks_inside_vmap_raise():
    # torch.func runs the module and never calls the hooks (differences.md 29)
    calls = []
    m = torch.nn.Linear(3, 1).double()
    m.register_full_backward_hook(lambda mod, gi, go: calls.append(1))
    with pytest.raises(RuntimeError, match="setup_context"):
        ft.vmap(lambda x: m(x[None]))(X)
    assert calls == []
