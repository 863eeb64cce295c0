"""The conformance references (Note [Conformance references]): each computes its op's values,
torch.func differentiates it right (finite differences, to second order), and torch.func
differentiates the op itself wrong (so the entry is still needed; when torch fixes its formula
this test fails: drop the entry)."""

import pytest
import torch
from conformance_harness import op_db, take_samples
from conformance_references import REFERENCES
from torch import func as tf

F64, C128 = torch.float64, torch.complex128
EPS = 1e-6


def _x(*shape, seed=0, dtype=F64):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _inner(u, v):
    """The real inner product Re sum(conj(u) v) (Note [Complex dot-product test])."""
    return (u.conj() * v).real.sum()


def _hvp(vjp, f, primals, ct, tangents):
    """jvp of the pullback (forward over reverse), with the cotangent held fixed."""
    return tf.jvp(lambda *p: vjp(f, *p)[1](ct), primals, tangents)[1]


def _pullback_differences(f, primals, ct, tangents):
    """Central differences of torch.func's pullback of f along the tangents."""
    moved = [
        tf.vjp(f, *[p + s * EPS * t for p, t in zip(primals, tangents)])[1](ct) for s in (1, -1)
    ]
    return [(a - b) / (2 * EPS) for a, b in zip(*moved)]


def _function_differences(f, primals, tangents):
    hi = f(*[p + EPS * t for p, t in zip(primals, tangents)])
    lo = f(*[p - EPS * t for p, t in zip(primals, tangents)])
    return (hi - lo) / (2 * EPS)


def _close(a, b, tol=1e-6):
    return all(torch.allclose(u, v, atol=tol, rtol=tol) for u, v in zip(a, b))


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_reference_computes_the_op(name):
    op = op_db()[name]
    ref, kinds, _ = REFERENCES[name]
    for kind in kinds:
        dtype = F64 if kind == "real" else torch.complex128
        if dtype not in op.supported_dtypes("cpu"):
            continue
        for s in take_samples(op, dtype, (name, "reference")):
            torch.testing.assert_close(
                ref(s.input, *s.args, **s.kwargs), op(s.input, *s.args, **s.kwargs)
            )


def _cases():
    index = torch.tensor([[0, 1, 2], [0, 0, 2], [3, 1, 2], [0, 4, 4], [5, 1, 0]])
    wide = _x(3, 6) * 3
    wide[1, 2] = 1e4  # a spread of 1e4 along the scan
    wide_c = _x(3, 6, dtype=C128) * 3
    wide_c[1, 2] = 1e4
    return {
        "as_strided_scatter": (
            lambda x, s, op: op(x, s, (2, 2), (1, 2), storage_offset=1),
            (_x(3, 3), _x(2, 2, seed=1)),
            torch.as_strided_scatter,
        ),
        "logcumsumexp": (lambda x, op: op(x, 1), (wide,), torch.logcumsumexp),
        "logcumsumexp-complex": (lambda x, op: op(x, 1), (wide_c,), torch.logcumsumexp),
        "scatter_reduce.prod": (
            lambda x, s, op: op(x, 0, index, s, "prod", include_self=False),
            (_x(6, 3) + 2, _x(5, 3, seed=1) + 2),
            torch.scatter_reduce,
        ),
        "triangular_solve": (
            lambda b, a, op: op(b, a, upper=False, unitriangular=True)[0],
            (_x(4, 3), _x(4, 4, seed=1) + 3 * torch.eye(4, dtype=F64)),
            torch.triangular_solve,
        ),
        "triangular_solve-complex": (
            lambda b, a, op: op(b, a, upper=True, transpose=True)[0],
            (_x(4, 3, dtype=C128), _x(4, 4, seed=1, dtype=C128) + 3 * torch.eye(4, dtype=C128)),
            torch.triangular_solve,
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "as_strided_scatter",
        "logcumsumexp",
        "logcumsumexp-complex",
        "scatter_reduce.prod",
        "triangular_solve",
        "triangular_solve-complex",
    ],
)
def test_reference_derivatives_are_right_and_torchs_are_not(case):
    call, primals, op = _cases()[case]
    name = case.removesuffix("-complex")
    ref = REFERENCES[name][0]
    dtype = primals[0].dtype
    ct = _x(*primals[0].shape, seed=7, dtype=dtype)
    tangents = tuple(_x(*p.shape, seed=8 + i, dtype=dtype) for i, p in enumerate(primals))
    f_ref = lambda *p: call(*p, op=ref)  # noqa: E731
    f_op = lambda *p: call(*p, op=op)  # noqa: E731
    # first order: the dot-product test <ct, J t> = <J^T ct, t> on the reference, J t by
    # finite differences of the op itself
    jt = _function_differences(f_op, primals, tangents)
    g = tf.vjp(f_ref, *primals)[1](ct)
    lhs, rhs = _inner(ct, jt), sum(_inner(a, t) for a, t in zip(g, tangents))
    torch.testing.assert_close(lhs, rhs, atol=1e-6, rtol=1e-6)
    # second order: jvp of the pullback against finite differences of the pullback
    fd = _pullback_differences(f_ref, primals, ct, tangents)
    assert _close(_hvp(tf.vjp, f_ref, primals, ct, tangents), fd)
    # torch.func on the op itself is wrong at first or second order
    g_op = tf.vjp(f_op, *primals)[1](ct)
    first_ok = _close(g_op, g)
    assert not (first_ok and _close(_hvp(tf.vjp, f_op, primals, ct, tangents), fd)), (
        f"torch.func now differentiates {name} right: drop it from REFERENCES"
    )
