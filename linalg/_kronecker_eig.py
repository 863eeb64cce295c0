"""Solve and log-determinant of ``(A_1 ⊗ ... ⊗ A_k) + s I`` in the factors' eigenbasis, each one
node with closed-form derivatives (the exact GP marginal likelihood on a grid).

# Note [Kronecker plus noise in its eigenbasis]
With ``A_i = Q_i Λ_i Q_i^T`` (symmetric real factors) and ``Λ = ⊗ λ_i + s`` (a grid of
``N = prod n_i`` eigenvalues), ``K = (⊗ A_i) + s I`` has

    K^{-1} B = (⊗ Q_i) diag(1 / Λ) (⊗ Q_i)^T B,        log det K = sum log Λ.

Both are one `torch.autograd.Function` each, fed the factors' eigendecompositions computed once
on constant copies (cached on the operator: a solve and a logdet of one operator share them),
and both are differentiated without differentiating the eigenvectors (whose derivatives blow up
at near-equal eigenvalues, which RBF factors have by the dozen):

* Solve, ``X = K^{-1} B`` (`KroneckerEigSolve`): ``dX = K^{-1}(dB - dK X)`` and
  ``B_bar = K^{-1} X_bar``, ``A_i_bar = -(pullback of A_i -> (⊗ A_j) X at B_bar)``,
  ``s_bar = -<B_bar, X>``. The pullback is two contractions of grids (``unfold_i(C)
  unfold_i(Z_i)^T``, with ``Z_i`` = X with every other factor applied), never a dense matrix.
  Every rule is this Function again plus ordinary products with the factors and X, so no
  order needs the two correction solves of Note [Implicit differentiation of structured
  solves] (for a general operator the pullback through ``A @ X`` needs autodiff; here it is
  closed form). As those, it is refused past the second order (NotImplementedError).
* Log-determinant (`KroneckerEigLogdet`): with ``f(λ_1, ..., λ_k, s) = sum log Λ``, its
  gradient is a spectral function of each factor, ``G_i = Q_i diag(w_i) Q_i^T``,
  ``w_i = df/dλ_i = sum_{other axes} O_i / Λ`` (``O_i``: the product of the other factors'
  eigenvalues on the grid), and ``g_s = sum 1 / Λ`` (`KroneckerEigLogdetGrad`). Its own
  derivative (the Hessian, `KroneckerEigLogdetHessian`) is Daleckii-Krein's formula
  ``dG_i = Q_i (Γ_i ∘ E_i^T + diag(eigenvalue cross terms)) Q_i^T``, ``E_i = Q_i^T dA_i Q_i``,
  where the divided differences of ``w_i`` have a closed form with no eigenvalue gap in a
  denominator:

      (w_i[a] - w_i[b]) / (λ_i[a] - λ_i[b]) = -sum_{other axes} O_i^2 / (Λ_a Λ_b)
      = -(M_i M_i^T)[a, b],   M_i = unfold_i(O_i / Λ),

  so ``Γ_i`` is one matrix product, exact at equal eigenvalues too (its diagonal is
  ``d w_i[a] / d λ_i[a]``). ``E_i^T`` (not ``E_i``) because the map is the second derivative
  of ``log det`` as a function of all matrices (what the dense ``torch.logdet`` gives in a
  non-symmetric direction). The cross terms are ``d²f/dλ_i dλ_l = s O_il / Λ²``,
  ``d²f/dλ_i ds = -O_i / Λ²``, ``d²f/ds² = -1 / Λ²``. The Hessian map is symmetric, so the
  same function gives its jvp and its vjp. A third derivative raises NotImplementedError
  (the Hessian map's inputs are constants), as the implicit solves do.

The Python cost matters as much as the arithmetic: under a Python-level grad each recorded op
costs ~15-20 us, so the solve and the logdet are one tape node each, with the factor
eigendecompositions (the O(sum n_i^3) part) computed once, on plain values.
"""

from __future__ import annotations

import inspect
import math

import torch

from ._implicit import MAX_ORDER, differentiable


def call(cls, *args):
    """``cls.apply(*args)``, or its forward alone when no autodiff system differentiates an
    argument (the backward pass of our grad runs on plain tensors: no Function needed)."""
    if differentiable([a for a in args if isinstance(a, torch.Tensor)]):
        return cls.apply(*args)
    return cls.forward(*args)


def _presigned(cls):
    """torch's ``Function.apply`` binds its arguments with ``inspect.signature(forward)``,
    which honours a precomputed ``__signature__`` (~6 us a call saved)."""
    f = cls.forward
    f.__signature__ = inspect.signature(f)
    return cls


def _sum_to(t: torch.Tensor, shape) -> torch.Tensor:
    """``t`` summed over the dimensions that broadcasting added to a tensor of ``shape``."""
    if t.shape == shape:
        return t
    lead = t.dim() - len(shape)
    if lead:
        t = t.sum(tuple(range(lead)))
    dims = [i for i, (a, b) in enumerate(zip(t.shape, shape)) if b == 1 and a != 1]
    return t.sum(dims, keepdim=True) if dims else t


def apply_axis(X: torch.Tensor, M: torch.Tensor, ns, i: int, c: int) -> torch.Tensor:
    """``M`` (``(..., m, n_i)``) applied along grid axis ``i`` of ``X`` (``(..., N, c)``, the
    row-major grid ``n_0 x ... x n_{k-1}`` times ``c`` columns): one (batched) matmul."""
    n = ns[i]
    before = math.prod(ns[:i])
    after = math.prod(ns[i + 1 :]) * c
    batch = X.shape[:-2]
    if after == 1:  # the last axis of a single column: rows of X times M^T
        Y = X.reshape(batch + (before, n)) @ M.mT
        return Y.reshape(Y.shape[:-2] + (-1, 1))
    if before == 1:
        Y = M @ X.reshape(batch + (n, after))
        return Y.reshape(Y.shape[:-2] + (-1, c))
    Y = M.unsqueeze(-3) @ X.reshape(batch + (before, n, after))
    return Y.reshape(Y.shape[:-3] + (-1, c))


def contract_axis(C: torch.Tensor, Z: torch.Tensor, ns, i: int, c: int) -> torch.Tensor:
    """``sum C[..., a, ...] Z[..., b, ...]`` over every grid axis but ``i`` and the columns:
    the ``(batch..., n_i, n_i)`` pullback of ``M -> apply_axis(Z, M)`` at ``C``."""
    n = ns[i]
    before = math.prod(ns[:i])
    after = math.prod(ns[i + 1 :]) * c
    if after == 1:
        return C.reshape(C.shape[:-2] + (before, n)).mT @ Z.reshape(Z.shape[:-2] + (before, n))
    if before == 1:
        return C.reshape(C.shape[:-2] + (n, after)) @ Z.reshape(Z.shape[:-2] + (n, after)).mT
    out = (
        C.reshape(C.shape[:-2] + (before, n, after))
        @ Z.reshape(Z.shape[:-2] + (before, n, after)).mT
    )
    return out.sum(-3)


def _as_matrix(X, ns):
    """Two factors, one column: ``(..., N, 1)`` as the ``(..., n_0, n_1)`` grid, where
    ``(A_0 ⊗ A_1) vec(M) = vec(A_0 M A_1^T)``."""
    return X.reshape(X.shape[:-2] + tuple(ns))


def _as_column(Y):
    return Y.reshape(Y.shape[:-2] + (-1, 1))


def eig_solve(B, Lam, Qs):
    """``((⊗ Q_i) diag(1 / Λ) (⊗ Q_i)^T) B`` for ``B`` of shape ``(..., N, c)``, ``Λ`` the flat
    grid ``⊗ λ_i + s`` of shape ``(..., N)``."""
    ns = [Q.shape[-1] for Q in Qs]
    c = B.shape[-1]
    if len(Qs) == 2 and c == 1:
        Q0, Q1 = Qs
        Y = (Q0.mT @ _as_matrix(B, ns) @ Q1) / Lam.unflatten(-1, ns)
        return _as_column(Q0 @ Y @ Q1.mT)
    Y = B
    for i, Q in enumerate(Qs):
        Y = apply_axis(Y, Q.mT, ns, i, c)
    Y = Y / Lam.unsqueeze(-1)
    for i, Q in enumerate(Qs):
        Y = apply_axis(Y, Q, ns, i, c)
    return Y


def _outer(vs):
    """``v_1 ⊗ ... ⊗ v_k`` of ``(..., n_i)`` vectors, flattened to ``(..., prod n_i)``."""
    out = vs[0]
    for v in vs[1:]:
        out = (out.unsqueeze(-1) * v.unsqueeze(-2)).flatten(-2)
    return out


def grid_eigenvalues(lams, s):
    """``Λ = ⊗ λ_i + s`` on the flat grid, ``(..., N)``."""
    return _outer(lams) + s.unsqueeze(-1)


def _others(lams, skip):
    """The product of the eigenvalues of the factors not in ``skip``, on the flat grid."""
    return _outer([torch.ones_like(lam) if j in skip else lam for j, lam in enumerate(lams)])


def _split(k, tensors):
    """``(A_i, λ_i, Q_i, Λ)`` from the flat tensor arguments."""
    return tensors[:k], tensors[k : 2 * k], tensors[2 * k : 3 * k], tensors[3 * k]


def _other_factors_applied(X, As, ns, c):
    """``Z_i``: X with every factor but the i-th applied, for each i."""
    k = len(As)
    if k == 1:
        return [X]
    if k == 2:
        return [apply_axis(X, As[1], ns, 1, c), apply_axis(X, As[0], ns, 0, c)]
    out = []
    for i in range(k):
        Z = X
        for j, A in enumerate(As):
            if j != i:
                Z = apply_axis(Z, A, ns, j, c)
        out.append(Z)
    return out


def _pullback(C, X, As):
    """``d <C, (⊗ A_i) X> / d A_i`` for each i (batch dimensions not summed yet)."""
    ns = [A.shape[-1] for A in As]
    c = X.shape[-1]
    if len(As) == 2 and c == 1:
        Cm, Xm = _as_matrix(C, ns), _as_matrix(X, ns)
        return [Cm @ As[1] @ Xm.mT, Cm.mT @ As[0] @ Xm]  # C A_1 X^T, C^T A_0 X
    Zs = _other_factors_applied(X, As, ns, c)
    return [contract_axis(C, Z, ns, i, c) for i, Z in enumerate(Zs)]


def _tangent_product(X, As, A_dots):
    """``(d ⊗ A_i) X = sum_i (A_0 ⊗ ... ⊗ dA_i ⊗ ...) X``, or None when every dA_i is None."""
    ns = [A.shape[-1] for A in As]
    c = X.shape[-1]
    out = None
    if len(As) == 2 and c == 1:
        Xm = _as_matrix(X, ns)
        if A_dots[0] is not None:
            out = A_dots[0] @ Xm @ As[1].mT
        if A_dots[1] is not None:
            t = As[0] @ Xm @ A_dots[1].mT
            out = t if out is None else out + t
        return None if out is None else _as_column(out)
    Zs = _other_factors_applied(X, As, ns, c)
    for i, (dA, Z) in enumerate(zip(A_dots, Zs)):
        if dA is not None:
            t = apply_axis(Z, dA, ns, i, c)
            out = t if out is None else out + t
    return out


def _check_order(ctx):
    # Note [Kronecker plus noise in its eigenbasis]: exact at every order in principle, refused
    # past the second as the implicit solves are (a third derivative under our transforms met
    # a core issue with vmap inside two differentiation levels: a wrong number, not an error)
    if ctx.order >= MAX_ORDER:
        raise NotImplementedError(
            f"a derivative of order {ctx.order + 1} of torch.linalg.solve("
            "KroneckerPlusScaledIdentityOperator, B): structured solves are differentiated "
            f"exactly up to order {MAX_ORDER} (grad, jvp, vjp, hessian, double backward). "
            "Expected: at most second derivatives; for higher ones, solve with A.to_dense()."
        )


@_presigned
class KroneckerEigSolve(torch.autograd.Function):
    """``X = ((⊗ A_i) + s I)^{-1} B`` from constants ``(λ_i, Q_i, Λ)`` (the factors'
    eigendecompositions and ``Λ = ⊗ λ_i + s``); derivatives in closed form (Note [Kronecker
    plus noise in its eigenbasis]). ``apply(B, s, k, order, *A_i, *λ_i, *Q_i, Λ)``, ``order``
    the derivative order the solve serves (0 for the value)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(B, s, k, order, *tensors):
        _, _, Qs, Lam = _split(k, tensors)
        return eig_solve(B, Lam, Qs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        B, s, ctx.k, ctx.order, *tensors = inputs
        ctx.B_shape = B.shape
        ctx.save_for_backward(output, s, *tensors)
        ctx.save_for_forward(output, s, *tensors)

    @staticmethod
    def backward(ctx, X_bar):
        _check_order(ctx)
        X, s, *tensors = ctx.saved_tensors
        k = ctx.k
        As = tensors[:k]
        # B_bar = K^{-T} X_bar: the same eigendecomposition (K is symmetric here), but the
        # factors transposed, so that a derivative of this solve in a non-symmetric direction
        # (a second derivative with respect to the factors' entries) is the dense one
        At = [A.mT for A in As]
        B_bar = call(KroneckerEigSolve, X_bar, s, k, ctx.order + 1, *At, *tensors[k:])
        # X = K^{-1} B: <X_bar, dX> = -<B_bar, dK X>
        A_bars = [_sum_to(-g, A.shape) for g, A in zip(_pullback(B_bar, X, As), As)]
        s_bar = _sum_to(-(B_bar * X).sum((-2, -1)), s.shape)
        return (_sum_to(B_bar, ctx.B_shape), s_bar, None, None, *A_bars) + (None,) * (2 * k + 1)

    @staticmethod
    def jvp(ctx, B_dot, s_dot, _, __, *tangents):
        _check_order(ctx)
        X, s, *tensors = ctx.saved_tensors
        k = ctx.k
        R = _tangent_product(X, tensors[:k], tangents[:k])  # dX = K^{-1}(dB - dK X - ds X)
        R = None if R is None else -R
        if s_dot is not None:
            t = s_dot[..., None, None] * X
            R = -t if R is None else R - t
        if B_dot is not None:
            R = B_dot if R is None else R + B_dot
        if R is None:
            return torch.zeros_like(X)
        return call(KroneckerEigSolve, R, s, k, ctx.order + 1, *tensors)


@_presigned
class KroneckerEigLogdet(torch.autograd.Function):
    """``log |det((⊗ A_i) + s I)| = sum log |Λ|``; gradient `KroneckerEigLogdetGrad`.
    ``apply(s, k, *A_i, *λ_i, *Q_i, Λ)``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(s, k, *tensors):
        # log |det|: the derivatives of log det, and slogdet's value for any sign
        return tensors[3 * k].abs().log().sum(-1)

    @staticmethod
    def setup_context(ctx, inputs, output):
        s, ctx.k, *tensors = inputs
        ctx.save_for_backward(s, *tensors)
        ctx.save_for_forward(s, *tensors)

    @staticmethod
    def backward(ctx, ct):
        s, *tensors = ctx.saved_tensors
        k = ctx.k
        *G, g_s = call(KroneckerEigLogdetGrad, s, k, *tensors)
        A_bars = [_sum_to(ct[..., None, None] * g, A.shape) for g, A in zip(G, tensors[:k])]
        return (_sum_to(ct * g_s, s.shape), None, *A_bars) + (None,) * (2 * k + 1)

    @staticmethod
    def jvp(ctx, s_dot, _, *tangents):
        s, *tensors = ctx.saved_tensors
        k = ctx.k
        *G, g_s = call(KroneckerEigLogdetGrad, s, k, *tensors)
        out = None
        for g, dA in zip(G, tangents[:k]):
            if dA is not None:
                t = (g * dA).sum((-2, -1))  # G symmetric: <G, dA> = tr(G dA)
                out = t if out is None else out + t
        if s_dot is not None:
            out = g_s * s_dot if out is None else out + g_s * s_dot
        return torch.zeros_like(g_s) if out is None else out


def _logdet_grad(lams, Qs, Lam):
    k = len(lams)
    ns = [lam.shape[-1] for lam in lams]
    R = 1 / Lam  # (..., N)
    if k == 2:
        Rm = R.unflatten(-1, ns)
        ws = [(Rm * lams[1].unsqueeze(-2)).sum(-1), (Rm * lams[0].unsqueeze(-1)).sum(-2)]
    else:
        ws = []
        for i in range(k):
            OR = (_others(lams, {i}) * R).unflatten(-1, ns)
            ws.append(OR.sum([j - k for j in range(k) if j != i]) if k > 1 else OR)
    G = [(Q * w.unsqueeze(-2)) @ Q.mT for Q, w in zip(Qs, ws)]
    return (*G, R.sum(-1))


@_presigned
class KroneckerEigLogdetGrad(torch.autograd.Function):
    """``(G_1, ..., G_k, g_s)``, the gradient of `KroneckerEigLogdet` with respect to the
    factors and s (Note [Kronecker plus noise in its eigenbasis]); its derivative is
    `KroneckerEigLogdetHessian`. ``apply(s, k, *A_i, *λ_i, *Q_i, Λ)``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(s, k, *tensors):
        _, lams, Qs, Lam = _split(k, tensors)
        return _logdet_grad(lams, Qs, Lam)

    @staticmethod
    def setup_context(ctx, inputs, output):
        s, ctx.k, *tensors = inputs
        ctx.save_for_backward(s, *tensors)
        ctx.save_for_forward(s, *tensors)

    @staticmethod
    def backward(ctx, *cts):
        s, *tensors = ctx.saved_tensors
        k = ctx.k
        # the Hessian is symmetric: the vjp is the same map as the jvp
        *H, h_s = call(KroneckerEigLogdetHessian, s, k, *tensors, *cts)
        A_bars = [_sum_to(h, A.shape) for h, A in zip(H, tensors[:k])]
        return (_sum_to(h_s, s.shape), None, *A_bars) + (None,) * (2 * k + 1)

    @staticmethod
    def jvp(ctx, s_dot, _, *tangents):
        s, *tensors = ctx.saved_tensors
        k = ctx.k
        return call(KroneckerEigLogdetHessian, s, k, *tensors, *tangents[:k], s_dot)


def _logdet_hessian(s, lams, Qs, Lam, dAs, ds):
    """The Hessian of ``sum log(⊗ λ_i + s)`` with respect to ``(A_1, ..., A_k, s)`` applied
    to ``(dA_1, ..., dA_k, ds)`` (None: zero)."""
    k = len(lams)
    ns = [lam.shape[-1] for lam in lams]
    R = 1 / Lam
    R2 = R * R
    Es = [None if dA is None else Q.mT @ dA @ Q for Q, dA in zip(Qs, dAs)]
    dlams = [None if E is None else E.diagonal(0, -2, -1) for E in Es]

    def on_axis(v, i):  # a vector on grid axis i, broadcast over the flat grid
        return _outer([v if j == i else torch.ones_like(lam) for j, lam in enumerate(lams)])

    others = [_others(lams, {i}) for i in range(k)]
    dLam = None  # dΛ = sum_l O_l dλ_l + ds
    for i, dl in enumerate(dlams):
        if dl is not None:
            t = others[i] * on_axis(dl, i)
            dLam = t if dLam is None else dLam + t
    if ds is not None:
        dLam = ds.unsqueeze(-1) if dLam is None else dLam + ds.unsqueeze(-1)
    H = []
    for i, Q in enumerate(Qs):
        axes = [j - k for j in range(k) if j != i]
        # eigenvalue cross terms: s O_il / Λ² dλ_l (l != i) and -O_i / Λ² ds
        cross = None
        for j, dl in enumerate(dlams):
            if j != i and dl is not None:
                t = _others(lams, {i, j}) * on_axis(dl, j)
                cross = t if cross is None else cross + t
        terms = None
        if cross is not None:
            terms = s.unsqueeze(-1) * cross * R2
        if ds is not None:
            t = -(ds.unsqueeze(-1) * others[i] * R2)
            terms = t if terms is None else terms + t
        inner = None
        if Es[i] is not None:
            M = (others[i] * R).unflatten(-1, ns)
            if k > 1:
                if i:  # a contiguous copy before reshaping the permuted grid
                    M = M.movedim(i - k, -k).clone(memory_format=torch.contiguous_format)
                M = M.reshape(M.shape[:-k] + (ns[i], -1))
            else:
                M = M.unsqueeze(-1)
            Gamma = -(M @ M.mT)  # divided differences of w_i, exact at equal eigenvalues
            inner = Gamma * Es[i].mT
        if terms is not None:
            d = terms.unflatten(-1, ns)
            d = d.sum(axes) if axes else d
            inner = torch.diag_embed(d) if inner is None else inner + torch.diag_embed(d)
        if inner is None:
            inner = torch.zeros_like(Q)
        H.append(Q @ inner @ Q.mT)
    h_s = torch.zeros_like(R[..., 0]) if dLam is None else -(R2 * dLam).sum(-1)
    return (*H, h_s)


def _refuse_third_order(*_):
    raise NotImplementedError(
        "a derivative of order 3 of torch.logdet(KroneckerPlusScaledIdentityOperator): its log "
        "determinant is differentiated exactly up to order 2 (grad, jvp, hessian, double "
        "backward). Expected: at most second derivatives; for higher ones, take the logdet of "
        "A.to_dense()."
    )


@_presigned
class KroneckerEigLogdetHessian(torch.autograd.Function):
    """The Hessian map of `KroneckerEigLogdet` (symmetric: its own jvp and vjp), on constant
    eigendecompositions: a derivative of it (order 3) raises NotImplementedError.
    ``apply(s, k, *A_i, *λ_i, *Q_i, Λ, *dA_i, ds)``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(s, k, *tensors):
        _, lams, Qs, Lam = _split(k, tensors)
        dAs, ds = tensors[3 * k + 1 : 4 * k + 1], tensors[4 * k + 1]
        return _logdet_hessian(s, lams, Qs, Lam, dAs, ds)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    backward = staticmethod(_refuse_third_order)
    jvp = staticmethod(_refuse_third_order)
