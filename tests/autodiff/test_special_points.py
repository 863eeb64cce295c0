"""Derivatives at special points of every differentiable OpInfo, against torch.func.

Note [Special-point sweep]
    The conformance suite (tests/conformance) compares ours with torch.func at random sample
    inputs, which never land where a function is not differentiable or a formula divides by
    zero: ties, zeros, constant inputs, the kinks of piecewise functions. There torch picks a
    value (a subgradient, a masked zero, inf or nan) and torch.func returns it; a different
    number from us is a silent wrong result for anyone who checks against torch.func. This
    sweep takes each op's first OpInfo sample (float64), replaces the values of its
    differentiable inputs with special values, and compares, in one forward-over-reverse call,
    the outputs, the vjp (random cotangents), the jvp (random tangents) and the jvp of the vjp
    (second order), with ``equal_nan``. Ops without forward AD compare the vjp only.

    Variants (``_variants``), each drawn from the values allowed for the input (``_allowed``):
    * ``levels``: values from {0, 1, -1} (or {1/2, 1, 2} ...) in one pattern shared by the
      inputs of the same shape: zeros, ties within an input (max, sort, median, norm) and
      across inputs (maximum, atan2 at the origin, clamp with tensor bounds);
    * ``levels_mixed``: the same values, an independent pattern per input;
    * ``constant``: every element equal (std, var, normalize, softmax);
    * ``boundaries``: also the op's scalar arguments and their negatives (clamp's bounds,
      threshold, softshrink's lambda) and the kinks 3, -3, 6 (hardswish, hardsigmoid, relu6).
    The values stay where the op's samples are: inside the hull of the sample's values (small
    samples: its sign), inside ``op.domain``: no 0 for an op whose samples are positive.
    Where torch.func raises, the case is skipped. Seeds come from the op's name, as in the
    conformance harness (Note [Conformance determinism]).

    A mismatch is either fixed (our rule made to follow torch's formula) or, where torch is
    mathematically wrong, documented in docs/torch_func_differences.md section 8 and listed in
    ``SKIP``; what is not fixed yet is an xfail(strict=True) in ``XFAIL``.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings

import pytest
import torch
import torch.utils._pytree as tpt

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "conformance"))

from conformance_compositions import _function  # noqa: E402
from conformance_harness import (  # noqa: E402
    COMPLEX,
    REAL,
    _leaves,
    _seed_of,
    _strided,
    compare,
    describe,
    grad_dtypes,
    op_db,
    take_samples,
)
from conformance_harness import (
    SKIP as CONFORMANCE_SKIP,
)
from conformance_references import oracle_op  # noqa: E402

import functransforms as ft  # noqa: E402
from functransforms._compat import TORCH_VERSION  # noqa: E402

_SINGULAR = "singular matrices are outside the domain (inf/nan patterns of a division by 0)"
SKIP: dict[str, str] = {
    **CONFORMANCE_SKIP,
    **{
        name: _SINGULAR
        for name in (
            "linalg.householder_product linalg.lu linalg.lu_factor linalg.lu_factor_ex "
            "linalg.lu_solve lu lu_solve lu_unpack ormqr triangular_solve linalg.solve_ex "
            "linalg.cond[complex] linalg.matrix_sqrth linalg.polar"  # the last two: torch 2.15
        ).split()
    },
}

# torch.func is wrong here, ours agree with finite differences: torch_func_differences.md 8
_WRONG_IN_TORCH = "torch.func is wrong at ties/zeros here (torch_func_differences.md 8)"
SKIP["linalg.eigh[complex]"] = "repeated eigenvalues: the derivative divides by their gap"
SKIP.update(
    {
        name: _WRONG_IN_TORCH
        for name in (
            "to_sparse scatter_reduce.amax scatter_reduce.amin "
            "_segment_reduce.lengths _segment_reduce.offsets"
        ).split()
    }
)

XFAIL: dict[str, str] = {}

_BASE = (0.0, 1.0, -1.0, 0.5, -0.5, 2.0)
_KINKS = (3.0, -3.0, 6.0)  # hardswish / hardsigmoid (+-3), relu6 (6)


def _allowed(x, op):
    """(lo, hi) the special values of input x must lie in (Note [Special-point sweep])."""
    lo, hi = x.min().item(), x.max().item()
    if x.numel() < 8:  # too few values for a hull: keep the sign only
        lo = (0.0 if lo == 0 else 1e-300) if lo >= 0 else -float("inf")
        hi = float("inf")
    dom = getattr(op, "domain", None) or (None, None)
    if dom[0] is not None:
        lo = max(lo, dom[0] + 1e-300)
    if dom[1] is not None:
        hi = min(hi, dom[1] - 1e-12)
    return lo, hi


_COMPLEX = (0.0, 1.0, 1j, -1.0, -1j)


def _pick(x, op, candidates):
    if x.is_complex():  # complex samples are spread over the plane: no range to keep
        return list(dict.fromkeys(c for c in _COMPLEX + candidates if c in _COMPLEX))
    lo, hi = _allowed(x, op)
    return list(dict.fromkeys(c for c in candidates if lo <= c <= hi))


def _scalars(leaves):
    out = []
    for v in leaves:
        if isinstance(v, float) and abs(v) < float("inf"):
            out += [v, -v]
    return tuple(out)


def _variants(primals, leaves, op, gen):
    """name -> special values for each differentiable input (Note [Special-point sweep])."""
    if any(p.numel() == 0 for p in primals):
        return {}
    base = [_pick(p, op, _BASE)[:3] for p in primals]
    if any(not b for b in base):
        return {}
    shared = {}

    def pattern(shape, n):
        if (shape, n) not in shared:
            shared[shape, n] = torch.randint(0, n, shape, generator=gen)
        return shared[shape, n]

    def fill(p, values, idx):
        return torch.tensor(values, dtype=p.dtype)[idx]

    bounds = [_pick(p, op, _BASE + _scalars(leaves) + _KINKS) for p in primals]
    return {
        "levels": [fill(p, b, pattern(tuple(p.shape), len(b))) for p, b in zip(primals, base)],
        "levels_mixed": [
            fill(p, b, torch.randint(0, len(b), p.shape, generator=gen))
            for p, b in zip(primals, base)
        ],
        "constant": [torch.full_like(p, b[0]) for p, b in zip(primals, base)],
        "boundaries": [
            fill(p, b, torch.randint(0, len(b), p.shape, generator=gen))
            for p, b in zip(primals, bounds)
        ],
    }


def _forward_over_reverse(vjp, f, n):
    """g(*primals, *cotangents) = (outputs, vjp): its jvp holds outputs, vjp, jvp and the
    jvp of the vjp at once."""

    def g(*args):
        out, pullback = vjp(f, *args[:n])
        return out, pullback(args[n:])

    return g


def _run(transform, f, args, tangents, n, torch_func):
    if torch_func:
        vjp, jvp = torch.func.vjp, torch.func.jvp
    else:
        vjp, jvp = ft.vjp, ft.jvp
    if transform == "jvp(vjp)":
        return jvp(_forward_over_reverse(vjp, f, n), args, tangents)
    return _forward_over_reverse(vjp, f, n)(*args)


_PARTS = {
    "jvp(vjp)": ("outputs and vjp", "jvp and jvp of the vjp"),
    "vjp": ("outputs", "vjp"),
}


def check_op(name, kind=REAL, variants=None):
    """The mismatches of ``name`` at its special points, as messages (empty: all agree)."""
    op = op_db()[name]
    dtype = torch.complex128 if kind == COMPLEX else torch.float64
    bad = []
    compared = 0
    samples = take_samples(op, dtype, (name, "special", kind), requires_grad=True)[:1]
    for j, sample in enumerate(samples):
        leaves, spec = _leaves(sample)
        if not all(_strided(x) for x in leaves):
            continue
        f, diff = _function(op, spec, leaves, sample)
        if not diff:
            continue
        ref_f = functools.partial(f, op=oracle_op(op, name, kind))
        gen = torch.Generator().manual_seed(_seed_of(name, "special", kind, j))
        primals0 = [leaves[k].detach() for k in diff]
        make = variants or _variants
        for variant, primals in make(primals0, leaves, op, gen).items():
            n = len(primals)
            try:
                out0 = torch.func.vjp(ref_f, *[p.clone() for p in primals])[0]
            except Exception:
                continue  # torch.func raises here: nothing to compare
            if not out0:
                continue
            cts = [torch.randn(o.shape, dtype=o.dtype, generator=gen) for o in out0]
            tangents = tuple(
                torch.randn(x.shape, dtype=x.dtype, generator=gen) for x in (*primals, *cts)
            )

            def args(primals=primals, cts=cts):
                return tuple(x.clone() for x in (*primals, *cts))

            ref = None
            for transform in ("jvp(vjp)", "vjp"):
                if transform == "jvp(vjp)" and not op.supports_forward_ad:
                    continue
                try:
                    ref = _run(transform, ref_f, args(), tangents, n, True)
                    break
                except Exception:
                    continue
            if ref is None:
                continue
            what = f"{variant} {describe(sample)} {transform}"
            try:
                ours = _run(transform, f, args(), tangents, n, False)
            except Exception as e:
                bad.append(f"{what}: raises {type(e).__name__}: {str(e)[:200]}")
                continue
            for part, a, b in zip(_PARTS[transform], ours, ref):
                wrong = compare(tpt.tree_leaves(a), tpt.tree_leaves(b), part)
                if wrong:
                    bad.append(f"{what}: {wrong[1]}")
                    break
            compared += 1
    return bad, compared


def _params():
    """(op, kind) for each op differentiable in float64 (complex128); XFAIL and SKIP are keyed
    by op name (``name`` or ``name[complex]``)."""
    out = []
    for name, op in sorted(op_db().items()):
        for kind in (REAL, COMPLEX):
            if not grad_dtypes(op, "vjp", kind):
                continue
            key = name if kind == REAL else f"{name}[complex]"
            marks = []
            skip = SKIP.get(name) or SKIP.get(key)
            if skip:
                marks.append(pytest.mark.skip(reason=skip))
            elif key in XFAIL:
                marks.append(pytest.mark.xfail(strict=True, reason=XFAIL[key]))
            out.append(pytest.param(name, kind, marks=marks, id=f"{name}-{kind}"))
    return out


@pytest.mark.parametrize("name,kind", _params())
def test_special_points_match_torch_func(name, kind):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bad, _ = check_op(name, kind)
    assert not bad, f"{name}: ours differs from torch.func at special points:\n" + "\n".join(bad)


_INF = torch.tensor([0.0, 1.0, float("inf"), -float("inf")], dtype=torch.float64)


def _infinities(primals, leaves, op, gen):
    """0, 1 and +-inf, for ops defined on the whole real line (samples of both signs, no
    op.domain): where torch's derivative is inf or a masked 0, ours must be the same."""
    if any(p.numel() == 0 or p.min() >= 0 for p in primals):
        return {}
    if getattr(op, "domain", None) not in (None, (None, None)):
        return {}
    return {"inf": [_INF[torch.randint(0, 4, p.shape, generator=gen)] for p in primals]}


_INF_VALUE = "the forward value at +-inf differs (a decomposition's 0 * inf or inf - inf)"
_INF_DERIV = "inf vs nan in a derivative at +-inf (not examined yet)"
XFAIL_INF: dict[str, str] = {
    **{
        name: _INF_VALUE
        for name in (
            "grid_sampler_2d nn.functional.grid_sample nn.functional.interpolate.bilinear "
            "nn.functional.interpolate.linear nn.functional.interpolate.trilinear "
            "nn.functional.upsample_bilinear logcumsumexp"
        ).split()
    },
    **{
        name: _INF_DERIV
        for name in (
            "cumprod masked.cumprod scatter_reduce.prod "
            "linalg.solve_triangular linalg.vander "
            "nn.functional.triplet_margin_loss nn.functional.triplet_margin_with_distance_loss"
        ).split()
    },
}


if TORCH_VERSION >= (2, 15):  # torch 2.15's samples differ (p = 1 cdist, sdpa with is_causal)
    XFAIL_INF.update(
        {
            "cdist": _INF_DERIV,
            "nn.functional.scaled_dot_product_attention": _INF_DERIV,
            "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu": _INF_VALUE,
        }
    )

# ours on purpose: at x = y = -inf (masked.logaddexp's masked-out elements) the derivative is 0
_MASKED_LOGADDEXP = "derivative 0 at x = y = -inf, torch nan (masked-out elements)"
SKIP_INF = {name: _MASKED_LOGADDEXP for name in ("logaddexp", "logaddexp2", "masked.logaddexp")}


def _inf_params():
    out = []
    for name, op in sorted(op_db().items()):
        if not grad_dtypes(op, "vjp", REAL) or name in SKIP:
            continue
        marks = []
        if name in SKIP_INF:
            marks.append(pytest.mark.skip(reason=SKIP_INF[name]))
        elif name in XFAIL_INF:
            marks.append(pytest.mark.xfail(strict=True, reason=XFAIL_INF[name]))
        out.append(pytest.param(name, marks=marks, id=name))
    return out


@pytest.mark.parametrize("name", _inf_params())
def test_infinities_match_torch_func(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bad, _ = check_op(name, REAL, _infinities)
    assert not bad, f"{name}: ours differs from torch.func at +-inf:\n" + "\n".join(bad)


def test_binary_cross_entropy_hessian_at_0_through_jacrev():
    """binary_cross_entropy_backward has a vmap rule running the kernel (before, its
    decomposition's clamp reached the jvp level: d2/dx2 at x = target = 0 was 1/(3 eps))."""
    x = torch.tensor([0.5, 0.0, 1.0], dtype=torch.float64)
    y = x.clone()

    def f(x):
        return torch.nn.functional.binary_cross_entropy(x, y)

    ours = ft.jacfwd(ft.jacrev(f))(x)
    theirs = torch.func.jacfwd(torch.func.jacrev(f))(x)
    torch.testing.assert_close(ours, theirs, equal_nan=True)


def test_binary_cross_entropy_gradient_at_0_and_1_is_finite_as_torch():
    """Note [binary_cross_entropy at 0 and 1] (autodiff/nn.py): a saturated probability."""
    x = torch.tensor([0.0, 1.0, 1.0, 0.3], dtype=torch.float64)
    y = torch.tensor([0.0, 1.0, 0.5, 0.3], dtype=torch.float64)

    def f(x, y):
        return torch.nn.functional.binary_cross_entropy(x, y)

    for argnums in (0, 1):
        ours = ft.grad(f, argnums=argnums)(x, y)
        torch.testing.assert_close(ours, torch.func.grad(f, argnums=argnums)(x, y))
    assert ft.grad(f)(x, y)[:2].eq(0).all()


def test_acosh_complex_left_half_plane():
    """d acosh z = 1 / (sqrt(z - 1) sqrt(z + 1)); rsqrt(z^2 - 1) has the wrong sign for Re z < 0
    (the sweep found it on the cut at z = -3; OpInfo's samples have Re z > 1)."""
    z = torch.tensor([-3 + 1j, -0.5 - 0.2j, -3 + 0j, 2 + 1j], dtype=torch.complex128)
    t = torch.full_like(z, 0.3 - 1j)
    ours = ft.jvp(torch.acosh, (z,), (t,))[1]
    torch.testing.assert_close(ours, torch.func.jvp(torch.acosh, (z,), (t,))[1])
    h = 1e-7
    fd = (torch.acosh(z + h * t) - torch.acosh(z - h * t)) / (2 * h)
    torch.testing.assert_close(ours[:2], fd[:2])  # off the cut, where acosh is holomorphic


def test_segment_max_tie_with_initial_split_among_the_data():
    """torch splits a tie among the data only, not with initial (the sweep skips segment_reduce:
    with negative cotangents torch is wrong, torch_func_differences.md 8)."""
    x = torch.tensor([1.0, 0.0, 1.0, 1.0, 5.0], dtype=torch.float64)

    def f(t):
        return torch.segment_reduce(t, "max", lengths=torch.tensor([2, 2, 1]), initial=1.0).sum()

    torch.testing.assert_close(ft.grad(f)(x), torch.func.grad(f)(x))
    torch.testing.assert_close(ft.grad(f)(x), x.new_tensor([1.0, 0.0, 0.5, 0.5, 1.0]))


_KINK_ACTIVATIONS = {
    "elu": lambda x: torch.nn.functional.elu(x, alpha=0.5),
    "selu": torch.nn.functional.selu,
    "celu": lambda x: torch.nn.functional.celu(x, 0.7),
    "hardswish": torch.nn.functional.hardswish,
    "softplus": lambda x: torch.nn.functional.softplus(x, beta=2, threshold=5),
    "prelu": lambda x: torch.nn.functional.prelu(x.reshape(1, -1), x.new_tensor([0.25])),
    "logsigmoid": torch.nn.functional.logsigmoid,
}


@pytest.mark.parametrize("name", sorted(_KINK_ACTIVATIONS))
def test_second_order_of_activations_at_their_kinks(name):
    """The sweep's jvp of vjp runs no vmap: hessian (jacfwd of jacrev) and jacrev of jacrev do.
    Under vmap elu_backward, softplus_backward, hardswish_backward and prelu's kernels ran
    their decompositions, whose masks at the kinks are not torch's (hessian of elu at 0: 1,
    torch 0.5), and hardswish_backward's derivative in its grad had the ends swapped (1.5 at
    x = 3, torch 1)."""
    a = _KINK_ACTIVATIONS[name]
    x = torch.tensor([-3.0, -1.0, 0.0, 0.5, 3.0, 20.0, 2.5, 1e-3], dtype=torch.float64)

    def f(x):
        y = a(x)
        return (y * y).sum() + y.sum()

    for ours, ref in [
        (ft.hessian(f), torch.func.hessian(f)),
        (ft.jacrev(ft.jacrev(f)), torch.func.jacrev(torch.func.jacrev(f))),
    ]:
        torch.testing.assert_close(ours(x), ref(x))
    xs = x.reshape(2, 4)
    loop = torch.stack([torch.func.hessian(f)(r) for r in xs])
    torch.testing.assert_close(ft.vmap(ft.hessian(f))(xs), loop)
    # the outer level sees the op the inner vmap batched (log_sigmoid_forward decomposed: 0)
    h = ft.hessian(lambda xs: ft.vmap(f)(xs).sum())(xs)  # [2, 4, 2, 4], block diagonal
    torch.testing.assert_close(torch.stack([h[i, :, i] for i in range(2)]), loop)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_hessian_of_binary_cross_entropy_at_zero_and_one(reduction):
    """Under vmap binary_cross_entropy_backward ran its decomposition (a clamp of x (1 - x)),
    so the hessian at x = 0 or 1 was the clamp's, not torch's formula (Note
    [binary_cross_entropy at 0 and 1])."""
    t = torch.tensor([0.2, 0.0, 1.0, 1.0, 0.5], dtype=torch.float64)
    p = torch.tensor([0.0, 1e-7, 0.5, 1.0, 1 - 1e-7], dtype=torch.float64)
    f = lambda p: torch.nn.functional.binary_cross_entropy(
        p, t, weight=t + 1, reduction=reduction
    ).sum()
    torch.testing.assert_close(ft.hessian(f)(p), torch.func.hessian(f)(p))
    ps = torch.stack([p, p.flip(0)])
    torch.testing.assert_close(
        ft.vmap(ft.hessian(f))(ps), torch.stack([torch.func.hessian(f)(r) for r in ps])
    )
