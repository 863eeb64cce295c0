"""Derivative rules of linear algebra: matrix products (bilinear: each factor's vjp is the
product with the other's conjugate transpose; addbmm, ``_trilinear``), factorizations, solvers
and determinants, and the pairwise distances ``_cdist_forward`` / ``_pdist_forward``. Forward
mode for cdist and pdist is ours only (torch has none); tests/autodiff/test_ad_misc.py checks it
by finite differences."""

from __future__ import annotations

import torch

from functransforms import _compat
from functransforms._core.levels import TransformTensor
from functransforms.errors import IllDefinedDerivativeError

from ._registry import VJP_FORWARD, register_jvp_rule, register_vjp_rule
from ._util import conj_if_complex, unbroadcast
from .reductions import _norm_weight

aten = torch.ops.aten


def def_bilinear(op, vjp_a, vjp_b):
    def bilinear_jvp_rule(primals, tangents, kwargs):
        a, b = primals[0], primals[1]
        out = op(*primals, **kwargs)
        ta, tb = tangents[0], tangents[1]
        t = None
        if ta is not None:
            t = op(ta, b, **kwargs)
        if tb is not None:
            t2 = op(a, tb, **kwargs)
            t = t2 if t is None else t + t2
        return out, t

    def bilinear_vjp_rule(ct, primals, kwargs, out, needs):
        a, b = primals[0], primals[1]
        return (vjp_a(ct, a, b) if needs[0] else None, vjp_b(ct, a, b) if needs[1] else None)

    register_jvp_rule(op)(bilinear_jvp_rule)
    register_vjp_rule(op)(bilinear_vjp_rule)


# Note [Product cotangents in the operand's layout]
#     F.linear multiplies by ``weight.t()``, a column-major view. The cotangent of that factor,
#     ``a^H @ ct``, comes out row-major, and the ``t()`` that follows hands the weight a
#     transposed gradient; under vmap the product is a batched outer product written against
#     its layout ([B, 784, 128] for a [128, 784] weight), 20-30% of per-sample gradients of an
#     MLP, and later copies pay for the layout again. torch's mm backward
#     (``mm_mat1_backward``/``mm_mat2_backward``) computes the cotangent of a column-major
#     factor as the transpose of the transposed product, so it has the factor's layout: the
#     same numbers (each entry is the same dot product), the same layout as torch's.
def _column_major(t):
    s = t.stride()
    return s[0] == 1 and s[1] == t.shape[0]


#
# Note [Outer products as products]
#     A product whose contracted dim has size 1 is an outer product: each entry is one
#     multiplication, which ``x * y`` (``[n, 1] * [1, m]``) computes with the same rounding.
#     That is the weight cotangent of a linear layer applied to one example (``F.linear`` of a
#     1-d input), so per-sample gradients meet it on every layer, where vmap makes the product a
#     ``bmm`` of ``[B, n, 1] @ [B, 1, m]``: ~3x slower than the broadcast multiply on this CPU
#     (136 vs 44 us for [8, 128, 1] @ [8, 1, 784]). The values are the same; only zero signs can
#     differ: a batched ``bmm`` accumulates into +0 (``-1 * 0`` gives +0), ``mm`` and ``*`` give
#     -0, so the product keeps the per-example ``mm``'s bits.


def _mm(x, y):
    """``x @ y`` of matrices; the broadcast product when the contracted dim is 1 (Note [Outer
    products as products])."""
    return x * y if x.shape[-1] == 1 else x @ y


def _mm_vjp_a(ct, a, b):
    return _mm(b, ct.mH).mH if _column_major(a) else _mm(ct, b.mH)


def _mm_vjp_b(ct, a, b):
    return _mm(ct.mH, a).mH if _column_major(b) else _mm(a.mH, ct)


def_bilinear(aten.mm.default, _mm_vjp_a, _mm_vjp_b)
def_bilinear(aten.bmm.default, lambda ct, a, b: ct @ b.mH, lambda ct, a, b: a.mH @ ct)
def_bilinear(
    aten.mv.default, lambda ct, a, b: ct.unsqueeze(-1) * b.conj(), lambda ct, a, b: a.mH @ ct
)
def_bilinear(aten.dot.default, lambda ct, a, b: ct * b.conj(), lambda ct, a, b: ct * a.conj())
def_bilinear(aten.vdot.default, lambda ct, a, b: (ct * b.conj()).conj(), lambda ct, a, b: ct * a)


def _matmul_vjp(ct, a, b, which):
    a1, b1 = a.dim() == 1, b.dim() == 1
    a2 = a.unsqueeze(0) if a1 else a
    b2 = b.unsqueeze(-1) if b1 else b
    c2 = ct
    if a1:
        c2 = c2.unsqueeze(-2)
    if b1:
        c2 = c2.unsqueeze(-1)
    if which == 0:
        return unbroadcast(c2 @ b2.mH, a2.shape).reshape(a.shape)
    return unbroadcast(a2.mH @ c2, b2.shape).reshape(b.shape)


def_bilinear(
    aten.matmul.default,
    lambda ct, a, b: _matmul_vjp(ct, a, b, 0),
    lambda ct, a, b: _matmul_vjp(ct, a, b, 1),
)


def _conj_scalar(c):
    return c.conjugate() if isinstance(c, complex) else c


def def_add_product(op, product, vjp_a, vjp_b):
    """``op(bias, a, b, beta, alpha) = beta * bias + alpha * product(a, b)``."""

    def add_product_jvp_rule(primals, tangents, kwargs):
        a, b = primals[1], primals[2]
        beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
        out = op(*primals, **kwargs)
        tc, ta, tb = tangents[0], tangents[1], tangents[2]
        t = None
        if ta is not None:
            t = product(ta, b)
        if tb is not None:
            t = product(a, tb) if t is None else t + product(a, tb)
        if t is not None and alpha != 1:
            t = t * alpha
        if tc is not None:
            tc = tc if beta == 1 else tc * beta
            t = tc.expand(out.shape) if t is None else t + tc
        return out, t

    def add_product_vjp_rule(ct, primals, kwargs, out, needs):
        bias, a, b = primals[0], primals[1], primals[2]
        # the vjp multiplies by the conjugate of each (possibly complex) scalar
        beta, alpha = _conj_scalar(kwargs.get("beta", 1)), _conj_scalar(kwargs.get("alpha", 1))
        ca = ct if alpha == 1 else ct * alpha
        return (
            unbroadcast(ct if beta == 1 else ct * beta, bias.shape)
            if needs[0] and beta != 0
            else None,
            vjp_a(ca, a, b) if needs[1] else None,
            vjp_b(ca, a, b) if needs[2] else None,
        )

    register_jvp_rule(op)(add_product_jvp_rule)
    register_vjp_rule(op)(add_product_vjp_rule)


def_add_product(aten.addmm.default, torch.mm, _mm_vjp_a, _mm_vjp_b)
def_add_product(
    aten.baddbmm.default, torch.bmm, lambda ct, a, b: ct @ b.mH, lambda ct, a, b: a.mH @ ct
)
def_add_product(
    aten.addmv.default,
    torch.mv,
    lambda ct, a, b: ct.unsqueeze(-1) * b.conj(),
    lambda ct, a, b: a.mH @ ct,
)


# -- factorizations, solvers, determinants, spectral decompositions ----------------------------
# Note [Linalg derivative rules]
#     Each op's jvp and vjp are written once against its schema arguments, in schema order, and
#     registered by `def_linalg`: ``jvp(out, dots, *args)`` returns the tangents of the
#     differentiable leading outputs (``dots`` parallel to ``args``, None for a zero or a
#     non-tensor); ``vjp(bars, out, needs, *args)`` gets the output cotangents as a tuple (None
#     for a zero) and returns one cotangent per positional argument. Outputs such as LU, pivots
#     and info carry no derivative (as in torch). Rules use only ops that have rules of their own
#     (triangular parts by a constant mask, not `tril`), so that they differentiate again. For
#     complex inputs the vjp is torch's (docs/complex.md); where torch's vjp is not the exact
#     adjoint of its jvp (Cholesky and eigh symmetrize: their input is Hermitian by contract),
#     both follow torch. Formulas: Giles 2008, "Collected matrix derivative results for forward
#     and reverse mode AD"; the Cholesky, eigh and SVD ones in the projected form of
#     torch's FunctionsManual.
def def_linalg(op, jvp, vjp, forward=None):
    """Register ``jvp`` / ``vjp`` for ``op`` (Note [Linalg derivative rules]). ``forward``
    computes the op's value under jvp and grad when calling ``op`` itself there would be
    wrong."""
    schema = op._schema.arguments
    names = [a.name for a in schema]
    defaults = [a.default_value if a.has_default_value() else None for a in schema]
    multi = len(op._schema.returns) > 1

    def bind(primals, kwargs):
        args = list(primals) + defaults[len(primals) :]
        for k, v in kwargs.items():
            args[names.index(k)] = v
        return args

    run = op if forward is None else forward

    def linalg_jvp_rule(primals, tangents, kwargs):
        out = run(*primals, **kwargs)
        if all(t is None for t in tangents):
            return out, None
        dots = list(tangents) + [None] * (len(names) - len(tangents))
        t = jvp(out, dots, *bind(primals, kwargs))
        if multi:
            return out, tuple(t) + (None,) * (len(out) - len(t))
        return out, t

    def linalg_vjp_rule(bars, primals, kwargs, out, needs):
        if not multi:
            bars = (bars,)
        if all(b is None for b in bars):
            return (None,) * len(primals)
        grads = vjp(bars, out, needs, *bind(primals, kwargs))
        return tuple(grads[: len(primals)]) + (None,) * (len(primals) - len(grads))

    if forward is not None:
        VJP_FORWARD[op] = forward  # what grad runs for the value (autodiff/reverse.py)
    register_jvp_rule(op)(linalg_jvp_rule)
    register_vjp_rule(op)(linalg_vjp_rule)


_MASKS: dict = {}


def _mask(X, kind):
    """A constant [n, n] mask in X's real dtype: ``tril``, ``triu``, ``tril-1``, ``triu+1``,
    ``phi`` (tril with a halved diagonal), ``phi^T``, ``tril/2``, ``tril-1/2`` (halved), ``eye``,
    ``offdiag``."""
    n, dtype = X.shape[-1], X.dtype.to_real()
    key = (n, kind, dtype, X.device)
    m = _MASKS.get(key)
    if m is None:
        one = torch.ones(n, n, dtype=dtype, device=X.device)
        eye = torch.eye(n, dtype=dtype, device=X.device)
        m = {
            "tril": one.tril(),
            "triu": one.triu(),
            "tril-1": one.tril(-1),
            "triu+1": one.triu(1),
            "phi": one.tril() - 0.5 * eye,
            "phi^T": one.triu() - 0.5 * eye,  # not phi.mT: a strided mask slows the product 5x
            "tril/2": 0.5 * one.tril(),
            "tril-1/2": 0.5 * one.tril(-1),
            "eye": eye,
            "offdiag": one - eye,
        }[kind]
        if len(_MASKS) < 256:
            _MASKS[key] = m
    return m


def _tri(X, upper, unit=False):
    """The triangle of X a triangular solve reads (strict when the diagonal is unit)."""
    return X * _mask(X, ("triu+1" if unit else "triu") if upper else ("tril-1" if unit else "tril"))


def _diag_embed(d, like):
    """diag_embed(d) in like's dtype."""
    if like.is_complex() and not d.is_complex():
        d = d.to(like.dtype)
    return d.unsqueeze(-1) * _mask(like, "eye")


def _H(X):
    """X^H, materialized: kernels run by a rule ignore a lazy conj bit
    (Note [No lazy conjugate inside wrappers], autodiff/views.py)."""
    return torch.conj_physical(X.mT) if X.is_complex() else X.mT


def _conj(x):
    return torch.conj_physical(x) if x.is_complex() else x


def _trace(X):
    return X.diagonal(0, -2, -1).sum(-1)


def _plus(a, b):
    """a + b with None as a symbolic zero."""
    return b if a is None else a if b is None else a + b


def _neg(a):
    return None if a is None else -a


def _solve_tri(A, B, upper, left=True, unit=False):
    return torch.linalg.solve_triangular(A, B, upper=upper, left=left, unitriangular=unit)


# Cholesky: A = L L^H. dL = L Phi(L^-1 dA L^-H), Phi = tril with a halved diagonal;
# bar A = L^-H Phi*(tril(L^H bar L)) L^-1 with Phi*(X) = (X + tril(X, -1)^H) / 2.
def _cholesky_jvp(out, dots, A, upper, check_errors):
    L, dA = out[0], dots[0]
    if upper:
        L = L.mH
    X = _solve_tri(L.mH, _solve_tri(L, dA, upper=False), upper=True, left=False)
    dL = L @ (X * _mask(X, "phi"))
    return (_H(dL) if upper else dL,)


def _cholesky_vjp(bars, out, needs, A, upper, check_errors):
    L, gL = out[0], bars[0]
    if upper:
        L, gL = L.mH, gL.mH
    X = L.mH @ gL
    X = X * _mask(X, "tril/2") + _H(X * _mask(X, "tril-1/2"))
    return (_solve_tri(L, _solve_tri(L.mH, X, upper=True), upper=False, left=False),)


def_linalg(aten.linalg_cholesky_ex.default, _cholesky_jvp, _cholesky_vjp)


# Solves broadcast A's and B's batch dims; B is a vector (or a batch of vectors) when its shape
# is A's without the last dim, as in torch.linalg.solve.
def _is_vector(A, B):
    return B.dim() == 1 or (B.dim() == A.dim() - 1 and B.shape == A.shape[:-1])


def _as_matrix(B, vec, left):
    return B if not vec else B.unsqueeze(-1 if left else -2)


def _as_vector(X, vec, left):
    return X if not vec else X.squeeze(-1 if left else -2)


# X = A^-1 B (left) or B A^-1: dX = A^-1 (dB - dA X) or (dB - X dA) A^-1;
# bar B = A^-H bar X (or bar X A^-H), bar A = -bar B X^H (or -X^H bar B).
def _solve_jvp_core(solve, A, B, X, dA, dB, left):
    vec = _is_vector(A, B)
    Xm = _as_matrix(X, vec, left)
    r = _as_matrix(dB, vec, left) if dB is not None else None
    if dA is not None:
        r = _plus(r, -(dA @ Xm) if left else -(Xm @ dA))
    return _as_vector(solve(A, r), vec, left)


def _solve_vjp_core(solve_h, A, B, X, gX, needs, left):
    vec = _is_vector(A, B)
    gB = solve_h(A, _as_matrix(gX, vec, left))
    Xm = _as_matrix(X, vec, left)
    gA = unbroadcast(-(gB @ Xm.mH) if left else -(Xm.mH @ gB), A.shape) if needs[0] else None
    gB = unbroadcast(_as_vector(gB, vec, left), B.shape) if needs[1] else None
    return gA, gB


def _solve_jvp(out, dots, A, B, left, check_errors):
    solve = lambda A, R: torch.linalg.solve(A, R, left=left)  # noqa: E731
    return (_solve_jvp_core(solve, A, B, out[0], dots[0], dots[1], left),)


def _solve_vjp(bars, out, needs, A, B, left, check_errors):
    solve_h = lambda A, G: torch.linalg.solve(A.mH, G, left=left)  # noqa: E731
    return _solve_vjp_core(solve_h, A, B, out[0], bars[0], needs, left)


def_linalg(aten._linalg_solve_ex.default, _solve_jvp, _solve_vjp)


# Triangular solves read one triangle of A (without the diagonal when unitriangular), so the
# tangent and the cotangent of A live in that triangle.
def _solve_triangular_jvp(X, dots, A, B, upper, left, unitriangular):
    dA = None if dots[0] is None else _tri(dots[0], upper, unitriangular)
    solve = lambda A, R: _solve_tri(A, R, upper, left, unitriangular)  # noqa: E731
    return _solve_jvp_core(solve, A, B, X, dA, dots[1], left)


def _solve_triangular_vjp(bars, X, needs, A, B, upper, left, unitriangular):
    solve_h = lambda A, G: _solve_tri(A.mH, G, not upper, left, unitriangular)  # noqa: E731
    gA, gB = _solve_vjp_core(solve_h, A, B, X, bars[0], needs, left)
    return (None if gA is None else _tri(gA, upper, unitriangular)), gB


def_linalg(aten.linalg_solve_triangular.default, _solve_triangular_jvp, _solve_triangular_vjp)


# cholesky_solve(B, L) = (L L^H)^-1 B (or (U^H U)^-1 B): a solve with A = L L^H,
# dA = dL L^H + L dL^H; bar L = -(G + G^H) L with G = bar B X^H (bar U = -U (G + G^H)).
def _cholesky_solve_jvp(X, dots, B, L, upper):
    r = dots[0]
    dL = dots[1]
    if dL is not None:
        if upper:  # A = U^H U
            dAX = dL.mH @ (L @ X) + L.mH @ (dL @ X)
        else:
            dAX = dL @ (L.mH @ X) + L @ (dL.mH @ X)
        r = _plus(r, -dAX)
    return torch.cholesky_solve(r, L, upper)


def _cholesky_solve_vjp(bars, X, needs, B, L, upper):
    gB = torch.cholesky_solve(bars[0], L, upper)
    gL = None
    if needs[1]:
        G = gB @ X.mH
        G = G + _H(G)
        gL = unbroadcast(-(L @ G) if upper else -(G @ L), L.shape)
    return (unbroadcast(gB, B.shape) if needs[0] else None), gL


def_linalg(aten.cholesky_solve.default, _cholesky_solve_jvp, _cholesky_solve_vjp)


# inverse: d(A^-1) = -A^-1 dA A^-1; bar A = -A^-H bar X A^-H.
def_linalg(
    aten.linalg_inv_ex.default,
    lambda out, dots, A, check_errors: (-(out[0] @ dots[0] @ out[0]),),
    lambda bars, out, needs, A, check_errors: (-(out[0].mH @ bars[0] @ out[0].mH),),
)


# determinants: d log det A = tr(A^-1 dA) =: tau.
# det: d det = det tau, bar A = conj(bar det det) A^-H.
# slogdet: d logabsdet = Re tau, d sign = sign i Im tau (complex; real signs are constant);
# bar A = w A^-H with w = bar logabsdet - i Im(conj(bar sign) sign).
def _tau(A, dA):
    return _trace(torch.linalg.solve(A, dA))


def _inv_h(A):
    return _H(torch.linalg.inv(A))


def _prod_others(s):
    """prod_{j != i} s_j along the last dim, exact where some s_j are 0 (no division)."""
    ones = torch.ones_like(s[..., :1])
    left = torch.cat([ones, s[..., :-1]], -1).cumprod(-1)
    right = torch.cat([s[..., 1:], ones], -1).flip(-1).cumprod(-1).flip(-1)
    return left * right


def _det_vjp(bars, out, needs, A):
    """torch's linalg_det_backward for tensor subclasses (so PyTorch's): the adjugate from
    an SVD, A = U S Vh: bar A = U diag(bar det conj(det U det Vh) prod_{j != i} s_j) Vh, which
    holds at singular matrices too (conj(bar det det) A^-H there is inf / a failed inverse)."""
    U, S, Vh = torch.linalg.svd(A)
    alpha = _conj(torch.linalg.det(U) * torch.linalg.det(Vh))
    D = (bars[0] * alpha)[..., None] * _prod_others(S)
    return ((U * D[..., None, :]) @ Vh,)


def _det_jvp(out, dots, A):
    """d det = tr(adj(A) dA), computed as det(A') tr(A'^-1 dA) from one LU, P L U', whose zero
    pivots are replaced by eps (as torch's linalg_det_jvp; det is C^1, adj(A') = adj(A) +
    O(eps)). Both factors come from that LU: at a singular A the pivot LAPACK leaves may be 0
    or a rounding-level residue, depending on the LAPACK path, and det(A) tr(A'^-1 dA) with
    det(A) from another factorization (``out``) is then 0 or off by the ratio of two residues."""
    LU, pivots, _ = torch.linalg.lu_factor_ex(A)  # no error at a zero pivot
    diag = LU.diagonal(0, -2, -1)
    eps = torch.finfo(diag.real.dtype if diag.is_complex() else diag.dtype).eps
    bump = torch.where(diag == 0, torch.full_like(diag, eps), 0 * diag)
    LU = LU + torch.diag_embed(bump)
    rows = torch.arange(1, pivots.shape[-1] + 1, device=pivots.device, dtype=pivots.dtype)
    swaps = (pivots != rows).sum(-1)
    sign = 1 - 2 * (swaps % 2).to(diag.real.dtype if diag.is_complex() else diag.dtype)
    det = sign * (diag + bump).prod(-1)
    tau = torch.linalg.lu_solve(LU, pivots, dots[0]).diagonal(0, -2, -1).sum(-1)
    return (tau * det,)


def_linalg(aten._linalg_det.default, _det_jvp, _det_vjp)


def _slogdet_jvp(out, dots, A):
    sign, tau = out[0], _tau(A, dots[0])
    if not A.is_complex():
        return None, tau
    return sign * (1j * tau.imag), tau.real


def _slogdet_vjp(bars, out, needs, A):
    g_sign, g_lad = bars[0], bars[1]
    w = g_lad
    if A.is_complex() and g_sign is not None:
        w = _plus(w, -1j * (_conj(g_sign) * out[0]).imag)
    if w is None:
        return (None,)
    return (w[..., None, None] * _inv_h(A),)


def_linalg(aten._linalg_slogdet.default, _slogdet_jvp, _slogdet_vjp)


# Note [Phase-dependent losses]
#     Complex eigenvectors (eig, eigh) and singular vectors (SVD) are defined only up to a phase
#     e^{i phi} per column. A loss that depends on those phases has no derivative; it shows as
#     Im diag(V^H bar V) != 0 (for SVD: Im diag(U^H bar U + V^H bar V)). torch's backward raises
#     then (tolerance 1e-2) and so do we: dropping that part would return the gradient of another
#     function. torch skips the check for wrapped tensors (under PyTorch); we check the
#     physical values behind every level (dispatch off), so it also runs under vmap and jvp, and
#     is skipped only for values without data (fake/meta, in symbolic traces).
def _physical(x):
    """The plain tensor behind the wrappers of every level (a BatchedTensor's whole batch)."""
    while isinstance(x, TransformTensor):
        x = x._value if hasattr(x, "_value") else x._primal
    return x


def check_phase_invariant(im, op, vectors="eigenvectors"):
    """Raise when ``im`` (the imaginary diagonal above) is not ~0: Note [Phase-dependent losses]."""
    im = _physical(im)
    if _compat.is_fake_tensor(im) or im.device.type == "meta":
        return
    with _compat.DisableTorchDispatch():  # a value check, not part of the computation
        bad = im.abs().max().item() if im.numel() else 0.0
    if bad > 1e-2:
        raise IllDefinedDerivativeError(
            f"{op} backward: the {vectors} of a complex {op} are defined only up to a phase "
            f"e^{{i phi}} per column, and the loss is not invariant to it (its derivative along "
            f"the phases is {bad:.3g}, expected < 1e-2), so it has no derivative (torch's backward "
            f"raises the same). Do: make the loss depend on the {vectors} only through "
            "phase-invariant quantities (abs(V), V diag(.) V^-1, |v^H w|, ...)."
        )


# eigh: A = V diag(L) V^H. With dP = V^H dA V: dL = Re diag(dP), dV = V (dP / E) with
# E_ij = L_j - L_i off the diagonal (0 on it). bar A = V (diag(bar L) + skew(V^H bar V) / E) V^H,
# skew(X) = (X - X^H) / 2 (torch's projection onto the tangent space of the unitary group).
# eigvalsh (compute_v=False) has no V in its output: the rules recompute it.
def _inv_gaps(L):
    E = L.unsqueeze(-2) - L.unsqueeze(-1)
    return _mask(E, "offdiag") / (E + _mask(E, "eye"))


def _eigh_jvp(out, dots, A, UPLO, compute_v):
    L, V = out if compute_v else torch.linalg.eigh(A, UPLO)
    dP = V.mH @ dots[0] @ V
    dL = dP.diagonal(0, -2, -1)
    dL = dL.real if dL.is_complex() else dL
    if not compute_v:
        return (dL,)
    return dL, V @ (dP * _inv_gaps(L))


def _eigh_vjp(bars, out, needs, A, UPLO, compute_v):
    gL, gV = bars[0], bars[1] if compute_v else None
    L, V = out if compute_v else torch.linalg.eigh(A, UPLO)
    gP = None if gL is None else _diag_embed(gL, V)
    if gV is not None:
        X = V.mH @ gV
        if X.is_complex():
            check_phase_invariant(X.diagonal(0, -2, -1).imag, "linalg.eigh")
        gP = _plus(gP, 0.5 * (X - _H(X)) * _inv_gaps(L))
    return (V @ gP @ V.mH,)


def_linalg(aten._linalg_eigh.default, _eigh_jvp, _eigh_vjp)


# SVD, A = U diag(S) V^H, k = min(m, n) singular triplets. With dP = U^H dA V and
# F = _inv_gaps(S^2) (F_ij = 1 / (S_j^2 - S_i^2), 0 on the diagonal):
#   dS = Re diag(dP)
#   dU = U (F o (dP S + S dP^H) + i Im diag(dP) / 2S) + (I - U U^H) dA V S^-1
#   dV = V (F o (S dP + dP^H S) - i Im diag(dP) / 2S) + (I - V V^H) dA^H U S^-1,  dVh = dV^H
# (the imaginary diagonal fixes the phase gauge as torch does). The vjp is its adjoint:
#   bar A = U [diag(bar S) + (F o (G - G^H)) S + S (F o (H - H^H)) + i Im diag(G - H) / 2S] V^H
#           + (I - U U^H) bar U S^-1 V^H + U S^-1 bar V^H (I - V V^H),
# G = U^H bar U, H = V^H bar V. full_matrices=True: the columns past k carry no derivative.
def _svd_factors(out, A, full_matrices, compute_uv):
    if not compute_uv:
        U, S, Vh = torch.linalg.svd(A, full_matrices=False)
        return U, S, Vh.mH
    U, S, Vh = out
    k = S.shape[-1]
    if full_matrices:
        U, Vh = U[..., :k], Vh[..., :k, :]
    return U, S, Vh.mH


def _pad_columns(X, n):
    k = X.shape[-1]
    if k == n:
        return X
    return torch.cat([X, torch.zeros(*X.shape[:-1], n - k, dtype=X.dtype, device=X.device)], -1)


def _svd_jvp(out, dots, A, full_matrices, compute_uv, driver):
    U, S, V = _svd_factors(out, A, full_matrices, compute_uv)
    dA = dots[0]
    dP = U.mH @ dA @ V
    diag = dP.diagonal(0, -2, -1)
    dS = diag.real if diag.is_complex() else diag
    if not compute_uv:
        return None, dS
    F = _inv_gaps(S * S)
    Sr, Sc = S.unsqueeze(-2), S.unsqueeze(-1)  # scale columns / rows
    dPh = _H(dP)
    dU = F * (dP * Sr + Sc * dPh)
    dV = F * (Sc * dP + dPh * Sr)
    if dP.is_complex():
        phase = _diag_embed(1j * diag.imag / (2 * S), dP)
        dU, dV = dU + phase, dV - phase
    dU, dV = U @ dU, V @ dV
    m, n, k = A.shape[-2], A.shape[-1], S.shape[-1]
    if m > k:
        dAV = dA @ V
        dU = dU + (dAV - U @ (U.mH @ dAV)) / Sr
    if n > k:
        dAhU = dA.mH @ U
        dV = dV + (dAhU - V @ (V.mH @ dAhU)) / Sr
    if full_matrices:
        dU, dV = _pad_columns(dU, m), _pad_columns(dV, n)
    return dU, dS, _H(dV)


def _svd_vjp(bars, out, needs, A, full_matrices, compute_uv, driver):
    U, S, V = _svd_factors(out, A, full_matrices, compute_uv)
    gU, gS, gVh = bars if compute_uv else (None, bars[1], None)
    k = S.shape[-1]
    if full_matrices:
        gU = None if gU is None else gU[..., :k]
        gVh = None if gVh is None else gVh[..., :k, :]
    gP = None if gS is None else _diag_embed(gS, U)
    if gU is None and gVh is None:
        return (U @ gP @ V.mH,)
    F = _inv_gaps(S * S)
    Sr, Sc = S.unsqueeze(-2), S.unsqueeze(-1)
    extra = None
    im = phase = None  # Im diag(G - H) enters bar A; Im diag(G + H) must be ~0
    if gU is not None:
        G = U.mH @ gU
        gP = _plus(gP, (F * (G - _H(G))) * Sr)
        im = phase = G.diagonal(0, -2, -1).imag if G.is_complex() else None
        if A.shape[-2] > k:
            extra = ((gU - U @ G) / Sr) @ V.mH
    if gVh is not None:
        gV = gVh.mH
        H = V.mH @ gV
        gP = _plus(gP, Sc * (F * (H - _H(H))))
        if H.is_complex():
            im = _plus(im, -H.diagonal(0, -2, -1).imag)
            phase = _plus(phase, H.diagonal(0, -2, -1).imag)
        if A.shape[-1] > k:
            extra = _plus(extra, (U / Sr) @ (gVh - (gVh @ V) @ V.mH))
    if im is not None:
        check_phase_invariant(phase, "linalg.svd", "singular vectors")
        gP = gP + _diag_embed(1j * im / (2 * S), gP)
    return (_plus(U @ gP @ V.mH, extra),)


def_linalg(aten._linalg_svd.default, _svd_jvp, _svd_vjp)


# cholesky_inverse: X = (L L^H)^-1 (or (U^H U)^-1). dX = -X dA X with dA = dL L^H + L dL^H;
# bar A = -X bar X X (X is Hermitian), and A = L L^H gives bar L = (bar A + bar A^H) L
# (bar U = U (bar A + bar A^H) for the upper factor).
def _cholesky_inverse_jvp(out, dots, L, upper):
    X, dL = out, dots[0]
    dL = dL * _mask(dL, "triu" if upper else "tril")  # the kernel reads one triangle only
    dA = _H(dL) @ L + _H(L) @ dL if upper else dL @ _H(L) + L @ _H(dL)
    return -(X @ dA @ X)


def _cholesky_inverse_vjp(bars, out, needs, L, upper):
    X, G = out, bars[0]
    gA = -(X @ G @ X)
    sym = gA + _H(gA)
    return (L @ sym if upper else sym @ L,)


def_linalg(aten.cholesky_inverse.default, _cholesky_inverse_jvp, _cholesky_inverse_vjp)


# -- addbmm ---------------------------------------------------------------------------------------
def _scalars(primals, kwargs):
    beta = kwargs.get("beta", primals[3] if len(primals) > 3 else 1)
    alpha = kwargs.get("alpha", primals[4] if len(primals) > 4 else 1)
    return beta, alpha


@register_jvp_rule(aten.addbmm.default)
def addbmm_jvp_rule(primals, tangents, kwargs):
    """addbmm(c, A, B) = beta c + alpha sum_b A_b B_b"""
    c, A, B = primals[:3]
    beta, alpha = _scalars(primals, kwargs)
    out = aten.addbmm.default(*primals, **kwargs)
    tc, tA, tB = tangents[:3]
    t = None
    if tc is not None and beta != 0:
        t = (tc * beta).expand(out.shape)
    for prod in (
        None if tA is None else torch.bmm(tA, B),
        None if tB is None else torch.bmm(A, tB),
    ):
        if prod is not None:
            p = prod.sum(0) * alpha
            t = p if t is None else t + p
    return out, t


@register_vjp_rule(aten.addbmm.default)
def addbmm_vjp_rule(ct, primals, kwargs, out, needs):
    c, A, B = primals[:3]
    beta, alpha = _scalars(primals, kwargs)
    a = _conj_scalar(alpha)
    gc = gA = gB = None
    if needs[0]:
        gc = unbroadcast(ct * _conj_scalar(beta), c.shape) if beta != 0 else torch.zeros_like(c)
    if needs[1]:
        gA = torch.matmul(ct.unsqueeze(0), conj_if_complex(B).transpose(-1, -2)) * a
    if needs[2]:
        gB = torch.matmul(conj_if_complex(A).transpose(-1, -2), ct.unsqueeze(0)) * a
    return (gc, gA, gB) + (None,) * (len(primals) - 3)


# -- _trilinear: out = sum_{sumdim} i1[expand1] * i2[expand2] * i3[expand3] ----------------------
def _expanded(t, dims):
    for d in sorted(dims):
        t = t.unsqueeze(d)
    return t


@register_jvp_rule(aten._trilinear.default)
def trilinear_jvp_rule(primals, tangents, kwargs):
    """Multilinear: the sum of the op with one argument replaced by its tangent."""
    out = aten._trilinear.default(*primals, **kwargs)
    t = None
    for k in range(3):
        if tangents[k] is None:
            continue
        args = list(primals)
        args[k] = tangents[k]
        tk = aten._trilinear.default(*args, **kwargs)
        t = tk if t is None else t + tk
    return out, t


@register_vjp_rule(aten._trilinear.default)
def trilinear_vjp_rule(ct, primals, kwargs, out, needs):
    ins, expands, sumdim = primals[:3], primals[3:6], primals[6]
    full = [_expanded(x, e) for x, e in zip(ins, expands)]
    ct_full = _expanded(ct, sumdim)
    grads = []
    for k in range(3):
        if not needs[k]:
            grads.append(None)
            continue
        others = [full[j] for j in range(3) if j != k]
        g = ct_full * conj_if_complex(others[0] * others[1])
        g = unbroadcast(g, full[k].shape) if g.shape != full[k].shape else g
        grads.append(g.reshape(ins[k].shape))
    return tuple(grads) + (None,) * (len(primals) - 3)


# -- cdist / pdist ------------------------------------------------------------------------------
# d_ij = ||x1_i - x2_j||_p: d d_ij = <w_ij, dx1_i - dx2_j> with w the derivative of the p-norm
# (reductions._norm_weight: zero at d = 0, the p = inf ties split, p = 0 piecewise constant).
def _pair_weights(diff, d, p):
    return _norm_weight(diff, d.unsqueeze(-1), -1, (diff, p), {})


@register_jvp_rule(aten._cdist_forward.default)
def cdist_jvp_rule(primals, tangents, kwargs):
    """Ours only: d d_ij = <w_ij, dx1_i - dx2_j>."""
    x1, x2, p = primals[:3]
    out = aten._cdist_forward.default(*primals, **kwargs)
    t1, t2 = tangents[0], tangents[1]
    if t1 is None and t2 is None:
        return out, None
    w = _pair_weights(x1.unsqueeze(-2) - x2.unsqueeze(-3), out, p)
    dt = 0
    if t1 is not None:
        dt = dt + t1.unsqueeze(-2)
    if t2 is not None:
        dt = dt - t2.unsqueeze(-3)
    return out, (w * dt).sum(-1)


@register_vjp_rule(aten._cdist_forward.default)
def cdist_vjp_rule(ct, primals, kwargs, out, needs):
    x1, x2, p = primals[:3]
    w = _pair_weights(x1.unsqueeze(-2) - x2.unsqueeze(-3), out, p)
    cw = ct.unsqueeze(-1) * w
    g1 = unbroadcast(cw.sum(-2), x1.shape) if needs[0] else None
    g2 = unbroadcast(-cw.sum(-3), x2.shape) if needs[1] else None
    return (g1, g2) + (None,) * (len(primals) - 2)


def _pdist_pairs(x):
    n = x.shape[0]
    i, j = torch.triu_indices(n, n, 1, device=x.device)
    return i, j


@register_jvp_rule(aten._pdist_forward.default)
def pdist_jvp_rule(primals, tangents, kwargs):
    """Ours only: the pairs i < j of cdist(x, x), row-major."""
    x = primals[0]
    p = primals[1] if len(primals) > 1 else kwargs.get("p", 2.0)
    out = aten._pdist_forward.default(*primals, **kwargs)
    t = tangents[0]
    if t is None:
        return out, None
    i, j = _pdist_pairs(x)
    w = _pair_weights(x[i] - x[j], out, p)
    return out, (w * (t[i] - t[j])).sum(-1)


@register_vjp_rule(aten._pdist_forward.default)
def pdist_vjp_rule(ct, primals, kwargs, out, needs):
    x = primals[0]
    p = primals[1] if len(primals) > 1 else kwargs.get("p", 2.0)
    i, j = _pdist_pairs(x)
    cw = ct.unsqueeze(-1) * _pair_weights(x[i] - x[j], out, p)
    g = torch.zeros(x.shape, dtype=cw.dtype, device=cw.device)
    return (g.index_add(0, i, cw).index_add(0, j, -cw),) + (None,) * (len(primals) - 1)
