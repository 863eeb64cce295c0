"""Recurrent layers under the transforms.

torch runs each of nn.RNNCell, GRUCell, LSTMCell, RNN, GRU and LSTM as one composite C++ kernel
that writes into buffers it holds; ours replace those kernels by out-of-place formulas whenever a
transform's value is an argument (Note [RNN kernels under transforms], functransforms/_core/rnn.py).
Every transform is checked against torch.func where torch.func computes, and against plain
autograd / a loop of plain calls where it raises (vmap of LSTMCell and of whole sequences,
packed sequences). float32 LSTMs outside the transforms' kernels still run torch's oneDNN layer
(Note [LSTM through oneDNN], autodiff/nn.py)."""

import pytest
import torch
import torch.func as tf
import torch.nn as nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence
from torch.utils._pytree import tree_map

import functransforms as ft
from functransforms._core import composites as _composites
from functransforms.errors import DataDependentError

I, H, B, T = 3, 4, 2, 4

# name -> (constructor, is a cell)
_MODULES = {
    "RNNCell": (lambda **kw: nn.RNNCell(I, H, **kw), True),
    "RNNCell_relu": (lambda **kw: nn.RNNCell(I, H, nonlinearity="relu", **kw), True),
    "GRUCell": (lambda **kw: nn.GRUCell(I, H, **kw), True),
    "LSTMCell": (lambda **kw: nn.LSTMCell(I, H, **kw), True),
    "RNN": (lambda **kw: nn.RNN(I, H, **kw), False),
    "RNN_relu_2layers": (lambda **kw: nn.RNN(I, H, 2, nonlinearity="relu", **kw), False),
    "GRU": (lambda **kw: nn.GRU(I, H, **kw), False),
    "GRU_2layers_bidirectional_batch_first": (
        lambda **kw: nn.GRU(I, H, 2, bidirectional=True, batch_first=True, **kw),
        False,
    ),
    "LSTM": (lambda **kw: nn.LSTM(I, H, **kw), False),
    "LSTM_2layers_bidirectional_proj": (
        lambda **kw: nn.LSTM(I, H, 2, bidirectional=True, proj_size=2, **kw),
        False,
    ),
}
# (dtype, bias)
_VARIANTS = {
    "float32": (torch.float32, True),
    "float64": (torch.float64, True),
    "float64_no_bias": (torch.float64, False),
}


def _make(name, variant):
    dtype, bias = _VARIANTS[variant]
    ctor, cell = _MODULES[name]
    torch.manual_seed(0)
    m = ctor(bias=bias).to(dtype).requires_grad_(False)
    x = torch.randn((B, I) if cell else (T, B, I), dtype=dtype)
    if name.endswith("batch_first"):
        x = x.transpose(0, 1).contiguous()
    return m, x


def _first(out):
    """The output a loss reads: a cell's (h, c) -> h; a sequence's (out, h) -> out."""
    return out[0] if isinstance(out, tuple) else out


def _tol(x):
    return {"rtol": 1e-4, "atol": 1e-5} if x.dtype == torch.float32 else {}


_CASES = [(n, v) for n in _MODULES for v in _VARIANTS]


@pytest.mark.parametrize("name,variant", _CASES)
def test_grad_jvp_jacobians_match_torch_func(name, variant):
    m, x = _make(name, variant)

    def f(x):
        return _first(m(x)).sin().sum()

    def g(x):
        return _first(m(x))

    t = torch.randn_like(x)
    tol = _tol(x)
    torch.testing.assert_close(ft.grad(f)(x), tf.grad(f)(x), **tol)
    jac = tf.jacrev(g)(x)
    torch.testing.assert_close(ft.jacrev(g)(x), jac, **tol)
    if name.startswith("LSTM") and not _MODULES[name][1] and x.dtype == torch.float32:
        # torch.func has no forward mode through a float32 LSTM (its oneDNN layer): the
        # reverse-mode Jacobian is the oracle
        ref_jvp, ref_jacfwd = (g(x), (jac.flatten(-x.dim()) * t.flatten()).sum(-1)), jac
    else:
        ref_jvp, ref_jacfwd = tf.jvp(g, (x,), (t,)), tf.jacfwd(g)(x)
    torch.testing.assert_close(ft.jvp(g, (x,), (t,)), ref_jvp, **tol)
    torch.testing.assert_close(ft.jacfwd(g)(x), ref_jacfwd, **tol)
    if x.dtype == torch.float64:
        ref_h = tf.jacrev(tf.jacrev(f))(x)  # torch.func's hessian: same numbers
        torch.testing.assert_close(ft.hessian(f)(x), ref_h)


@pytest.mark.parametrize("name,variant", _CASES)
def test_vmap_and_per_sample_grads_equal_a_loop(name, variant):
    """torch.func batches only the tanh/relu/GRU cells; the loop of plain calls and of
    torch.func's grad is the oracle for all."""
    m, x = _make(name, variant)
    xs = torch.stack([x, 2 * x, -x])
    p = dict(m.named_parameters())
    tol = _tol(x)

    def loss(lib):
        return lambda p, x: _first(lib.functional_call(m, p, (x,))).pow(2).sum()

    ours = ft.vmap(m)(xs)
    for i in range(3):
        torch.testing.assert_close(tree_map(lambda v, i=i: v[i], ours), m(xs[i]), **tol)
    grads = ft.vmap(ft.grad(loss(ft)), in_dims=(None, 0))(p, xs)
    for i in range(3):
        ref = tf.grad(loss(tf))(p, xs[i])
        torch.testing.assert_close({k: v[i] for k, v in grads.items()}, ref, **tol)


@pytest.mark.parametrize("name", ["RNNCell", "GRUCell", "LSTMCell", "GRU", "LSTM"])
def test_initial_state_differentiated_and_batched(name):
    m, x = _make(name, "float64")
    cell = _MODULES[name][1]
    shape = (B, H) if cell else (1, B, H)
    h0 = torch.randn(shape, dtype=x.dtype)
    state = (lambda h: (h, h.cos())) if name.startswith("LSTM") else (lambda h: h)

    def f(x, h):
        return _first(m(x, state(h))).tanh().sum()

    torch.testing.assert_close(ft.grad(f, (0, 1))(x, h0), tf.grad(f, (0, 1))(x, h0))
    t = torch.randn_like(h0)
    g = lambda h: _first(m(x, state(h)))  # noqa: E731
    torch.testing.assert_close(ft.jvp(g, (h0,), (t,)), tf.jvp(g, (h0,), (t,)))
    hs = torch.stack([h0, h0.sin()])  # a batch of initial states, one input
    ours = ft.vmap(g)(hs)
    torch.testing.assert_close(ours, torch.stack([g(h) for h in hs]))


@pytest.mark.parametrize("name", ["GRUCell", "LSTMCell", "GRU", "LSTM"])
@pytest.mark.parametrize("shared_input", [True, False])
@pytest.mark.parametrize("variant", ["float32", "float64"])
def test_ensemble_of_stacked_weights(name, shared_input, variant):
    """vmap over stacked parameters (functional_call): the model-ensembling recipe."""
    models = [_make(name, variant)[0] for _ in range(3)]
    for k, mk in enumerate(models):
        for v in mk.parameters():
            v.mul_(1 + 0.1 * k)
    _, x = _make(name, variant)
    tol = _tol(x)
    xs = torch.stack([x, x.cos(), -x])
    params = {
        k: torch.stack([dict(mk.named_parameters())[k] for mk in models])
        for k in dict(models[0].named_parameters())
    }
    m = models[0]

    def run(p, x):
        return _first(ft.functional_call(m, p, (x,)))

    ours = ft.vmap(run, in_dims=(0, None if shared_input else 0))(params, x if shared_input else xs)
    ref = torch.stack([_first(mk(x if shared_input else xs[k])) for k, mk in enumerate(models)])
    torch.testing.assert_close(ours, ref, **tol)
    loss = lambda p, x: run(p, x).pow(2).sum()  # noqa: E731
    grads = ft.vmap(ft.grad(loss), in_dims=(0, None))(params, x)
    for k, mk in enumerate(models):
        pk = {n: v[k] for n, v in params.items()}
        ref_k = tf.grad(lambda p, mk=mk: _first(tf.functional_call(mk, p, (x,))).pow(2).sum())(pk)
        torch.testing.assert_close({n: v[k] for n, v in grads.items()}, ref_k, **tol)


def test_jvp_matches_finite_differences():
    m, x = _make("GRU_2layers_bidirectional_batch_first", "float64")
    t = torch.randn_like(x)
    _, tangent = ft.jvp(lambda x: m(x)[0], (x,), (t,))
    eps = 1e-6
    fd = (m(x + eps * t)[0] - m(x - eps * t)[0]) / (2 * eps)
    torch.testing.assert_close(tangent, fd, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("kind", ["RNN", "GRU", "LSTM"])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_packed_sequences(kind, bidirectional):
    """torch.func raises on packed sequences ("Cannot access data pointer"); plain autograd and
    plain calls are the oracle. The PackedSequence is built inside the transformed function from
    the plain batch_sizes pack_padded_sequence gave."""
    torch.manual_seed(0)
    m = getattr(nn, kind)(I, H, 2, bidirectional=bidirectional).double()
    pk = pack_padded_sequence(torch.randn(5, 3, I, dtype=torch.float64), torch.tensor([5, 3, 2]))

    def f(d):
        out, h = m(PackedSequence(d, pk.batch_sizes))
        h = h[0] if isinstance(h, tuple) else h
        return out.data.sin().sum() + h.cos().sum()

    d = pk.data.clone().requires_grad_(True)
    (ref,) = torch.autograd.grad(f(d), d)
    torch.testing.assert_close(ft.grad(f)(pk.data), ref)
    t = torch.randn_like(pk.data)
    eps = 1e-6
    fd = (f(pk.data + eps * t) - f(pk.data - eps * t)) / (2 * eps)
    torch.testing.assert_close(ft.jvp(f, (pk.data,), (t,))[1], fd.detach(), rtol=1e-6, atol=1e-8)
    ds = torch.stack([pk.data, pk.data.cos()])
    torch.testing.assert_close(ft.vmap(f)(ds), torch.stack([f(v) for v in ds]).detach())


@pytest.mark.parametrize("kind", ["GRU", "LSTM"])
@pytest.mark.parametrize("batch_first", [False, True])
def test_pack_run_pad_pipeline(kind, batch_first):
    """pack_padded_sequence -> RNN -> pad_packed_sequence on a padded input, unsorted lengths,
    a padding value and a total length: torch.func raises on every transform here; plain
    autograd, finite differences and loops are the oracle."""
    torch.manual_seed(0)
    m = getattr(nn, kind)(I, H, 2, bidirectional=True, batch_first=batch_first).double()
    lengths = torch.tensor([2, 5, 3])
    x = torch.randn((3, 5, I) if batch_first else (5, 3, I), dtype=torch.float64)

    def f(x):
        pk = pack_padded_sequence(x, lengths, batch_first=batch_first, enforce_sorted=False)
        out, h = m(pk)
        h = h[0] if isinstance(h, tuple) else h
        pad, lens = pad_packed_sequence(out, batch_first, padding_value=-2.0, total_length=6)
        assert lens.tolist() == lengths.tolist()
        return pad, h

    def loss(x):
        pad, h = f(x)
        return pad.sin().sum() + h.cos().sum()

    xr = x.clone().requires_grad_(True)
    (ref,) = torch.autograd.grad(loss(xr), xr)
    torch.testing.assert_close(ft.grad(loss)(x), ref)
    t = torch.randn_like(x)
    eps = 1e-6
    fd = (loss(x + eps * t) - loss(x - eps * t)) / (2 * eps)
    torch.testing.assert_close(ft.jvp(loss, (x,), (t,))[1], fd.detach(), rtol=1e-6, atol=1e-8)
    xs = torch.stack([x, x.cos()])
    ours = ft.vmap(f)(xs)
    for i in range(2):
        torch.testing.assert_close(tree_map(lambda v, i=i: v[i], ours), f(xs[i]))
    grads = ft.vmap(ft.grad(loss))(xs)
    for i in range(2):
        xi = xs[i].clone().requires_grad_(True)
        torch.testing.assert_close(grads[i], torch.autograd.grad(loss(xi), xi)[0])


def test_packing_errors_are_torchs():
    x = torch.randn(5, 3, I, dtype=torch.float64)
    unsorted = torch.tensor([2, 5, 3])
    with pytest.raises(RuntimeError, match="sorted in decreasing order"):
        ft.grad(lambda x: pack_padded_sequence(x, unsorted).data.sum())(x)
    pk = pack_padded_sequence(x, torch.tensor([5, 3, 2]))
    with pytest.raises(ValueError, match="total_length"):  # nn.utils.rnn's own check
        ft.grad(
            lambda d: pad_packed_sequence(PackedSequence(d, pk.batch_sizes), total_length=2)[
                0
            ].sum()
        )(pk.data)


def test_batched_lengths_and_batch_sizes_raise_clearly():
    """Batched packing sizes would give each example its own shapes: a DataDependentError
    naming the vmap call and the argument (torch.func raises too), never a recursion or
    torch's internal "data is not allocated" error."""
    x = torch.randn(5, 3, I)
    lengths = torch.tensor([[5, 3, 2], [4, 3, 1]])
    with pytest.raises(DataDependentError, match=r"^vmap\(.*pack_padded_sequence: the lengths"):
        ft.vmap(lambda n: pack_padded_sequence(x, n).data)(lengths)
    pk = pack_padded_sequence(x, lengths[0])
    sizes = torch.stack([pk.batch_sizes, pk.batch_sizes])
    with pytest.raises(DataDependentError, match="pad_packed_sequence: the batch_sizes"):
        ft.vmap(lambda b: pad_packed_sequence(PackedSequence(pk.data, b))[0])(sizes)
    m = nn.GRU(I, H)
    with pytest.raises(DataDependentError, match="gru on a packed sequence: the batch_sizes"):
        ft.vmap(lambda b: torch._VF.gru(pk.data, b, torch.zeros(1, 3, H), m._flat_weights,
                                        True, 1, 0.0, False, False)[0])(sizes)  # fmt: skip


def test_dropout_between_layers_draws_as_torch():
    """Training-mode dropout between layers is torch.dropout on each layer's output but the
    last: under the same seed, the same mask as torch.func's (torch's kernel)."""
    torch.manual_seed(0)
    m = nn.GRU(I, H, 3, dropout=0.5).double().requires_grad_(False)
    x = torch.randn(T, B, I, dtype=torch.float64)
    f = lambda x: m(x)[0].sin().sum()  # noqa: E731
    torch.manual_seed(7)
    ours = ft.grad(f)(x)
    torch.manual_seed(7)
    ref = tf.grad(f)(x)
    torch.testing.assert_close(ours, ref)
    m.eval()
    assert not torch.equal(ft.grad(f)(x), ours)  # the masks mattered


def test_wrong_input_size_raises_as_torch():
    m = nn.GRUCell(I, H).double()
    x = torch.randn(B, I + 1, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="input_size"):
        m(x)
    with pytest.raises(RuntimeError, match="gru_cell: input has inconsistent input_size"):
        ft.jvp(m, (x,), (x,))


def test_empty_sequence_raises_as_torch():
    m = nn.GRU(I, H).double()
    x = torch.randn(0, B, I, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="sequence length to be larger than 0"):
        m(x)
    with pytest.raises(RuntimeError, match="sequence length to be larger than 0"):
        ft.jvp(lambda x: m(x)[0], (x,), (x,))


def test_plain_tensors_never_reach_the_kernel(monkeypatch):
    """The kernel sits at PythonTLSSnapshot: torch calls it for subclasses and under dispatch
    modes only, and hands anything without a transform's wrapper back to torch's kernel."""
    ft.grad(lambda x: x.sum())(torch.ones(2))  # the kernels are registered by now
    seen = []
    real = _composites._transformed
    monkeypatch.setattr(_composites, "_transformed", lambda a: seen.append(1) or real(a))
    m = nn.GRUCell(I, H)
    x = torch.randn(B, I)
    ref = m(x)
    assert not seen
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        assert m(torch.empty(B, I)).shape == (B, H)
    assert seen  # consulted under the mode, and torch's kernel ran
    seen.clear()
    ft.jvp(m, (x,), (x,))
    assert seen
    torch.testing.assert_close(m(x), ref)


def test_torch_compile_of_a_plain_gru_after_a_transform():
    """aot_autograd traces with fake and functional tensors under the Python dispatcher: our
    kernel sees no transform's wrapper and hands the call to torch's."""
    ft.grad(lambda x: x.sum())(torch.ones(2))  # the kernels are registered by now
    torch.manual_seed(0)
    m = nn.GRUCell(I, H)
    x = torch.randn(B, I)
    validate = torch.distributions.Distribution._validate_args
    try:
        out = torch.compile(m, backend="aot_eager")(x)
    finally:  # torch.compile turns distribution argument checks off for the process
        torch.distributions.Distribution.set_default_validate_args(validate)
    torch.testing.assert_close(out, m(x))
    (g,) = torch.autograd.grad(out.sum(), m.weight_hh)
    torch.testing.assert_close(g, torch.autograd.grad(m(x).sum(), m.weight_hh)[0])


def test_jit_of_a_transformed_gru():
    m, x = _make("GRU", "float64")
    f = lambda x: m(x)[0].sin().sum()  # noqa: E731
    jf = ft.jit(ft.grad(f))
    for v in (x, x + 1):
        torch.testing.assert_close(jf(v), tf.grad(f)(v))


# -- float32 nn.LSTM configurations against torch.func's oneDNN path ---------------------------
def _lstm(**kw):
    torch.manual_seed(0)
    return nn.LSTM(4, 6, **kw)


_LSTM_CONFIGS = {
    "one_layer": {},
    "batch_first": {"batch_first": True},
    "two_layers_bidirectional": {"num_layers": 2, "bidirectional": True},
    "no_bias": {"bias": False},
}


@pytest.mark.parametrize("name", sorted(_LSTM_CONFIGS))
def test_lstm_grad_matches_torch_func(name):
    m = _lstm(**_LSTM_CONFIGS[name])
    x = torch.randn(3, 5, 4)
    p = {k: v.detach() for k, v in m.named_parameters()}

    def loss(lib):
        return lambda p, x: lib.functional_call(m, p, (x,))[0].pow(2).sum()

    ours, theirs = ft.grad(loss(ft), argnums=(0, 1))(p, x), tf.grad(loss(tf), argnums=(0, 1))(p, x)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", sorted(_LSTM_CONFIGS))
def test_lstm_per_sample_gradients_equal_a_loop_of_torch_func(name):
    cfg = _LSTM_CONFIGS[name]
    m = _lstm(**cfg)
    bf = cfg.get("batch_first", False)
    x = torch.randn(3, 5, 4)  # 3 examples
    p = {k: v.detach() for k, v in m.named_parameters()}

    def loss(lib):
        def f(p, xi):  # one example: [5, 4]
            xi = xi[None] if bf else xi[:, None]
            return lib.functional_call(m, p, (xi,))[0].pow(2).sum()

        return f

    ours = ft.vmap(ft.grad(loss(ft)), in_dims=(None, 0))(p, x)
    for i in range(3):
        ref = tf.grad(loss(tf))(p, x[i])
        torch.testing.assert_close({k: v[i] for k, v in ours.items()}, ref, rtol=1e-4, atol=1e-5)


def test_lstm_jvp_matches_finite_differences():
    m = _lstm(num_layers=2)
    x, t = torch.randn(5, 2, 4), torch.randn(5, 2, 4)
    out, tangent = ft.jvp(lambda x: m(x)[0], (x,), (t,))
    eps = 1e-3
    fd = (m(x + eps * t)[0] - m(x - eps * t)[0]) / (2 * eps)
    torch.testing.assert_close(tangent, fd.detach(), rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(out, m(x)[0].detach())
