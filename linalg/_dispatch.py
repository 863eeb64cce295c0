"""`__torch_function__` routing: torch functions on operators -> structured algorithms.

One table maps each supported torch callable to an adapter with torch's signature. Anything
else is computed on the dense tensors with a one-time warning naming the op and the operator:
never a silent wrong result, never NotImplementedError for a function with a dense answer.
"""

from __future__ import annotations

import torch

from . import _base, _rules
from . import _functions as functions

# _warn_once is re-exported: tests clear its cache through this module.
from ._base import LinearOperator, _func_name, _warn_once, dense_fallback  # noqa: F401
from ._block import cat
from ._iterative import _CONFIG, resolve_method
from ._krylov import iterative_lstsq


def _is_op(x) -> bool:
    return isinstance(x, LinearOperator)


# ------------------------------------------------------------------ adapters (torch signatures)
def _matmul(input, other, *, out=None):
    if out is not None:
        return None
    return functions.matmul(input, other)


def _rmatmul(self, other):
    return functions.matmul(other, self)


def _solve(A, B, *, left=True, out=None):
    if out is not None or not _is_op(A):
        return None
    return functions.solve(A, B, left=left)


def _solve_triangular(A, B, *, upper, left=True, unitriangular=False, out=None):
    if out is not None or not _is_op(A):
        return None
    return functions.solve_triangular(A, B, upper=upper, left=left, unitriangular=unitriangular)


def _lstsq(A, B, rcond=None, *, driver=None):
    # Only inside ``iterative(lstsq="lsmr")``; otherwise the dense default (which warns).
    if not _is_op(A) or rcond is not None or driver is not None:
        return None
    method, options = resolve_method("lstsq", None, {})
    if method is None:
        return None
    X = iterative_lstsq(A, B, method, **options)
    empty = X.new_empty(0)  # residuals, rank and singular values: not computed (as gelsy)
    return torch.return_types.linalg_lstsq((X, empty, empty.long(), empty))


def _cholesky(A, *, upper=False, out=None):
    if out is not None:
        return None
    return functions.cholesky(A, upper=upper)


def _cholesky_old(A, upper=False, *, out=None):
    return _cholesky(A, upper=upper, out=out)


def _cholesky_solve(B, L, upper=False, *, out=None):
    if out is not None or not _is_op(L):
        return None
    return functions.cholesky_solve(B, L, upper=upper)


def _inv(A, *, out=None):
    return None if out is not None else functions.inv(A)


def _det(A, *, out=None):
    return None if out is not None else functions.det(A)


def _slogdet(A, *, out=None):
    return None if out is not None else functions.slogdet(A)


def _logdet(A):
    if A.positive_definite and _iterative_config() is None and not A.is_complex:  # fast
        return A._logdet_pd()
    return functions.logdet(A)


_iterative_config = _CONFIG.get


def _eigh(A, UPLO="L", *, out=None):
    return None if out is not None else functions.eigh(A, UPLO=UPLO)


def _eigvalsh(A, UPLO="L", *, out=None):
    return None if out is not None else functions.eigvalsh(A, UPLO=UPLO)


def _svd(A, full_matrices=True, *, driver=None, out=None):
    if out is not None or driver is not None:
        return None
    return functions.svd(A, full_matrices=full_matrices)


def _svdvals(A, *, driver=None, out=None):
    return None if (out is not None or driver is not None) else functions.svdvals(A)


def _trace(A):
    return functions.trace(A)


def _diagonal(A, offset=0, dim1=0, dim2=1):
    return functions.diagonal(A, offset=offset, dim1=dim1, dim2=dim2)


def _diagonal_method(A, offset=0, dim1=0, dim2=1):
    return functions.diagonal(A, offset=offset, dim1=dim1, dim2=dim2)


def _linalg_diagonal(A, *, offset=0, dim1=-2, dim2=-1):
    return functions.diagonal(A, offset=offset, dim1=dim1, dim2=dim2)


def _matrix_norm(A, ord="fro", dim=(-2, -1), keepdim=False, *, dtype=None, out=None):
    if ord != "fro" or out is not None or dtype is not None:
        return None
    if tuple(d % A.ndim for d in dim) not in ((A.ndim - 2, A.ndim - 1), (A.ndim - 1, A.ndim - 2)):
        return None
    n = functions.frobenius_norm(A)
    return n.unsqueeze(-1).unsqueeze(-1) if keepdim else n


def _norm(A, ord=None, dim=None, keepdim=False, *, dtype=None, out=None):
    if ord in (None, "fro") and dim is None and A.ndim == 2:
        return _matrix_norm(A, "fro", (-2, -1), keepdim, dtype=dtype, out=out)
    return None


def _diag(A, diagonal=0, *, out=None):
    if not _is_op(A) or A.ndim != 2 or diagonal != 0 or out is not None:
        return None
    return _rules.diagonal(A)


def _add(input, other, *, alpha=1, out=None):
    if out is not None:
        return None
    if alpha != 1:
        other = other * alpha
    return functions.add(input, other)


def _sub(input, other, *, alpha=1, out=None):
    return _add(input, -other, alpha=alpha, out=out)


def _rsub(input, other, *, alpha=1):
    return functions.add(other, -input * alpha)


def _mul(input, other, *, out=None):
    if out is not None:
        return None
    if _is_op(input) and not _is_op(other):
        return input * other
    if _is_op(other) and not _is_op(input):
        return other * input
    return None


def _neg(input):
    return -input


def _cat(tensors, dim=0, *, out=None):
    if out is not None:
        return None
    return cat(tensors, dim)


_TABLE = {
    torch.matmul: _matmul,
    torch.mm: _matmul,
    torch.linalg.matmul: _matmul,
    torch.Tensor.matmul: _matmul,
    torch.Tensor.__matmul__: _matmul,
    torch.Tensor.__rmatmul__: _rmatmul,
    torch.linalg.solve: _solve,
    torch.linalg.solve_triangular: _solve_triangular,
    torch.linalg.lstsq: _lstsq,
    torch.linalg.cholesky: _cholesky,
    torch.cholesky: _cholesky_old,
    torch.cholesky_solve: _cholesky_solve,
    torch.linalg.inv: _inv,
    torch.inverse: _inv,
    torch.linalg.det: _det,
    torch.det: _det,
    torch.linalg.slogdet: _slogdet,
    torch.slogdet: _slogdet,
    torch.logdet: _logdet,
    torch.linalg.eigh: _eigh,
    torch.linalg.eigvalsh: _eigvalsh,
    torch.linalg.svd: _svd,
    torch.linalg.svdvals: _svdvals,
    torch.trace: _trace,
    torch.diagonal: _diagonal,
    torch.Tensor.diagonal: _diagonal_method,
    torch.linalg.diagonal: _linalg_diagonal,
    torch.linalg.matrix_norm: _matrix_norm,
    torch.linalg.norm: _norm,
    torch.diag: _diag,
    torch.add: _add,
    torch.Tensor.add: _add,
    torch.Tensor.__add__: _add,
    torch.Tensor.__radd__: lambda a, b: functions.add(b, a),
    torch.sub: _sub,
    torch.Tensor.sub: _sub,
    torch.Tensor.__sub__: _sub,
    torch.Tensor.__rsub__: _rsub,
    torch.mul: _mul,
    torch.Tensor.mul: _mul,
    torch.Tensor.__mul__: _mul,
    torch.Tensor.__rmul__: _mul,
    torch.neg: _neg,
    torch.cat: _cat,
    torch.concat: _cat,
}


def torch_function(func, args, kwargs):
    """Route ``func(*args, **kwargs)`` with LinearOperator arguments (see module docstring)."""
    adapter = _TABLE.get(func)
    if adapter is not None:
        try:
            result = adapter(*args, **kwargs)
        except TypeError as e:
            # A signature torch accepts but the adapter does not (binding fails in this very
            # frame): compute densely. A TypeError raised deeper is a real error.
            if e.__traceback__ is None or e.__traceback__.tb_next is not None:
                raise
            result = None
        if result is not None:
            return result
    return dense_fallback(func, args, kwargs)


# the base class reaches these through ``_late`` (Note [The base class's import cycles])
_base._late.__dict__.update(torch_function=torch_function)
