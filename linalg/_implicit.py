"""Implicit derivatives of structured solves, exact or iterative.

# Note [Implicit differentiation of structured solves]
``X = A^{-1} B`` for a structured A (a Kronecker product plus noise, say) is computed through A's
factorizations (the factors' eigendecompositions). Differentiating those op by op is right in
exact arithmetic but unstable: near-equal eigenvalues of a factor make its eigenvector tangents
explode, and forward mode through ``K1 ⊗ K2 + 0.01 I`` on a 64x64 RBF grid gave 23898 where the
answer is 6292.5. We differentiate the solve as a whole instead, in every mode and under every
autodiff system (ours, torch's autograd, torch's own transforms and forward AD), with one
construction that needs no autodiff of its own:

    X = Xc + S(B - A(leaves) @ Xc; leaves),    Xc = A^{-1} B on constant copies (no graph)

``S(R; leaves)`` is one ``torch.autograd.Function`` (`ImplicitSolve`) whose value is zero and
whose rules are solves: jvp ``S'(R_dot) = A^{-1} R_dot``, vjp ``S^T(G) = A^{-H} G``, each computed
by this same construction (so they are differentiable again), and no derivative with respect to
the leaves. The residual ``B - A(leaves) @ Xc`` is ordinary torch code (A's own structured
matmul), differentiated by whichever system is active. Then ``dX = A^{-1}(dB - dA Xc)`` and
``B_bar = A^{-H} X_bar``, ``A_bar = -B_bar Xc^H`` on A's tensors, never a derivative of the
factorization. As a function of the leaves, ``Xc + A^{-1}(B - A Xc)`` *is* ``A^{-1} B`` for the
fixed ``Xc``, and S's missing leaf derivative ``-A^{-1} dA A^{-1} R`` is a multiple of the
residual R = 0: exact to first order, and to second with the correction of Note [Second-order
exactness of the implicit solve].

Because S is a ``torch.autograd.Function`` with ``setup_context``, ``jvp`` and
``generate_vmap_rule``, torch's autograd and torch's transforms use it as any Function, and our
transforms run the same staticmethods (Note [autograd.Function under transforms]). Iterative
solves use the same S with the iterative method in its rules (``method``): the forward result
``Xc`` then comes from CG on constants and the derivatives are exact to the solver's tolerance.
When nothing can differentiate (plain tensors that do not require grad, no transform active)
the solve runs directly.

# Note [Second-order exactness of the implicit solve]
S has no derivative with respect to A's tensors, but the true one, ``-A^{-1} dA A^{-1} R``, has
a nonzero derivative in R: with one correction the second derivative misses
``-A^{-1} A' X'``. A second correction ``X = Xc + E1 + S(B - A(Xc + E1))``, ``E1 = S(B - A Xc)``,
is exact to second order (each correction gains one order, as a Newton step with a frozen
inverse). The price: two solves per derivative instead of one. In reverse mode the cotangent
reaching the first correction is ``G - A^H A^{-H} G = 0`` and in forward mode the tangent
reaching the second is ``-dA E1 = 0``, but skipping them is wrong under a second
differentiation that reaches the corrections through saved values (reverse over reverse),
which the rule cannot see. Third derivatives (rules of a rule's solve) raise
NotImplementedError: never a wrong number.

Inverses too: when A's tensors can be differentiated, ``inv(A)`` of a structured A is an
`InverseOperator`, whose matmul is this implicit solve, so ``inv(K) @ v`` has the derivatives of
``solve(K, v)`` (otherwise ``inv`` returns the structured inverse, a Kronecker of inverses, say).
"""

from __future__ import annotations

import torch

from functransforms import _compat
from functransforms._core.levels import TransformTensor
from functransforms._pytree import tree_flatten, tree_unflatten

from ._base import LinearOperator
from ._rules import inv, slogdet, solve


def differentiable(tensors) -> bool:
    """Whether an autodiff system differentiates one of ``tensors``: one of our grad/jvp
    levels wraps it, or one of torch's (its transforms' grad/jvp levels, autograd, forward AD)
    does. Batching levels alone do not count."""
    return any(_differentiated(t) for t in tensors)


def _differentiated(t) -> bool:
    while isinstance(t, TransformTensor):
        if not hasattr(t, "_bdim"):  # a grad or jvp level of ours
            return True
        t = t._value
    return _compat.torch_differentiates(t)


def can_differentiate(A: LinearOperator) -> bool:
    """Whether A's tensors can be differentiated (by our transforms or by torch's)."""
    return differentiable(_tensors(tree_flatten(A)[0]))


def _tensors(leaves):
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def _op(spec, leaves):
    return tree_unflatten(spec, list(leaves))


def _constant(t):
    return t.detach() if isinstance(t, torch.Tensor) else t


def implicit_solve(A, B: torch.Tensor, method=None, order: int = 1, forward=None) -> torch.Tensor:
    """``A^{-1} B`` (``B`` of shape ``(..., n, k)``) with implicit derivatives (Note [Implicit
    differentiation of structured solves]). ``method``: None (exact, A's structure rule) or
    an iterative method ``(A, B) -> X`` (run on constants; it records its info). A method with
    an ``adjoint()`` gives the method for the adjoint solves of a non-symmetric A (its
    preconditioner adjointed, say). ``order``: the derivative order the result is built for (1
    from users, one more in S's rules). ``forward``: a callable ``() -> X`` computing the value
    on constants by another route (LSMR on ``min |A0 X - B0|`` for the normal equations
    ``A = A0^H A0``, ``B = A0^H B0``); the derivatives are still ``method``'s solves with A."""
    if method is None and forward is None:
        X = A._solve_closed_form(B)  # Note [Kronecker plus noise in its eigenbasis]
        if X is not None:
            return X
    leaves, spec = tree_flatten(A)
    if not differentiable([B, *_tensors(leaves)]):
        return forward() if forward is not None else _forward_solve(A, B, method)
    Ac = _op(spec, [_constant(t) for t in leaves])
    Xc = forward() if forward is not None else _forward_solve(Ac, B.detach(), method)
    # Two corrections: exact to second order (Note [Second-order exactness of the implicit
    # solve]).
    R = B - A._matmul(Xc)
    E = ImplicitSolve.apply(R, spec, method, 2 * order, *leaves)
    R = B - A._matmul(Xc + E)
    return Xc + (E + ImplicitSolve.apply(R, spec, method, 2 * order + 1, *leaves))


MAX_ORDER = 2


def _forward_solve(A, B, method):
    return solve(A, B) if method is None else method(A, B)


def _check_order(ctx):
    if ctx.order // 2 > MAX_ORDER:
        A = _op(ctx.spec, ctx.saved_tensors)
        raise NotImplementedError(
            f"a derivative of order {ctx.order // 2} of torch.linalg.solve({A!r}, B): structured "
            f"solves are differentiated exactly up to order {MAX_ORDER} (grad, jvp, vjp, "
            "hessian, double backward). Expected: at most second derivatives; for higher ones, "
            "solve with A.to_dense()."
        )


class ImplicitSolve(torch.autograd.Function):
    """``S(R; A)`` of Note [Implicit differentiation of structured solves]: the value zero,
    derivatives ``A^{-1} R_dot`` (jvp) and ``A^{-H} G`` (vjp), none for A's tensors.
    ``order``: 2 x (the derivative order its rules serve) + (which correction, 0 or 1)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(R, spec, method, order, *leaves):
        return torch.zeros_like(R)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.spec, ctx.method, ctx.order, *leaves = inputs
        ctx.save_for_backward(*leaves)
        ctx.save_for_forward(*leaves)

    @staticmethod
    def backward(ctx, G):
        leaves = ctx.saved_tensors
        none = (None, None, None, None) + (None,) * len(leaves)
        _check_order(ctx)
        A = _op(ctx.spec, leaves)
        if A.symmetric and not A.is_complex:
            AH, method = A, ctx.method
        else:
            AH = A._adjoint()
            method = ctx.method.adjoint() if hasattr(ctx.method, "adjoint") else ctx.method
        return (implicit_solve(AH, G, method, ctx.order // 2 + 1),) + none[1:]

    @staticmethod
    def jvp(ctx, R_dot, *_):
        _check_order(ctx)
        A = _op(ctx.spec, ctx.saved_tensors)
        return implicit_solve(A, R_dot, ctx.method, ctx.order // 2 + 1)


class InverseOperator(LinearOperator):
    """``A^{-1}`` applied by implicitly differentiated solves (what `inv` returns for a
    structured A whose tensors can be differentiated; Note [Implicit differentiation of
    structured solves]).

    Example:
        >>> import torch
        >>> from functransforms.linalg import DiagonalOperator, InverseOperator
        >>> Ainv = InverseOperator(DiagonalOperator(torch.tensor([2.0, 4.0])))  # [2, 2]
        >>> (Ainv @ torch.ones(2)).tolist()  # [2]
        [0.5, 0.25]
    """

    _tree_fields = ("base",)

    def __init__(self, base: LinearOperator, **props):
        if not isinstance(base, LinearOperator) or not base.is_square:
            raise TypeError(
                f"InverseOperator(base): expected a square LinearOperator, received {base!r}."
            )
        self.base = base
        # A^{-1} keeps symmetry, definiteness, triangularity and unitarity.
        super().__init__(base.shape, base.dtype, base.device, **{**base.properties(), **props})

    def _repr_extra(self):
        return repr(self.base)

    def _matmul(self, X):
        return implicit_solve(self.base, X)

    def _rmatmul(self, X):
        # X A^{-1} = (A^{-T} X^T)^T
        return implicit_solve(self.base._transpose(), X.mT).mT

    def _to_dense(self):
        eye = torch.eye(self.shape[-1], dtype=self.dtype, device=self.device)
        return implicit_solve(self.base, eye)

    def _transpose(self):
        # (A^{-1})^T = (A^T)^{-1}
        return InverseOperator(self.base._transpose())

    def _adjoint(self):
        # (A^{-1})^H = (A^H)^{-1}
        return InverseOperator(self.base._adjoint())


@inv.register(InverseOperator)
def _inv_inverse(A):
    # inv(A^{-1}) = A
    return A.base


@solve.register(InverseOperator)
def _solve_inverse(A, B):
    # (A^{-1})^{-1} B = A B
    return A.base._matmul(B)


@slogdet.register(InverseOperator)
def _slogdet_inverse(A):
    # det(A^{-1}) = 1 / det(A): the sign (of modulus 1) conjugated, the log negated
    sign, logabs = slogdet(A.base)
    return sign.conj(), -logabs
