"""Derivative rules of QR, Householder products, least squares and the pseudo-inverse.

Same idiom as autodiff/linalg.py (Note [Linalg derivative rules]): each op's jvp and vjp are
written once against its schema arguments and registered by ``def_linalg``; rules use only ops
that have rules of their own (triangles by constant masks), so they differentiate again and
batch. Formulas and conventions are torch's (FunctionsManual.cpp): the same gauge for QR, the
same differentiable outputs for lstsq, the same errors where torch refuses to differentiate.
Complex conventions: docs/complex.md.
"""

from __future__ import annotations

import torch

from ._util import unbroadcast
from .linalg import (
    _H,
    _as_matrix,
    _as_vector,
    _conj,
    _is_vector,
    _mask,
    _pad_columns,
    _plus,
    _solve_tri,
    def_linalg,
)

aten = torch.ops.aten


# Note [Batch-polymorphic linalg rules]
#     The rules below use only ops that broadcast over leading batch dims (matmul, triangular
#     solves, masks, slices of the last dims). Under vmap, running them op by op costs one trip
#     through the vmap interpreter per op, which for QR's backward is more than the arithmetic.
#     So when every wrapper among a rule's arguments is a BatchedTensor of one live vmap level,
#     the rule runs once on the physical values, batch dim in front (an unbatched argument is
#     expanded, so every result carries the batch dim), and its results are wrapped once: the
#     pointwise fast path's idea (Note [Pointwise fast path]) for whole rules. Any other mix
#     (a jvp or grad wrapper among the arguments) takes the ordinary path, op by op.
def _on_physical(rule):
    def physical_rule(*args):
        from functransforms.batching._tensor import BatchedTensor, wrap_batched

        from functransforms._core.levels import TransformTensor, below_torch_autograd

        interp = None
        for a in args:
            for t in a if type(a) is tuple or type(a) is list else (a,):
                if isinstance(t, TransformTensor):
                    if type(t) is not BatchedTensor or (
                        interp is not None and t._interp is not interp
                    ):
                        return rule(*args)
                    interp = t._interp
                    v = t._value
                    if type(v) is not BatchedTensor and v.requires_grad and below_torch_autograd():
                        return rule(*args)  # Note [Fast path below torch's autograd]
        if interp is None or not interp.alive:
            return rule(*args)
        size = interp.batch_size

        def phys(t):
            if type(t) is BatchedTensor:
                v, b = t._value, t._bdim
                return v if b == 0 else v.movedim(b, 0)
            if isinstance(t, torch.Tensor):
                return t.unsqueeze(0).expand((size,) + tuple(t.shape))
            return t

        def each(a):
            if type(a) is tuple or type(a) is list:
                return type(a)(phys(t) for t in a)
            return phys(a)

        out = rule(*(each(a) for a in args))
        wrap = lambda t: None if t is None else wrap_batched(t, 0, interp)  # noqa: E731
        return type(out)(wrap(t) for t in out) if type(out) is tuple else wrap(out)

    return physical_rule


# -- QR ----------------------------------------------------------------------------------------
# A = QR. Which modes are differentiable is torch's: mode='r' returns no Q, on which the
# derivative depends; mode='complete' with m > n leaves the last m - n columns of Q undetermined.
def _qr_check(A, mode):
    if mode == "r":
        raise RuntimeError(
            "The derivative of linalg.qr depends on Q, which is not computed when mode='r'. "
            "Please use linalg.qr(A, mode='reduced') if you are going to differentiate through "
            "linalg.qr."
        )
    if mode == "complete" and A.shape[-2] > A.shape[-1]:
        raise RuntimeError(
            "The QR decomposition is not differentiable when mode='complete' and nrows > ncols."
        )


# m >= n: with X = Q^H dA R^-1, dR R^-1 = triu(X + X^H) with a halved diagonal (the upper
# triangular matrix with a real diagonal whose Hermitian part is sym(X)); dQ = dA R^-1 - Q dR R^-1.
# m < n: A = Q [R1 R2] with R1 square; Q^H dQ is skew-Hermitian with the lower triangle of
# X1 = Q^H dA1 R1^-1 (and i Im of its diagonal), and dR = Q^H dA - Q^H dQ R.
def _qr_jvp(out, dots, A, mode):
    _qr_check(A, mode)
    Q, R = out
    dA = dots[0]
    m, n = A.shape[-2], A.shape[-1]
    if m >= n:
        dARinv = _solve_tri(R, dA, upper=True, left=False)
        X = Q.mH @ dARinv
        S = X + _H(X)
        dRRinv = S * _mask(S, "phi^T")  # triu with a halved (real) diagonal
        return dARinv - Q @ dRRinv, dRRinv @ R
    QHdA = Q.mH @ dA
    X = _solve_tri(R[..., :m], QHdA[..., :m], upper=True, left=False)
    # tril(X, -1) - tril(X, -1)^H + i Im diag(X), in two ops: S - S^H with S = X * phi
    S = X * _mask(X, "phi")
    QHdQ = S - _H(S)
    return Q @ QHdQ, QHdA - QHdQ @ R


def _times_Q(Q, M, plus):
    """``Q @ M + plus`` (``plus`` may be None), the right-hand side of a solve with
    ``left=False``, which reads it column-major: for real inputs it is computed as the row-major
    transpose of ``M^T Q^T + plus^T``, sparing the solve a copy (same values; QR's backward,
    B=32 64x32: 0.40 -> 0.33 ms). Not for complex ones, where the transposed product is slower."""
    if Q.is_complex():
        return _plus(Q @ M, plus)
    return _plus(M.mT @ Q.mT, None if plus is None else plus.mT).mT


def _qr_vjp(bars, out, needs, A, mode):
    _qr_check(A, mode)
    Q, R = out
    gQ, gR = bars
    m, n = A.shape[-2], A.shape[-1]
    if gQ is None:
        G = gR @ R.mH
    else:
        G = -(Q.mH @ gQ) if gR is None else gR @ R.mH - Q.mH @ gQ
    if m >= n:
        # the adjoint of triu-with-halved-diagonal o sym, triu(G, 1) + triu(G, 1)^H + Re diag G,
        # in two ops: S + S^H with S = G * triu-with-halved-diagonal
        S = G * _mask(G, "phi^T")
        gA = _solve_tri(_H(R), _times_Q(Q, S + _H(S), gQ), upper=False, left=False)
        return (gA,)
    # the adjoint of the m < n map, tril(Y - Y^H, -1) + i Im diag(Y) with Y = -G: (Y - Y^H) * phi
    T = (_H(G) - G) * _mask(G, "phi")
    gA = _solve_tri(_H(R[..., :m]), _times_Q(Q, T, None), upper=False, left=False)
    gA = _pad_columns(gA, n)
    if gR is not None:
        gA = gA + Q @ gR
    return (gA,)


def_linalg(aten.linalg_qr.default, _on_physical(_qr_jvp), _on_physical(_qr_vjp))


# -- Householder products ----------------------------------------------------------------------
# Note [Householder chains]
#     householder_product and ormqr both apply the reflectors H_j = I - tau_j v_j v_j^H, where v_j
#     is column j of the input below the diagonal, with an implicit 1 on the diagonal. Both are
#     written as one chain Y <- H_j Y (or H_j^H Y, i.e. tau_j conjugated) over j in some order,
#     starting from Y0 (the first columns of I for householder_product, the other operand for
#     ormqr). Each step is a rank-one update, so its jvp and vjp are a few matrix-vector
#     products: with w = v^H Y_old and t the step's scalar,
#         dY = dY_old - dt v w - t dv w - t v (dv^H Y_old) - t v (v^H dY_old)
#         bar t = -sum(v^H bar Y * conj(w)),  bar v = -conj(t) bar Y w^H - t Y_old (bar Y^H v),
#         bar Y_old = bar Y - conj(t) v (v^H bar Y).
#     The vjp keeps every Y_old (k matrices of Y0's size), so, unlike torch's backward, it never
#     inverts a reflector and works when some 1 - tau ||v||^2 is zero.
def _reflectors(A, k):
    """The Householder vectors v_0..v_{k-1}: the first k columns of A, strictly below the
    diagonal, with 1 on it, as a [..., m, k] matrix."""
    m = A.shape[-2]
    V = A[..., :k]
    lower = torch.ones(m, k, dtype=A.dtype.to_real(), device=A.device).tril(-1)
    return V * lower + torch.eye(m, k, dtype=A.dtype, device=A.device)


def _chain_order(k, adjoint):
    # Q Y0 = H_0 (H_1 (... H_{k-1} Y0)); Q^H Y0 = H_{k-1}^H (... H_0^H Y0)
    return range(k) if adjoint else range(k - 1, -1, -1)


def _step_scalar(tau, j, adjoint):
    t = tau[..., j : j + 1].unsqueeze(-1)
    return _conj(t) if adjoint else t


def _chain(V, tau, Y, adjoint):
    Ys = []
    for j in _chain_order(tau.shape[-1], adjoint):
        v, t = V[..., j : j + 1], _step_scalar(tau, j, adjoint)
        Ys.append(Y)
        Y = Y - (t * v) @ (v.mH @ Y)
    return Y, Ys


def _chain_jvp(V, dV, tau, dtau, Y, dY, adjoint):
    """(out, tangent) of the chain; dV is already masked to the strict lower triangle."""
    for j in _chain_order(tau.shape[-1], adjoint):
        v, t = V[..., j : j + 1], _step_scalar(tau, j, adjoint)
        w = v.mH @ Y
        d = None if dY is None else dY - (t * v) @ (v.mH @ dY)
        if dtau is not None:
            d = _plus(d, -(_step_scalar(dtau, j, adjoint) * v) @ w)
        if dV is not None:
            dv = dV[..., j : j + 1]
            d = _plus(d, -((t * dv) @ w + (t * v) @ (dv.mH @ Y)))
        Y, dY = Y - (t * v) @ w, d
    return Y, dY


def _chain_vjp(V, tau, Ys, gY, adjoint, needs_v, needs_tau):
    """Cotangents (of V as [..., m, k] columns, of tau, of Y0) of the chain."""
    k = tau.shape[-1]
    gv, gt = [None] * k, [None] * k
    for j, Y_old in zip(reversed(_chain_order(k, adjoint)), reversed(Ys)):
        v, t = V[..., j : j + 1], _step_scalar(tau, j, adjoint)
        w1 = v.mH @ gY
        w2 = v.mH @ Y_old
        if needs_tau:
            g = -(w1 * _conj(w2)).sum(-1)
            gt[j] = _conj(g) if adjoint else g
        if needs_v:
            gv[j] = -(_conj(t) * gY) @ w2.mH - (t * Y_old) @ w1.mH
        gY = gY - (_conj(t) * v) @ w1
    # no reflectors (k = 0): empty cotangents, sliced from the inputs (cat of nothing fails)
    gV = (torch.cat(gv, -1) if k else V[..., :0]) if needs_v else None
    gtau = (torch.cat(gt, -1) if k else tau) if needs_tau else None
    return gV, gtau, gY


def _input_cotangent(gV, A):
    """gV on the reflector columns, masked as the kernel reads them, zero past them."""
    m, k = gV.shape[-2], gV.shape[-1]
    lower = torch.ones(m, k, dtype=A.dtype.to_real(), device=A.device).tril(-1)
    return _pad_columns(gV * lower, A.shape[-1])


def _dV(dA, k):
    if dA is None:
        return None
    m = dA.shape[-2]
    return dA[..., :k] * torch.ones(m, k, dtype=dA.dtype.to_real(), device=dA.device).tril(-1)


def _first_columns(A, n):
    return torch.eye(A.shape[-2], n, dtype=A.dtype, device=A.device).expand(
        A.shape[:-2] + (A.shape[-2], n)
    )


def _householder_product_jvp(out, dots, A, tau):
    k = tau.shape[-1]
    V = _reflectors(A, k)
    Y0 = _first_columns(A, A.shape[-1])
    return _chain_jvp(V, _dV(dots[0], k), tau, dots[1], Y0, None, False)[1]


def _householder_product_vjp(bars, out, needs, A, tau):
    k = tau.shape[-1]
    V = _reflectors(A, k)
    _, Ys = _chain(V, tau, _first_columns(A, A.shape[-1]), False)
    gV, gtau, _ = _chain_vjp(V, tau, Ys, bars[0], False, needs[0], needs[1])
    return (None if gV is None else _input_cotangent(gV, A)), gtau


def_linalg(
    aten.linalg_householder_product.default,
    _on_physical(_householder_product_jvp),
    _on_physical(_householder_product_vjp),
)


# ormqr(A, tau, C, left, transpose) = op(Q) C or C op(Q), Q = H_0 ... H_{k-1} (mn x mn), op(Q)
# = Q^H when transpose. C op(Q) = (op(Q)^H C^H)^H, so every case is one chain.
def _ormqr_chain_args(A, tau, C, left, transpose):
    adjoint = transpose if left else not transpose
    return _reflectors(A, tau.shape[-1]), (C if left else _H(C)), adjoint


def _ormqr_jvp(out, dots, A, tau, C, left, transpose):
    V, Y0, adjoint = _ormqr_chain_args(A, tau, C, left, transpose)
    dC = dots[2]
    if dC is not None and not left:
        dC = _H(dC)
    dY = _chain_jvp(V, _dV(dots[0], tau.shape[-1]), tau, dots[1], Y0, dC, adjoint)[1]
    return dY if left else _H(dY)


def _ormqr_vjp(bars, out, needs, A, tau, C, left, transpose):
    V, Y0, adjoint = _ormqr_chain_args(A, tau, C, left, transpose)
    _, Ys = _chain(V, tau, Y0, adjoint)
    g = bars[0] if left else _H(bars[0])
    gV, gtau, gC = _chain_vjp(V, tau, Ys, g, adjoint, needs[0], needs[1])
    gA = None if gV is None else _input_cotangent(gV, A)
    return gA, gtau, ((gC if left else _H(gC)) if needs[2] else None)


def_linalg(aten.ormqr.default, _on_physical(_ormqr_jvp), _on_physical(_ormqr_vjp))


# -- pseudo-inverse ----------------------------------------------------------------------------
# P = pinv(A) (any atol/rtol/hermitian: the derivative is that of the Moore-Penrose inverse on
# the set of matrices of A's rank, as torch's pinv_jvp / pinv_backward):
#   dP = -P dA P + P P^H dA^H (I - A P) + (I - P A) dA^H P^H P
#   bar A = -P^H G P^H + (I - A P) G^H P P^H + P^H P G^H (I - P A)
# each grouped, as torch does, so that the products are of the smaller dimension.
def _pinv_jvp_core(A, P, dA):
    m, n = A.shape[-2], A.shape[-1]
    dAh, Ph = _H(dA), _H(P)
    if m <= n:
        K = Ph @ dAh
        return P @ (K - _H(K) - K @ (A @ P)) + (dAh - P @ (A @ dAh)) @ (Ph @ P)
    K = P @ dA
    Kh = _H(K)
    return (Kh - K - (P @ A) @ Kh) @ P + (P @ Ph) @ (dAh - (dAh @ A) @ P)


def _pinv_vjp_core(A, P, G):
    m, n = A.shape[-2], A.shape[-1]
    Ph, Gh = _H(P), _H(G)
    if m <= n:
        K = Gh @ P
        KPh = K @ Ph
        return -_H(P @ K) + KPh - (A @ P) @ KPh + (Ph @ P) @ (Gh - K @ A)
    K = P @ Gh
    PhK = Ph @ K
    return -_H(K @ P) + (Gh - A @ K) @ (P @ Ph) + PhK - (PhK @ P) @ A


# Note [Kernels with internal conj views]
#     torch's pinv and lstsq kernels build lazy conj views (A.mH, r.conj()) internally; inside
#     __torch_dispatch__ the Conjugate key is excluded, so for complex inputs they would compute
#     with the raw values and return wrong numbers (Note [Conjugate views], batching/_tensor.py).
#     Every place that runs these kernels on plain values from inside a transform turns the
#     keys back on for complex inputs (a few microseconds, so real inputs skip it): the op's
#     value under jvp and grad (`forward=` of def_linalg), the lstsq rules, the batching rules.
def _with_conj_keys(op):
    def run(A, *args, **kwargs):
        if not A.is_complex():
            return op(A, *args, **kwargs)
        from functransforms.batching._tensor import _lazy_conj_enabled

        with _lazy_conj_enabled():
            return op(A, *args, **kwargs)

    return run


_pinv_kernel = _with_conj_keys(aten.linalg_pinv.atol_rtol_tensor)
_lstsq_kernel = _with_conj_keys(aten.linalg_lstsq.default)


def pinv(A):
    """torch.linalg.pinv(A) with torch's default tolerances, correct inside rules."""
    return _pinv_kernel(A)


def_linalg(
    aten.linalg_pinv.atol_rtol_tensor,
    _on_physical(lambda P, dots, A, atol, rtol, hermitian: _pinv_jvp_core(A, P, dots[0])),
    _on_physical(lambda bars, P, needs, A, atol, rtol, hermitian: (_pinv_vjp_core(A, P, bars[0]),)),
    forward=_pinv_kernel,
)


# -- least squares -----------------------------------------------------------------------------
# lstsq(A, B) -> (X, residuals, rank, singular_values). As torch: X = pinv(A) B is
# differentiated through pinv (torch's default tolerances, whatever rcond/driver computed X);
# residuals L = ||A X - B||^2 per column (when the driver computes them) by Danskin's theorem,
# as if X were fixed: dL = 2 Re sum(r * conj(dA X - dB)), r = A X - B. rank and
# singular_values carry no derivative (as in torch).
def _lstsq_jvp(out, dots, A, B, rcond, driver):
    X, L = out[0], out[1]
    dA, dB = dots[0], dots[1]
    vec = _is_vector(A, B)
    Bm, Xm = _as_matrix(B, vec, True), _as_matrix(X, vec, True)
    dBm = None if dB is None else _as_matrix(dB, vec, True)
    P = pinv(A)
    dX = None if dBm is None else P @ dBm
    if dA is not None:
        dX = _plus(dX, _pinv_jvp_core(A, P, dA) @ Bm)
    dL = None
    if L.numel():
        r = A @ Xm - Bm
        dr = None if dA is None else dA @ Xm
        if dBm is not None:
            dr = _plus(dr, -dBm)
        dL = 2 * (r * _conj(dr)).real.sum(-2) if r.is_complex() else 2 * (r * dr).sum(-2)
    return _as_vector(dX, vec, True), dL


def _lstsq_vjp(bars, out, needs, A, B, rcond, driver):
    X, L = out[0], out[1]
    gX, gL = bars[0], bars[1]
    vec = _is_vector(A, B)
    Bm = _as_matrix(B, vec, True)
    gA = gB = None
    if gX is not None:
        gXm = _as_matrix(gX, vec, True)
        P = pinv(A)
        if needs[0]:
            gA = _pinv_vjp_core(A, P, gXm @ _H(Bm))
        if needs[1]:
            gB = _H(P) @ gXm
    if gL is not None and L.numel():
        Xm = _as_matrix(X, vec, True)
        rg = 2 * gL.unsqueeze(-2) * (A @ Xm - Bm)
        if needs[0]:
            gA = _plus(gA, rg @ _H(Xm))
        if needs[1]:
            gB = _plus(gB, -rg)
    gA = None if gA is None else unbroadcast(gA, A.shape)
    gB = None if gB is None else unbroadcast(_as_vector(gB, vec, True), B.shape)
    return gA, gB


def_linalg(
    aten.linalg_lstsq.default,
    _on_physical(_lstsq_jvp),
    _on_physical(_lstsq_vjp),
    forward=_lstsq_kernel,
)
