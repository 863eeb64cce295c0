"""Batching rules for matrix products. One idea: put batch dims in front and let
``torch.matmul`` broadcast; a product with both operands batched becomes a batched product."""

from __future__ import annotations

import torch

from functransforms._core.levels import below_torch_autograd

from ._fastpath import SHAPED_FUNCS, _live_value
from ._registry import register_vmap_rule
from ._util import expand_front, pad_to, to_front

aten = torch.ops.aten


def _fronts(args, bdims):
    a, b = args[0], args[1]
    ba, bb = bdims[0], bdims[1]
    return (a if ba is None else to_front(a, ba)), (b if bb is None else to_front(b, bb)), ba, bb


def _product_rule(rank, what):
    """mm (``rank`` 2) and bmm (3): torch checks the ranks in the kernel, which a wrapper never
    reaches, and matmul would broadcast a vector or a batch instead of raising."""

    def mm_vmap_rule(interp, args, bdims, kwargs):
        a, b, ba, bb = _fronts(args, bdims)
        for x, bx, name in ((a, ba, "self"), (b, bb, "mat2")):
            if x.dim() - (bx is not None) != rank:
                raise RuntimeError(f"{name} must be a {what}")
        return torch.matmul(a, b), 0

    return mm_vmap_rule


mm_vmap_rule = register_vmap_rule(aten.mm.default)(_product_rule(2, "matrix"))
bmm_vmap_rule = register_vmap_rule(aten.bmm.default)(_product_rule(3, "3D tensor"))


@register_vmap_rule(aten.mv.default)
def mv_vmap_rule(interp, args, bdims, kwargs):
    A, x, bA, bx = _fronts(args, bdims)
    if bx is None:
        return torch.matmul(A, x), 0  # [B, n, k] @ [k] -> [B, n]
    if bA is None:
        return torch.matmul(x, A.mT), 0  # [B, k] @ [k, n] -> [B, n]
    return torch.matmul(A, x.unsqueeze(-1)).squeeze(-1), 0


@register_vmap_rule(aten.dot.default)
def dot_vmap_rule(interp, args, bdims, kwargs):
    a, b, ba, bb = _fronts(args, bdims)
    if ba is not None and bb is not None:
        return (a * b).sum(-1), 0
    return (torch.matmul(a, b) if bb is None else torch.matmul(b, a)), 0  # [B, k] @ [k] -> [B]


@register_vmap_rule(aten.vdot.default)
def vdot_vmap_rule(interp, args, bdims, kwargs):
    # resolve_conj: a lazy conj view is not honoured by kernels run inside __torch_dispatch__
    return dot_vmap_rule(interp, [args[0].conj().resolve_conj(), args[1]], bdims, kwargs)


def def_add_product(op, product_rule, out_rank):
    """``op(bias, a, b, beta, alpha) = beta * bias + alpha * product(a, b)``."""

    def add_product_vmap_rule(interp, args, bdims, kwargs):
        prod, _ = product_rule(interp, args[1:], bdims[1:], {})
        beta = kwargs.get("beta", 1)
        alpha = kwargs.get("alpha", 1)
        if alpha != 1:
            prod = prod * alpha
        if beta == 0:
            return prod, 0
        bias = args[0]
        if bdims[0] is not None:
            bias = pad_to(to_front(bias, bdims[0]), out_rank)
        return prod + (bias if beta == 1 else bias * beta), 0

    register_vmap_rule(op)(add_product_vmap_rule)


def_add_product(aten.addmm.default, mm_vmap_rule, 2)
def_add_product(aten.addmv.default, mv_vmap_rule, 1)
def_add_product(aten.baddbmm.default, bmm_vmap_rule, 3)


def _bmm_sum_vmap_rule(interp, args, bdims, kwargs):
    """The product of addbmm: ``sum_i a[i] @ b[i]``, batch dim in front."""
    a, b, ba, bb = _fronts(args, bdims)
    out = torch.matmul(a, b).sum(-3)
    if ba is None and bb is None:  # only the bias is batched
        out = out.expand((interp.batch_size,) + tuple(out.shape))
    return out, 0


def_add_product(aten.addbmm.default, _bmm_sum_vmap_rule, 2)


@register_vmap_rule(aten.matmul.default)
def matmul_vmap_rule(interp, args, bdims, kwargs):
    """torch.matmul semantics: 1-D operands are promoted to matrices and the added dim removed."""
    a, b = args[0], args[1]
    ba, bb = bdims[0], bdims[1]
    a1 = a.dim() - (ba is not None) == 1
    b1 = b.dim() - (bb is not None) == 1
    if ba is not None:
        a = to_front(a, ba)
    if bb is not None:
        b = to_front(b, bb)
    if a1:
        a = a.unsqueeze(-2)
    if b1:
        b = b.unsqueeze(-1)
    nd = max(a.dim() - (ba is not None), b.dim() - (bb is not None))
    if ba is not None:
        a = pad_to(a, nd)
    if bb is not None:
        b = pad_to(b, nd)
    out = torch.matmul(a, b)
    if a1:
        out = out.squeeze(-2)
    if b1:
        out = out.squeeze(-1)
    return out, 0


def _expand_to_common_batch(operands, nd):
    """Note [Batching broadcasting linalg ops]
    Solvers broadcast the batch dims of their operands (A ``[2, 4, 4]`` with b ``[4, 1]``). Each
    batched operand gets its batch dim in front and size-1 dims after it, so that its logical
    batch dims number ``nd`` (the largest among the operands): right-aligned broadcasting then
    lines up logical batch dims with logical batch dims, and the vmap dim with the vmap dim.
    ``operands`` holds ``(x, bdim, core)``: ``core`` is the number of trailing non-batch dims
    (2 for a matrix). Unbatched operands stay as they are and broadcast over the vmap dim."""
    return [x if b is None else pad_to(to_front(x, b), nd + core) for x, b, core in operands]


def _batch_rank(x, bdim, core):
    return x.dim() - (bdim is not None) - core


def def_matrix_op(op, contiguous=False):
    """Ops of one (batch of) matrices ``[..., m, n]``: the vmap dim goes in front, where it is
    one more batch dim; every output carries it in front. Placeholder outputs (the empty
    eigenvectors of ``eigvalsh``, the empty Q of ``qr(mode='r')``) carry no vmap dim.
    ``contiguous``: the kernel needs it (torch 2.13's matrix_exp calls view on its input)."""

    def matrix_op_vmap_rule(interp, args, bdims, kwargs):
        x = to_front(args[0], bdims[0])
        out = op(x.contiguous() if contiguous else x, *args[1:], **kwargs)
        if isinstance(out, torch.Tensor):
            return out, 0
        B = interp.batch_size
        return out, tuple(0 if o.dim() > 0 and o.shape[0] == B else None for o in out)

    register_vmap_rule(op)(matrix_op_vmap_rule)


for _op in (
    aten._linalg_slogdet.default,
    aten._linalg_det.default,
    aten.linalg_inv_ex.default,
    aten.linalg_cholesky_ex.default,
    aten._linalg_eigh.default,
    aten.linalg_eig.default,
    aten.linalg_qr.default,
    aten._linalg_svd.default,
    aten.linalg_lu_factor_ex.default,
    aten.linalg_lu.default,
    aten.geqrf.default,
    aten.linalg_ldl_factor_ex.default,
):
    def_matrix_op(_op)
def_matrix_op(aten.linalg_matrix_exp.default, contiguous=True)


# Note [matrix_sqrth and polar inside __torch_dispatch__]
#     torch 2.15's linalg.matrix_sqrth and linalg.polar (new in 2.15) return wrong values for
#     complex inputs when called from inside any __torch_dispatch__ (checked with a bare
#     wrapper subclass: X @ X differs from A by ~2.6), which is where batching rules run; real
#     inputs are right. For complex inputs the rules compute the same functions from eigh / svd:
#     sqrth(A) = V diag(sqrt(l)) V^H for A = V diag(l) V^H, and polar(A) = (W V^H, V S V^H) for
#     A = W S V^H. PyTorch batches these ops in C++ (no Python dispatch) and is right.
def _sqrth(a):
    evals, evecs = torch.linalg.eigh(a)
    return (evecs * evals.sqrt().unsqueeze(-2).to(evecs.dtype)) @ evecs.mH


def _polar(a):
    w, s, vh = torch.linalg.svd(a, full_matrices=False)
    return w @ vh, vh.mH @ (s.unsqueeze(-1).to(vh.dtype) * vh)


def _def_complex_by_formula(op, formula):
    def by_formula_vmap_rule(interp, args, bdims, kwargs):
        x = to_front(args[0], bdims[0])
        out = formula(x) if x.is_complex() else op(x.contiguous(), *args[1:], **kwargs)
        return out, 0 if isinstance(out, torch.Tensor) else (0,) * len(out)

    register_vmap_rule(op)(by_formula_vmap_rule)


for _name, _formula in (("linalg_matrix_sqrth", _sqrth), ("linalg_polar", _polar)):
    _packet = getattr(aten, _name, None)  # new in torch 2.15
    if _packet is not None:
        _def_complex_by_formula(_packet.default, _formula)


def def_broadcasting_solve(op, n_out=1):
    """``op(X, Y, ...)`` of two (batches of) matrices whose batch dims broadcast
    (Note [Batching broadcasting linalg ops]); all ``n_out`` outputs have the broadcast shape."""

    def broadcasting_solve_vmap_rule(interp, args, bdims, kwargs):
        x, y = args[0], args[1]
        bx, by = bdims[0], bdims[1]
        nd = max(_batch_rank(x, bx, 2), _batch_rank(y, by, 2))
        x, y = _expand_to_common_batch([(x, bx, 2), (y, by, 2)], nd)
        out = op(x, y, *args[2:], **kwargs)
        return out, (0 if n_out == 1 else (0,) * n_out)

    register_vmap_rule(op)(broadcasting_solve_vmap_rule)


def_broadcasting_solve(aten.cholesky_solve.default)  # (B, L, upper)
def_broadcasting_solve(aten.linalg_solve_triangular.default)  # (A, B, *, upper, left, ...)
def_broadcasting_solve(aten.triangular_solve.default, n_out=2)  # (B, A, ...) -> (X, A copy)


@register_vmap_rule(aten._linalg_solve_ex.default)
def linalg_solve_vmap_rule(interp, args, bdims, kwargs):
    """solve(A, B) -> (X, LU, pivots, info). ``B`` is a (batch of) vector(s) when it is 1-d or
    its shape is ``A.shape[:-1]`` (torch's rule, decided on the logical shapes, since batching
    changes the physical ones); it is made a one-column matrix so that batch dims broadcast
    (Note [Batching broadcasting linalg ops]). LU, pivots and info have A's batch shape, not the
    broadcast one: the size-1 dims inserted into A are removed from them."""
    A, b = args[0], args[1]
    bA, bb = bdims[0], bdims[1]
    A_shape = A.shape if bA is None else A.shape[:bA] + A.shape[bA + 1 :]
    b_shape = b.shape if bb is None else b.shape[:bb] + b.shape[bb + 1 :]
    vec = len(b_shape) == 1 or (len(b_shape) == len(A_shape) - 1 and b_shape == A_shape[:-1])
    if bb is not None:
        b, bb = to_front(b, bb), 0
    elif bA is not None:  # a size-1 vmap dim: b must never look like a batch of vectors of A
        b, bb = b.unsqueeze(0), 0
    if vec:  # as torch: a column even when left=False (where torch then reports the mismatch)
        b = b.unsqueeze(-1)
    ka = len(A_shape) - 2
    nd = max(ka, _batch_rank(b, bb, 2))
    A, b = _expand_to_common_batch([(A, bA, 2), (b, bb, 2)], nd)
    X, LU, pivots, info = aten._linalg_solve_ex.default(A, b, *args[2:], **kwargs)
    if vec:
        X = X.squeeze(-1)
    if bA is None:
        return (X, LU, pivots, info), (0, None, None, None)
    if nd > ka:  # drop the size-1 dims that _expand_to_common_batch inserted after the vmap dim
        keep = (A.shape[0],)
        LU = LU.reshape(keep + LU.shape[1 + nd - ka :])
        pivots = pivots.reshape(keep + pivots.shape[1 + nd - ka :])
        info = info.reshape(keep + info.shape[1 + nd - ka :])
    return (X, LU, pivots, info), (0, 0, 0, 0)


# Note [Fast path for linalg.solve]
#     torch.linalg.solve is a composite: under vmap it reaches the dispatcher twice
#     (_linalg_solve_ex, whose rule wraps four outputs, then _linalg_check_errors), which cost
#     more than the solve of a batch of small systems itself. At __torch_function__ level
#     (Note [Shaped fast path], _fastpath.py) the same answer is one batched call on the physical
#     values, when it is exactly the logical call with one more batch dim: the vmap dim goes in
#     front of every batched operand, a vector right-hand side (torch's rule, decided on the
#     logical shapes) becomes an explicit column, and every batched operand has the largest
#     logical batch rank (a plain operand's batch dims then never reach the vmap dim). Anything
#     else (``out=``, a vector with ``left=False``, values of two levels, mismatched batch ranks)
#     and every error (shapes, dtypes, singular matrices) goes to the ordinary path, which stays
#     the source of semantics and of messages.
def _solve_operand(x, batched_cls):
    """(physical value with the vmap dim in front, logical shape, interp) of one operand, or
    None when the fast path cannot take it."""
    if type(x) is batched_cls:
        v = _live_value(x, batched_cls)
        if v is None:
            return None
        if x._bdim:
            v = v.movedim(x._bdim, 0)
        return v, v.shape[1:], x._interp
    if type(x) is torch.Tensor:
        if x.requires_grad and below_torch_autograd():
            return None  # Note [Fast path below torch's autograd]
        return x, x.shape, None
    return None


def _solve_fast(func, args, kwargs, batched_cls, wrap):
    if len(args) != 2:
        return None
    left = True
    if kwargs:
        left = kwargs.get("left")
        if len(kwargs) != 1 or type(left) is not bool:
            return None
    a = _solve_operand(args[0], batched_cls)
    b = _solve_operand(args[1], batched_cls)
    if a is None or b is None:
        return None
    (pA, LA, iA), (pb, Lb, ib) = a, b
    interp = iA if iA is not None else ib
    if interp is None or (iA is not None and ib is not None and iA is not ib):
        return None
    nA, nb = len(LA), len(Lb)
    if nA < 2 or nb < 1:
        return None
    vec = nb == 1 or (nb == nA - 1 and Lb == LA[:-1])
    if vec and not left:
        return None
    kb = nb - 1 if vec else nb - 2
    # every batched operand has the largest logical batch rank
    if (iA is not None and kb > nA - 2) or (ib is not None and nA - 2 > kb):
        return None
    # torch's rule on the physical shapes: where it disagrees, b is given as an explicit column
    n = pb.dim()
    column = vec != (n == 1 or (n == pA.dim() - 1 and pb.shape == pA.shape[:-1]))
    if column:
        if not vec:
            return None  # torch would take the physical b for a batch of vectors
        pb = pb.unsqueeze(-1)
    try:
        out = func(pA, pb) if left else func(pA, pb, left=False)
    except RuntimeError:
        return None  # the ordinary path raises it, with the logical shapes
    return wrap(out.squeeze(-1) if column else out, 0, interp)


SHAPED_FUNCS[torch.linalg.solve] = _solve_fast


# The same for the functions of one (batch of) square or general matrices that are also
# composites reaching the dispatcher twice or more (a *_ex op and _linalg_check_errors, or a
# decomposition): the vmap dim in front is one more batch dim, exactly as def_matrix_op's rule
# says, and every output carries it. Each function is listed with the keywords (and the number
# of positional arguments) it may take here; anything else, and every error, goes to the
# ordinary path. Not eigvalsh (nor svdvals, eigvals): on a tensor subclass torch computes them
# with the eigenvectors (a last-bit difference from the plain call), as the ordinary path does.
def _matrix_fast(keywords, n_args=1):
    def matrix_fast(func, args, kwargs, batched_cls, wrap):
        if not 1 <= len(args) <= n_args or (kwargs and not kwargs.keys() <= keywords):
            return None
        x = args[0]
        if type(x) is not batched_cls:
            return None
        v = _live_value(x, batched_cls)
        if v is None or v.dim() < 3:
            return None
        if x._bdim:
            v = v.movedim(x._bdim, 0)
        try:
            out = func(v, *args[1:], **kwargs) if kwargs else func(v, *args[1:])
        except RuntimeError:
            return None  # the ordinary path raises it
        interp = x._interp
        if isinstance(out, torch.Tensor):  # a wrapper of an inner level too
            return wrap(out, 0, interp)
        return type(out)(tuple(wrap(o, 0, interp) for o in out))

    return matrix_fast


for _fn, _keywords, _n_args in (
    (torch.linalg.inv, (), 1),
    (torch.linalg.cholesky, ("upper",), 1),
    (torch.linalg.det, (), 1),
    (torch.linalg.slogdet, (), 1),
    (torch.linalg.eigh, ("UPLO",), 2),
    (torch.linalg.matrix_exp, (), 1),
):
    SHAPED_FUNCS[_fn] = _matrix_fast(frozenset(_keywords), _n_args)


@register_vmap_rule(aten.linalg_lu_solve.default)
def linalg_lu_solve_vmap_rule(interp, args, bdims, kwargs):
    """lu_solve(LU, pivots, B): LU and pivots share one batch shape exactly (an unbatched one
    is expanded when the other is batched); that shape broadcasts with B's."""
    LU, piv, b = args[0], args[1], args[2]
    bLU, bpiv, bb = bdims[0], bdims[1], bdims[2]
    if bLU is not None or bpiv is not None:
        LU = expand_front(LU, bLU, interp.batch_size)
        piv = expand_front(piv, bpiv, interp.batch_size)
        bLU = bpiv = 0
    nd = max(_batch_rank(LU, bLU, 2), _batch_rank(b, bb, 2))
    LU, piv, b = _expand_to_common_batch([(LU, bLU, 2), (piv, bpiv, 1), (b, bb, 2)], nd)
    # torch 2.13 returns wrong values when LU's batch dims broadcast against B's (size-1 dims
    # in LU/pivots): expand all three to the common batch shape first
    batch = torch.broadcast_shapes(LU.shape[:-2], b.shape[:-2])
    LU = LU.expand(batch + LU.shape[-2:])
    piv = piv.expand(batch + piv.shape[-1:])
    b = b.expand(batch + b.shape[-2:])
    return aten.linalg_lu_solve.default(LU, piv, b, *args[3:], **kwargs), 0


@register_vmap_rule(aten.linalg_householder_product.default)
def linalg_householder_product_vmap_rule(interp, args, bdims, kwargs):
    """householder_product(A, tau): equal batch shapes (no broadcasting), so the unbatched
    operand is expanded."""
    B = interp.batch_size
    A = expand_front(args[0], bdims[0], B)
    tau = expand_front(args[1], bdims[1], B)
    return aten.linalg_householder_product.default(A, tau, *args[2:], **kwargs), 0


@register_vmap_rule(aten._cdist_forward.default)
def cdist_vmap_rule(interp, args, bdims, kwargs):
    x1, x2 = args[0], args[1]
    nd = max(x1.dim() - (bdims[0] is not None), x2.dim() - (bdims[1] is not None))
    x1 = pad_to(expand_front(x1, bdims[0], interp.batch_size), nd)
    x2 = pad_to(expand_front(x2, bdims[1], interp.batch_size), nd)
    return aten._cdist_forward.default(x1, x2, *args[2:], **kwargs), 0


@register_vmap_rule(aten._linalg_check_errors.default)
def linalg_check_errors_vmap_rule(interp, args, bdims, kwargs):
    """Checks every example's ``info`` at once (as one batch of matrices)."""
    info, api_name = args[0], args[1]
    aten._linalg_check_errors.default(to_front(info, bdims[0]), api_name, is_matrix=False)
    return None, None


# -- LU family, legacy cholesky, cholesky_inverse -----------------------------------------------
# Matrix ops with one operand: the vmap dim is one more batch dim (def_matrix_op).
def_matrix_op(aten.cholesky_inverse.default)
if hasattr(aten, "cholesky"):  # removed in torch 2.15
    def_matrix_op(aten.cholesky.default)


@register_vmap_rule(aten.lu_unpack.default)
def lu_unpack_vmap_rule(interp, args, bdims, kwargs):
    """lu_unpack(LU, pivots) -> (P, L, U): LU's and the pivots' batch shapes are equal (no
    broadcasting), so the unbatched operand is expanded. An output left empty
    (``unpack_data=False`` / ``unpack_pivots=False``) carries no vmap dim."""
    B = interp.batch_size
    LU = expand_front(args[0], bdims[0], B)
    piv = expand_front(args[1], bdims[1], B)
    out = aten.lu_unpack.default(LU, piv, *args[2:], **kwargs)
    return out, tuple(0 if o.dim() > 0 and o.shape[0] == B else None for o in out)


# -- least squares and the pseudo-inverse -------------------------------------------------------
def _run_conj_safe(op, *args, **kwargs):
    """Run ``op`` with the Conjugate/Negative keys on for complex inputs: pinv and lstsq build
    lazy conj views inside their kernels (Note [Conjugate views], batching/_tensor.py)."""
    if not args[0].is_complex():
        return op(*args, **kwargs)
    from ._tensor import _lazy_conj_enabled

    with _lazy_conj_enabled():
        return op(*args, **kwargs)


@register_vmap_rule(aten.linalg_pinv.atol_rtol_tensor)
def linalg_pinv_vmap_rule(interp, args, bdims, kwargs):
    """pinv(A, *, atol, rtol, hermitian): the vmap dim goes in front of A. torch broadcasts the
    tolerance tensors' shapes into A's batch shape, so A gets size-1 dims after the vmap dim
    until its logical batch rank is the tolerances' (Note [Batching broadcasting linalg ops]).
    Tolerances batched at this level arrive here never: the interpreter loops over examples
    for batched keyword tensors (Note [vmap fallback])."""
    A = to_front(args[0], bdims[0])
    tols = [t for t in (kwargs.get("atol"), kwargs.get("rtol")) if isinstance(t, torch.Tensor)]
    nd = max([A.dim() - 3] + [t.dim() for t in tols])
    A = pad_to(A, nd + 2)
    return _run_conj_safe(aten.linalg_pinv.atol_rtol_tensor, A, *args[1:], **kwargs), 0


@register_vmap_rule(aten.linalg_lstsq.default)
def linalg_lstsq_vmap_rule(interp, args, bdims, kwargs):
    """lstsq(A, B, rcond, *, driver) -> (X, residuals, rank, singular_values). B is a (batch
    of) vector(s) when its logical rank is A's minus one (torch's rule for lstsq), so logical
    batch ranks are equal: both operands get the vmap dim in front (an unbatched one expanded,
    as PyTorch does, so that rank and singular values are per example). Outputs a driver
    does not compute are empty and carry no vmap dim."""
    size = interp.batch_size
    A = expand_front(args[0], bdims[0], size)
    B = expand_front(args[1], bdims[1], size)
    out = _run_conj_safe(aten.linalg_lstsq.default, A, B, *args[2:], **kwargs)
    return out, tuple(0 if o.dim() > 0 and o.numel() > 0 else None for o in out)


@register_vmap_rule(aten.ormqr.default)
def ormqr_vmap_rule(interp, args, bdims, kwargs):
    """ormqr(A, tau, C, left, transpose): equal batch shapes (no broadcasting), so every
    operand gets the vmap dim in front, an unbatched one expanded."""
    size = interp.batch_size
    A, tau, C = (expand_front(args[i], bdims[i], size) for i in range(3))
    return aten.ormqr.default(A, tau, C, *args[3:], **kwargs), 0
