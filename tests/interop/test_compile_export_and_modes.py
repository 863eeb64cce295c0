"""Our transforms inside the surroundings of real programs (torch.compile and
torch.export, autocast, meta and fake tensors, empty batches, global modes, generators).

torch.func is the oracle; where it is wrong or refuses, the test says so and compares with a
plain autograd loop or finite differences. Each case the library handles is described in
docs/design/interop.md, "torch.compile, torch.export, autocast, meta tensors and global modes"."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.func as tf

import functransforms as ft

_g = torch.Generator().manual_seed(0)
D = torch.float64


def _rand(*shape, dtype=D):
    return torch.randn(*shape, dtype=dtype, generator=_g)


def _leaves(tree):
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _same(ours, ref, atol=1e-6, rtol=1e-5, values=True):
    a, b = _leaves(ours), _leaves(ref)
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert (x.shape, x.dtype, x.device) == (y.shape, y.dtype, y.device)
        if values and x.device.type != "meta":
            torch.testing.assert_close(x, y, atol=atol, rtol=rtol)


# -- 1. torch.compile around, inside and beside our transforms ----------------------------------
def _loss(w, x, y):
    return ((x @ w - y) ** 2).mean()


def _f(x):
    return (x.sin() * x).sum()


def _g_sum(v):  # a reduction beside a pointwise op: the batched sum must be aligned
    return v.sin() * 2 + v.sum()


_W, _XS, _YS = _rand(3, 2), _rand(5, 4, 3), _rand(5, 4, 2)
_X = _rand(4, 3)


def _step(lib):
    def step(w, xs, ys):
        g = lib.vmap(lib.grad(_loss), in_dims=(None, 0, 0))(w, xs, ys)
        return w - 0.1 * g.mean(0), g.norm()

    return step


_COMPILE_CASES = {
    "compile(grad)": (lambda lib, c: c(lib.grad(_f))(_X[0])),
    "compile(vmap(grad))": (lambda lib, c: c(lib.vmap(lib.grad(_f)))(_X)),
    "grad(compile)": (lambda lib, c: lib.grad(c(_f))(_X[0])),
    # SILENT before: dynamo traced our __torch_function__ and replayed it over the physical value
    "vmap(compile(sin+sum))": (lambda lib, c: lib.vmap(c(_g_sum))(_X)),
    "vmap(compile(mean))": (lambda lib, c: lib.vmap(c(lambda v: v - v.mean()))(_X)),
    # crash before: RecursionError inside dynamo
    "vmap(grad(compile))": (lambda lib, c: lib.vmap(lib.grad(c(_f)))(_X)),
    "jvp(compile(sum))": (lambda lib, c: lib.jvp(c(_g_sum), (_X,), (_X * 2,))),
    "jacrev(compile(sum))": (lambda lib, c: lib.jacrev(c(_g_sum))(_X[0])),
    "compiled step": (lambda lib, c: c(_step(lib))(_W, _XS, _YS)),
    "compile(jvp)": (lambda lib, c: c(lambda x, t: lib.jvp(torch.sin, (x,), (t,)))(_X, _X * 2)),
    "compile(hessian)": (lambda lib, c: c(lib.hessian(_f))(_X[0])),
}


def _compiler(backend, **kw):
    return lambda fn: torch.compile(fn, backend=backend, **kw)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("case", sorted(_COMPILE_CASES))
def test_compile_and_transforms_compute_torch_funcs_values(case, backend):
    import torch._dynamo

    torch._dynamo.reset()
    ours = _COMPILE_CASES[case](ft, _compiler(backend))
    _same(ours, _COMPILE_CASES[case](tf, lambda fn: fn))


def test_compiled_structured_solve_inside_vmap_matches_a_loop():
    """linalg stays traceable by dynamo (not on the skip list); under vmap its ops on our
    wrappers graph-break into our (skipped) dispatch and compute right."""
    import torch._dynamo
    from functransforms.linalg import DiagonalOperator

    def solve(d, b):
        return torch.linalg.solve(DiagonalOperator(d), b) + torch.logdet(DiagonalOperator(d))

    d, b = _rand(4, 3).abs() + 1, _rand(4, 3)
    torch._dynamo.reset()
    ours = ft.vmap(torch.compile(solve, backend="aot_eager"))(d, b)
    _same(ours, torch.stack([b[i] / d[i] + d[i].log().sum() for i in range(4)]))


@pytest.mark.parametrize("randomness", ["different", "same"])
def test_compiled_dropout_inside_vmap_draws_torch_funcs_stream(randomness):
    import torch._dynamo

    def run(lib, g):
        torch.manual_seed(0)
        return lib.vmap(g, randomness=randomness)(_X), torch.randn(2)

    def g(v):
        return torch.nn.functional.dropout(v, 0.5) * 3

    torch._dynamo.reset()
    _same(run(ft, torch.compile(g, backend="aot_eager")), run(tf, g), atol=0, rtol=0)


def test_inductor_function_inside_vmap_of_grad():
    """The SILENT case and the crash above, with inductor (skipped without a C++ compiler)."""
    import torch._dynamo

    torch._dynamo.reset()
    try:
        ours = ft.vmap(torch.compile(_g_sum, backend="inductor"))(_X)
    except Exception as e:  # no C++ compiler on the machine
        if "compiler" in str(e).lower() or "cpp" in str(e).lower():
            pytest.skip(f"inductor cannot compile here: {e}")
        raise
    _same(ours, tf.vmap(_g_sum)(_X))
    _same(ft.vmap(ft.grad(torch.compile(_f, backend="inductor")))(_X), tf.vmap(tf.grad(_f))(_X))


def test_compiled_training_step_fullgraph_and_backward_through_vmap_grad():
    import torch._dynamo

    def outer(lib):
        def fn(w, xs, ys):
            g = lib.vmap(lib.grad(_loss, argnums=1), in_dims=(None, 0, 0))(w, xs, ys)
            return (g**2).sum()

        return fn

    def run(fn):
        w = _W.clone().requires_grad_()
        out = fn(w, _XS, _YS)
        out.backward()
        return out, w.grad

    torch._dynamo.reset()
    _same(run(torch.compile(outer(ft), backend="aot_eager")), run(outer(tf)))


def test_fullgraph_compile_of_our_transforms_refuses_naming_the_transform():
    """torch.func's transforms are built into dynamo; ours run eagerly (one graph break), which
    fullgraph=True forbids: dynamo raises naming our function (docs/torch_func_differences.md,
    section 33)."""
    import torch._dynamo

    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match="functransforms"):
        torch.compile(_step(ft), backend="eager", fullgraph=True)(_W, _XS, _YS)


def test_compiled_function_inside_vmap_when_dynamo_loads_after_us():
    """The skip list is registered at the first transform call after dynamo is imported (a
    fresh process: functransforms imported before torch._dynamo)."""
    code = textwrap.dedent(
        """
        import torch, sys
        import functransforms as ft
        assert "torch._dynamo" not in sys.modules
        x = torch.randn(4, 3, dtype=torch.float64)
        g = lambda v: v.sin() * 2 + v.sum()
        out = ft.vmap(torch.compile(g, backend="eager"))(x)
        ref = torch.stack([g(r) for r in x])
        torch.testing.assert_close(out, ref)
        print("ok")
        """
    )
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": root}
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=root, env=env
    )
    assert res.stdout.strip().endswith("ok"), res.stderr[-2000:]


class _Exported(torch.nn.Module):
    def __init__(self, make):
        super().__init__()
        self.make = make

    def forward(self, x):
        return self.make(x)


_EXPORT_CASES = {
    "grad": lambda x: ft.grad(_f)(x),
    "vmap(grad)": lambda x: ft.vmap(ft.grad(_f))(x),
    "vmap(sum)": lambda x: ft.vmap(_g_sum)(x),
    "jvp": lambda x: ft.jvp(torch.sin, (x,), (x,))[1],
}


@pytest.mark.parametrize("case", sorted(_EXPORT_CASES))
def test_torch_export_through_our_transforms_raises_clearly(case):
    """crash before: "Unable to cast NotImplemented to Tensor" from inside the transform (the
    pre-dispatch trace of non-strict export does not look inside our wrappers). torch.func's
    export of grad fails as well on torch 2.13 (an AttributeError)."""
    with pytest.raises(RuntimeError, match="torch.export cannot trace through functransforms"):
        torch.export.export(_Exported(_EXPORT_CASES[case]), (_X,), strict=False)


def test_transforms_of_an_exported_module():
    """What the error advises: export the model, transform ``ep.module()``."""
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()
    mod = torch.export.export(m, (_X[:1],)).module()
    ours = ft.vmap(ft.grad(lambda v: mod(v[None]).sum()))(_X)
    _same(ours, tf.vmap(tf.grad(lambda v: m(v[None]).sum()))(_X))


# -- 2. autocast ------------------------------------------------------------------------------
_MLP = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
_CNN = torch.nn.Sequential(
    torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(64, 2)
)
_XS32, _YS32, _IMS = _rand(5, 3, dtype=torch.float32), _rand(5, 2, dtype=torch.float32), None
_IMS = _rand(5, 1, 6, 6, dtype=torch.float32)
_W32 = _rand(3, 4, dtype=torch.float32)


def _bf16():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _psg(lib, model, xs):
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, x, y):
        return ((lib.functional_call(model, p, (x[None],)) - y) ** 2).sum()

    return lib.vmap(lib.grad(loss), in_dims=(None, 0, 0))(params, xs, _YS32)


def _inside(lib):
    params = {k: v.detach() for k, v in _MLP.named_parameters()}

    def loss(p, x, y):
        with _bf16():
            out = lib.functional_call(_MLP, p, (x[None],))
        return ((out.float() - y) ** 2).sum()

    return lib.vmap(lib.grad(loss), in_dims=(None, 0, 0))(params, _XS32, _YS32)


def _mm_tanh(x):
    return torch.mm(x, _W32).tanh()


def _vjp_bf16(lib):
    out, pull = lib.vjp(_mm_tanh, _XS32)
    return out, pull(torch.ones(5, 4, dtype=torch.bfloat16))


_AUTOCAST = {
    "psg_mlp": lambda lib: _psg(lib, _MLP, _XS32),
    "psg_cnn": lambda lib: _psg(lib, _CNN, _IMS),
    "autocast_inside_grad": _inside,
    "jvp": lambda lib: lib.jvp(_mm_tanh, (_XS32,), (_XS32,)),
    "vjp": _vjp_bf16,
    "jacrev": lambda lib: lib.jacrev(_mm_tanh)(_XS32),
    "jacfwd": lambda lib: lib.jacfwd(_mm_tanh)(_XS32),
    "hessian": lambda lib: lib.hessian(lambda x: _mm_tanh(x[None]).sum())(_XS32[0]),
    "vmap_linear": lambda lib: lib.vmap(lambda x: torch.nn.functional.linear(x, _W32.T))(_XS32),
    "log_softmax_fp32_op": lambda lib: lib.vmap(
        lib.grad(lambda a: torch.nn.functional.log_softmax(a @ _W32, -1).sum())
    )(_XS32),
}


@pytest.mark.parametrize("case", sorted(_AUTOCAST))
def test_autocast_results_have_torch_funcs_dtypes_and_values(case):
    with _bf16():
        ours, ref = _AUTOCAST[case](ft), _AUTOCAST[case](tf)
    _same(ours, ref, atol=1e-2, rtol=1e-2)


def test_autocast_conv_under_vmap_is_low_precision_as_a_loop():
    """torch.func is wrong here: its vmap of conv2d under autocast returns float32, where every
    example (and a loop) is bfloat16. Ours follows the loop."""
    w = _CNN[0].weight.detach()
    xs = _rand(5, 2, 1, 6, 6, dtype=torch.float32)
    with _bf16():
        loop = torch.stack([torch.nn.functional.conv2d(x, w) for x in xs])
        ours = ft.vmap(lambda x: torch.nn.functional.conv2d(x, w))(xs)
        assert tf.vmap(lambda x: torch.nn.functional.conv2d(x, w))(xs).dtype == torch.float32
    assert ours.dtype == loop.dtype == torch.bfloat16
    torch.testing.assert_close(ours, loop)


# -- 3. meta and fake tensors -------------------------------------------------------------------
def _sum_sin(x):
    return (x.sin() * x).sum()


def _exp_mm(x):
    return x.exp() @ torch.ones(3, 3, device=x.device, dtype=x.dtype)


def _meta_cases(x, mod, net):
    fc = lambda lib, m: lambda p, v: lib.functional_call(m, p, (v,))  # noqa: E731
    params = lambda m: dict(m.named_parameters())  # noqa: E731
    return {
        "grad": lambda lib: lib.grad(_sum_sin)(x[0]),
        "vjp": lambda lib: lib.vjp(_exp_mm, x)[1](torch.ones_like(x)),
        "jvp": lambda lib: lib.jvp(_exp_mm, (x,), (torch.ones_like(x),)),
        "vmap_in_dims1": lambda lib: lib.vmap(_exp_mm, in_dims=1, out_dims=1)(x.T.contiguous()),
        "jacrev_chunk": lambda lib: lib.jacrev(_exp_mm, chunk_size=2)(x[0]),
        "jacfwd": lambda lib: lib.jacfwd(_exp_mm)(x[0]),
        "hessian": lambda lib: lib.hessian(_sum_sin)(x[0]),
        "linearize": lambda lib: lib.linearize(_exp_mm, x)[1](torch.ones_like(x)),
        "vmap_chunk": lambda lib: lib.vmap(_exp_mm, chunk_size=4)(x),
        "vmap_randomness_same": lambda lib: lib.vmap(
            lambda v: v + torch.randn(3, device=v.device, dtype=v.dtype), randomness="same"
        )(x),
        "functional_call_vmap": lambda lib: lib.vmap(fc(lib, mod), in_dims=(None, 0))(
            params(mod), x
        ),
        "functional_call_jacrev": lambda lib: lib.jacrev(fc(lib, mod))(params(mod), x[0]),
        "functional_call_hessian": lambda lib: lib.hessian(
            lambda p, v: fc(lib, mod)(p, v).pow(2).sum(), argnums=1
        )(params(mod), x[0]),
        "layer_norm_vmap_grad": lambda lib: lib.vmap(
            lib.grad(lambda p, v: fc(lib, net)(p, v[None]).sum()), in_dims=(None, 0)
        )(params(net), x),
    }


def _models():
    return torch.nn.Linear(3, 2), torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))


@pytest.mark.parametrize("how", ["device_context", "default_device", "fake_mode"])
@pytest.mark.parametrize("case", sorted(_meta_cases(None, None, None)))
def test_meta_and_fake_inputs_give_torch_funcs_shapes_and_dtypes(case, how):
    if how == "fake_mode":
        from torch._subclasses.fake_tensor import FakeTensorMode

        ctx = FakeTensorMode()
    elif how == "device_context":
        ctx = torch.device("meta")
    else:
        ctx = None
    if ctx is None:
        torch.set_default_device("meta")
        try:
            mod, net = _models()
            x = torch.randn(6, 3)
            make = _meta_cases(x, mod, net)[case]
            ours, ref = make(ft), make(tf)
        finally:
            torch.set_default_device(None)
    else:
        with ctx:
            mod, net = _models()
            x = torch.randn(6, 3)
            make = _meta_cases(x, mod, net)[case]
            ours, ref = make(ft), make(tf)
    _same(ours, ref, values=False)


# -- 4. batch size 0 and empty tensors -----------------------------------------------------------
_X0, _Y0, _W0 = _rand(0, 3), _rand(0, 2), _rand(3, 2)
_CNN64 = torch.nn.Sequential(
    torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(64, 2)
).double()


def _lin_loss(w, x, y):
    return ((x @ w - y) ** 2).sum()


def _cnn_loss(lib):
    return lambda p, x, y: ((lib.functional_call(_CNN64, p, (x[None],)) - y) ** 2).sum()


_EMPTY = {
    "in_dims=1": lambda lib: lib.vmap(lambda v: v.sin() * 2, in_dims=1)(_X0.T),
    "in_dims=-1": lambda lib: lib.vmap(lambda v: v.cumsum(0), in_dims=-1)(_X0.T),
    "in_dims=(None,0)": lambda lib: lib.vmap(lambda w, v: v @ w, in_dims=(None, 0))(_W0, _X0),
    "in_dims=dict": lambda lib: lib.vmap(lambda d: d["a"] @ d["w"], in_dims=({"a": 0, "w": None},))(
        {"a": _X0, "w": _W0}
    ),
    "out_dims=(1,0)": lambda lib: lib.vmap(lambda v: (v * 2, v.sum()), out_dims=(1, 0))(_X0),
    "vmap(grad)": lambda lib: lib.vmap(lib.grad(_lin_loss), in_dims=(None, 0, 0))(_W0, _X0, _Y0),
    "vmap(jacrev)": lambda lib: lib.vmap(lib.jacrev(torch.sin))(_X0),
    "vmap(jacfwd)": lambda lib: lib.vmap(lib.jacfwd(torch.sin))(_X0),
    # crash before: the batched reshape of hessian's basis had an ambiguous -1
    "vmap(hessian)": lambda lib: lib.vmap(lib.hessian(lambda v: v.sin().sum()))(_X0),
    "vmap(vmap) inner B=0": lambda lib: lib.vmap(lib.vmap(lambda v: v * 2))(_rand(4, 0, 3)),
    "vmap(vjp)": lambda lib: lib.vmap(lambda v: lib.vjp(torch.sin, v)[1](v))(_X0),
    "jacrev 0-out": lambda lib: lib.jacrev(lambda v: v[:0] * 2)(_rand(3)),
    "jacrev 0-in": lambda lib: lib.jacrev(lambda v: v.sum() + torch.ones(2, dtype=D))(_rand(0)),
    "hessian 0x3": lambda lib: lib.hessian(lambda v: (v**3).sum())(_rand(0, 3)),
    "linearize 0": lambda lib: lib.linearize(torch.sin, _rand(0))[1](_rand(0)),
    "randomness=different": lambda lib: lib.vmap(
        lambda v: v + torch.randn(3, dtype=D), randomness="different"
    )(_X0),
    "matmul both batched": lambda lib: lib.vmap(torch.matmul)(_rand(0, 2, 3), _rand(0, 3, 4)),
    "solve": lambda lib: lib.vmap(torch.linalg.solve)(_rand(0, 3, 3), _rand(0, 3)),
}


@pytest.mark.parametrize("case", sorted(_EMPTY))
def test_empty_batches_give_torch_funcs_shapes_and_dtypes(case):
    _same(_EMPTY[case](ft), _EMPTY[case](tf))


def _one_example_shape(fn, x):
    return fn(torch.empty(x.shape[1:], dtype=x.dtype, device="meta")).shape


_CONV_W, _CONVT_W = _rand(4, 2, 3, 3), _rand(2, 4, 3, 3)
_V7, _T4 = _rand(7), torch.tensor([0, 3, 1, 4])
_F = torch.nn.functional
_EMPTY_CONV = {  # per-example fn, batch of 0
    # crash before (an ambiguous reshape(B, -1)); torch.func computes these
    "cross_entropy": (lambda x: _F.cross_entropy(x, _T4), _rand(0, 4, 5)),
    "grad_cross_entropy": (
        lambda x: ft.grad(lambda x: _F.cross_entropy(x, _T4))(x),
        _rand(0, 4, 5),
    ),
    "group_norm": (lambda x: _F.group_norm(x, 1), _rand(0, 4, 3, 5)),
    "grad_group_norm": (
        lambda x: ft.grad(lambda x: _F.group_norm(x, 1).pow(2).sum())(x),
        _rand(0, 4, 3, 5),
    ),
    "take": (lambda i: torch.take(_V7, i), torch.zeros(0, 3, dtype=torch.long)),  # tf raises
    # torch.func's shapes are [0, 0, ...] here
    "batch_norm_eval": (
        lambda x: _F.batch_norm(x, torch.zeros(3, dtype=D), torch.ones(3, dtype=D)),
        _rand(0, 4, 3),
    ),
    "unfold": (lambda x: _F.unfold(x, 2), _rand(0, 1, 2, 4, 4)),
    "interpolate": (lambda x: _F.interpolate(x, scale_factor=2), _rand(0, 1, 2, 4, 4)),
    "avg_pool1d": (lambda x: _F.avg_pool1d(x, 2), _rand(0, 2, 3, 6)),
    # crash before: an ambiguous -1 (torch.func raises for reshape(-1) too)
    "reshape(-1)": (lambda a: a.reshape(-1), _rand(0, 2, 3)),
    "view(-1, 2)": (lambda a: a.view(-1, 2), _rand(0, 2, 3, 6)),
    "max_pool2d": (lambda a: torch.nn.functional.max_pool2d(a, 2), _rand(0, 5, 2, 6, 6)),
    "conv2d": (lambda a: torch.nn.functional.conv2d(a, _CONV_W), _rand(0, 5, 2, 6, 6)),
    "conv_transpose2d": (
        lambda a: torch.nn.functional.conv_transpose2d(a, _CONVT_W),
        _rand(0, 5, 2, 6, 6),
    ),
    "grad_conv_input": (
        lambda a: ft.grad(lambda a: torch.nn.functional.conv2d(a, _CONV_W).pow(2).sum())(a),
        _rand(0, 5, 2, 6, 6),
    ),
    "grad_conv_weight": (
        lambda a: ft.grad(lambda w: torch.nn.functional.conv2d(a, w).pow(2).sum())(_CONV_W),
        _rand(0, 5, 2, 6, 6),
    ),
    "grad_max_pool": (
        lambda a: ft.grad(lambda a: torch.nn.functional.max_pool2d(a, 2).pow(2).sum())(a),
        _rand(0, 5, 2, 6, 6),
    ),
}


@pytest.mark.parametrize("case", sorted(_EMPTY_CONV))
def test_empty_batch_has_each_examples_shape(case):
    """Crash before (ZeroDivisionError; groups=0 for a batched weight). torch.func is wrong
    for conv2d and max_pool2d: its vmap over 0 examples of [5, 2, 6, 6] returns
    [0, 0, 4, 4, 4] where one example gives [5, 4, 4, 4]; ours gives [0, 5, 4, 4, 4]."""
    fn, x = _EMPTY_CONV[case]
    out = ft.vmap(fn)(x)
    one = fn(x.new_zeros(x.shape[1:]))  # one example, computed eagerly
    assert out.shape == (0, *one.shape) and out.dtype == one.dtype


def test_per_sample_grads_of_a_cnn_over_an_empty_batch():
    """torch.func raises (groups=0); ours gives every parameter's shape with a batch of 0."""
    params = {k: v.detach() for k, v in _CNN64.named_parameters()}
    with pytest.raises(RuntimeError):
        tf.vmap(tf.grad(_cnn_loss(tf)), in_dims=(None, 0, 0))(params, _rand(0, 1, 6, 6), _Y0)
    g = ft.vmap(ft.grad(_cnn_loss(ft)), in_dims=(None, 0, 0))(params, _rand(0, 1, 6, 6), _Y0)
    assert {k: v.shape for k, v in g.items()} == {k: (0, *v.shape) for k, v in params.items()}


@pytest.mark.parametrize("chunk_size", [1, 3])
def test_chunked_vmap_over_an_empty_batch(chunk_size):
    """torch.func raises an internal AssertionError (arg_spec must not be None); ours returns
    the empty result."""
    g = ft.vmap(ft.grad(_lin_loss), in_dims=(None, 0, 0), chunk_size=chunk_size)(_W0, _X0, _Y0)
    assert g.shape == (0, 3, 2) and g.dtype == D


# -- 5. global modes ----------------------------------------------------------------------------
_WM, _XM, _YM = _rand(3, 2), _rand(5, 3), _rand(5, 2)


def _psg_lin(lib):
    return lib.vmap(lib.grad(_lin_loss), in_dims=(None, 0, 0))(_WM, _XM, _YM)


with torch.inference_mode():
    _WI, _XI, _YI = _WM.clone(), _XM.clone(), _YM.clone()


def _grad_off_inside(x):
    torch.set_grad_enabled(False)
    y = x.sin()
    torch.set_grad_enabled(True)
    return (y * x).sum()


def _default_float64(lib):
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        x = _XM.float()  # float32 inputs, float64 factories
        return (
            lib.vmap(lib.grad(lambda v: (v * torch.tensor([1.0, 2.0, 3.0])).pow(2).sum()))(x),
            lib.jacrev(lambda v: v + torch.zeros(3))(x[0]),
            lib.jvp(lambda v: v.sum() * torch.tensor(2.0), (_XM[0],), (_XM[0],)),
        )
    finally:
        torch.set_default_dtype(old)


def _deterministic(lib):
    idx = torch.tensor([0, 2, 0, 1])
    torch.use_deterministic_algorithms(True)
    try:
        return lib.vmap(
            lib.grad(lambda v: (v[idx] ** 2).sum() + v.index_add(0, idx, v[idx]).pow(2).sum())
        )(_XM)
    finally:
        torch.use_deterministic_algorithms(False)


def _under(ctx, make):
    def run(lib):
        with ctx():
            return make(lib)

    return run


def _enable_in_no_grad(lib):
    with torch.no_grad(), torch.enable_grad():
        return lib.grad(_lin_loss)(_WM, _XM, _YM)


def _anomaly(lib):
    with torch.autograd.set_detect_anomaly(True):
        return _psg_lin(lib), lib.hessian(lambda x: (x.sin() ** 2).sum())(_XM[0])


_MODES = {
    "no_grad": _under(torch.no_grad, _psg_lin),
    "inference_mode": _under(torch.inference_mode, _psg_lin),
    "inference_tensors_psg": lambda lib: lib.vmap(lib.grad(_lin_loss), in_dims=(None, 0, 0))(
        _WI, _XI, _YI
    ),
    "inference_tensors_hessian": lambda lib: lib.hessian(lambda w: _lin_loss(w, _XI, _YI))(_WI),
    "inference_tensors_jvp": lambda lib: lib.jvp(lambda w: _XI @ w, (_WI,), (_WI,)),
    "enable_grad_in_no_grad": _enable_in_no_grad,
    "set_grad_enabled_inside_f": lambda lib: lib.vmap(lib.grad(_grad_off_inside))(_XM),
    "detect_anomaly": _anomaly,
    "deterministic_algorithms": _deterministic,
    "default_dtype_float64": _default_float64,
    "disable_saved_tensors_hooks": _under(
        lambda: torch.autograd.graph.disable_saved_tensors_hooks("no hooks"), _psg_lin
    ),
}


@pytest.mark.parametrize("case", sorted(_MODES))
def test_global_modes_give_torch_funcs_values(case):
    _same(_MODES[case](ft), _MODES[case](tf), atol=1e-10, rtol=1e-8)


def _doubling_hooks():
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t * 2, lambda t: t)


def test_user_saved_tensor_hooks_around_grad_raise_as_torch_func():
    """SILENT before: a hook that changes what it saves changes torch's gradients (4x here),
    and ours skipped it (2x). torch.func raises; ours too, naming the call."""
    x = _rand(3)
    with _doubling_hooks(), pytest.raises(RuntimeError, match="saved tensor hooks"):
        tf.grad(lambda v: (v * v).sum())(x)
    with _doubling_hooks(), pytest.raises(RuntimeError, match=r"grad\(<lambda>.*saved_tensors"):
        ft.grad(lambda v: (v * v).sum())(x)
    with _doubling_hooks(), pytest.raises(RuntimeError, match="saved_tensors_hooks"):
        _psg_lin(ft)
    assert torch.autograd.graph.saved_tensors_hooks  # the state is clean: hooks work after
    y = x.clone().requires_grad_()
    with _doubling_hooks():
        (y * y).sum().backward()
    torch.testing.assert_close(y.grad, 4 * x)


def test_torchs_own_saved_tensor_hooks_around_grad_are_let_through():
    """save_on_cpu and torch's checkpoint give back what they saved: skipping them changes
    memory, not values (torch.func raises; differences section 34)."""
    with torch.autograd.graph.save_on_cpu():
        ours = _psg_lin(ft)
    _same(ours, _psg_lin(tf), atol=1e-12)
    w = _WM.clone().requires_grad_()
    out = torch.utils.checkpoint.checkpoint(
        lambda w: ft.vmap(ft.grad(_lin_loss, argnums=1), in_dims=(None, 0, 0))(w, _XM, _YM),
        w,
        use_reentrant=False,
    )
    out.pow(2).sum().backward()
    w2 = _WM.clone().requires_grad_()
    tf.vmap(tf.grad(_lin_loss, argnums=1), in_dims=(None, 0, 0))(w2, _XM, _YM).pow(
        2
    ).sum().backward()
    torch.testing.assert_close(w.grad, w2.grad)


def test_default_device_meta_shapes():
    torch.set_default_device("meta")
    try:
        make = lambda lib: (  # noqa: E731
            lib.vmap(lib.grad(lambda w, x: (x @ w).pow(2).sum()), in_dims=(None, 0))(
                torch.randn(3, 2), torch.randn(5, 3)
            ),
            lib.hessian(lambda x: (x.sin() * torch.ones(3)).sum())(torch.randn(3)),
        )
        ours, ref = make(ft), make(tf)
    finally:
        torch.set_default_device(None)
    _same(ours, ref, values=False)


# -- 6. generators and randomness -----------------------------------------------------------------
_XR = _rand(4, 3)
_DRAWS = {
    "randn": lambda v, g: v + torch.randn(3, generator=g, dtype=D),
    "rand_like": lambda v, g: v + torch.rand_like(v),
    "dropout": lambda v, g: torch.nn.functional.dropout(v, 0.5),
    "multinomial": lambda v, g: torch.multinomial(v.softmax(0), 2, generator=g).to(D),
    "randperm": lambda v, g: v[torch.randperm(3, generator=g)],
    "randint": lambda v, g: v + torch.randint(0, 5, (3,), generator=g),
    "uniform_": lambda v, g: v.clone().uniform_(generator=g),
}


@pytest.mark.parametrize("randomness", ["different", "same"])
@pytest.mark.parametrize("case", sorted(_DRAWS))
def test_generators_inside_vmap_draw_torch_funcs_streams(case, randomness):
    """The values drawn, and the generators' states after (a draw after the call)."""

    def run(lib):
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(5)
        out = lib.vmap(lambda v: _DRAWS[case](v, g), randomness=randomness)(_XR)
        return out, torch.randn(2, generator=g), torch.randn(2)

    if case == "multinomial" and randomness == "same":  # both refuse: per-example
        with pytest.raises(RuntimeError):  # probabilities, one draw for the batch
            run(tf)
        with pytest.raises(RuntimeError, match="randomness"):
            run(ft)
        return
    _same(run(ft), run(tf), atol=0, rtol=0)


def _fork(lib):
    torch.manual_seed(0)
    with torch.random.fork_rng():
        torch.manual_seed(7)
        a = lib.vmap(lambda v: v + torch.randn(3, dtype=D), randomness="different")(_XR)
    return a, torch.randn(3)


def _fork_inside(lib):
    torch.manual_seed(0)

    def f(v):
        with torch.random.fork_rng():
            return v + torch.randn(3, dtype=D)

    return lib.vmap(f, randomness="same")(_XR), torch.randn(3)


def _psg_dropout(lib):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(3)

    def f(v):
        return (torch.nn.functional.dropout(v, 0.3) * torch.randn(3, generator=g, dtype=D)).sum()

    return lib.vmap(lib.grad(f), randomness="different")(_XR), torch.randn(2, generator=g)


@pytest.mark.parametrize("make", [_fork, _fork_inside, _psg_dropout], ids=lambda f: f.__name__)
def test_fork_rng_and_per_sample_dropout_match_torch_func(make):
    _same(make(ft), make(tf), atol=0, rtol=0)


_NAN_CASES = {
    "grad": lambda lib, f, x: lib.grad(lambda v: f(v).sum())(x[0]),
    "vmap(grad)": lambda lib, f, x: lib.vmap(lib.grad(lambda v: f(v).sum()))(x),
    "jacrev": lambda lib, f, x: lib.jacrev(f)(x[0]),
    "vjp": lambda lib, f, x: lib.vjp(f, x[0])[1](torch.ones(3, dtype=D)),
}


@pytest.mark.parametrize("case", sorted(_NAN_CASES))
def test_detect_anomaly_raises_on_a_nan_cotangent_as_torch_func(case):
    """SILENT before: under set_detect_anomaly(True) torch.func raises "Function
    'SqrtBackward0' returned nan values"; ours returned the NaN without a word."""
    x = torch.zeros(2, 3, dtype=D)
    f = lambda v: torch.sqrt(v) * 0  # noqa: E731  (0 * inf in the backward)
    with torch.autograd.set_detect_anomaly(True):
        with pytest.raises(RuntimeError, match="SqrtBackward0' returned nan"):
            _NAN_CASES[case](tf, f, x)
        with pytest.raises(RuntimeError, match="SqrtBackward' returned nan"):
            _NAN_CASES[case](ft, f, x)
    assert all(t.isnan().all() for t in _leaves(_NAN_CASES[case](ft, f, x)))  # as torch


# -- torch's dispatch-mode tools around our transforms ---------------------------------------------
def _psg_mlp(lib):
    return _psg(lib, _MLP, _XS32)


def test_flop_counter_mode_around_per_sample_grads():
    """crash before: FlopCounterMode's module tracker registers torch.autograd.graph
    multi-grad hooks, which assert they run inside torch's engine, and our sweep ran them. They
    are kept out of our sweep; the values are torch.func's (the counts are not: section 36)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        ours = _psg_mlp(ft)
    assert counter.get_total_flops() > 0
    _same(ours, _psg_mlp(tf))


def test_torch_multi_grad_hooks_inside_grad_are_not_run_by_our_sweep():
    calls = []
    x = _rand(3)

    def f(v):
        y = v.sin()
        torch.autograd.graph.register_multi_grad_hook((y,), lambda grads: calls.append(1))
        return (y * 2).sum()

    torch.testing.assert_close(ft.grad(f)(x), 2 * x.cos())
    assert calls == []  # torch.func runs it (torch's engine): a difference, section 36


@pytest.mark.parametrize("default", ["cpu", "meta"])
def test_linearize_keeps_its_primals_device_under_a_default_device(default):
    """crash before: linearize's jvp_fn called torch.as_tensor on its primals, which under
    set_default_device copies a tensor to the default device ("Cannot copy out of meta
    tensor"; a CPU primal would have moved)."""
    x = torch.empty(4, 3, device="meta", dtype=D) if default == "cpu" else _rand(4, 3)
    w = torch.ones(3, 3, dtype=D, device=x.device)
    torch.set_default_device(default)
    try:
        out, jvp_fn = ft.linearize(lambda v: v.exp() @ w, x)
        t = jvp_fn(torch.ones_like(x))
        g = ft.grad(lambda v: (v > 0).sum())(x)  # the integer-output branch of grad
    finally:
        torch.set_default_device(None)
    assert t.device == x.device and g.device == x.device and t.shape == (4, 3)
