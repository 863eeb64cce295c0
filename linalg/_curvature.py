"""Jacobian, Hessian and generalized Gauss-Newton (GGN / Fisher) operators of a function,
matrix-free through our own transforms.

For ``f: R^n -> R^m`` at ``x`` (tensors of any shape, flattened row-major):

* ``J v = jvp(f, (x,), (v,))[1]`` and ``u^T J = vjp(f, x)[1](u)``: one forward or one reverse
  pass per column (the columns of a matrix are one `vmap`);
* ``H v = jvp(grad(f), (x,), (v,))[1]`` (forward over reverse) for a scalar ``f``: symmetric, so
  ``H^T = H``;
* ``G v = J^T H_L J v`` for a model ``z = f(x)`` and a loss ``L(z)``: a jvp through f, a
  Hessian-vector product of L at z, a vjp through f. Symmetric, positive semi-definite for a
  convex L (for softmax cross-entropy it is the Fisher information).

The operators hold ``x`` as their tensor, so grad, jvp and vmap with respect to ``x`` go through
their products (transforms nest: a grad of ``u^T J v`` differentiates the inner jvp). Nothing is
formed unless asked (`to_dense` is ``jacfwd`` by columns); solves are the dense default, or CG on
request for the symmetric ones (``solve(H, b, method="cg")``, implicitly differentiated).
"""

from __future__ import annotations

import torch

from functransforms._ad import grad as _grad
from functransforms._ad import jvp as _jvp
from functransforms._ad import vjp as _vjp
from functransforms._vmap import vmap as _vmap

from ._base import LinearOperator


def _columns(X, n):
    """``X (..., n, k)`` as rows of length n: ``(B, n)``, and how to put results back."""
    batch, k = X.shape[:-2], X.shape[-1]
    V = X.movedim(-1, -2).reshape(-1, n)

    def back(Y):  # (B, p) -> (..., p, k)
        return Y.reshape(batch + (k, Y.shape[-1])).movedim(-1, -2)

    return V, back


def _check_fn(fn, call):
    if not callable(fn):
        raise TypeError(f"{call}: expected `fn` to be a callable, received {type(fn).__name__}.")


def _check_x(x, call):
    if not isinstance(x, torch.Tensor) or not (x.is_floating_point() or x.is_complex()):
        raise TypeError(
            f"{call}: expected `x` to be a floating-point tensor, received "
            f"{type(x).__name__ if not isinstance(x, torch.Tensor) else x.dtype}."
        )


class _FunctionOperator(LinearOperator):
    """Operators defined by a function ``fn`` (static) at a point ``x`` (the tensor child)."""

    _tree_fields = ("x",)
    _static_fields = ("fn",)

    @classmethod
    def _from_children(cls, children, kwargs):
        # the functions (static) come first in the constructors: fn(, loss), x
        statics = [kwargs.pop(name) for name in cls._static_fields]
        return cls(*statics, *children, **kwargs)

    @property
    def _core_ndims(self):
        return (self.x.dim(),)  # x is one point, never a batch

    def _repr_extra(self):
        return f"fn={getattr(self.fn, '__name__', type(self.fn).__name__)}, x={tuple(self.x.shape)}"

    def _expand_batch(self, batch_shape):
        if batch_shape:
            raise ValueError(
                f"{type(self).__name__}: an operator of a function has no batch dimensions; "
                "vmap over the point instead (ft.vmap(lambda x: ...)(xs))."
            )
        return self


class JacobianOperator(_FunctionOperator):
    """The Jacobian ``J = df/dx`` of ``fn`` at ``x``, ``(m, n)`` with ``n = x.numel()`` and
    ``m = fn(x).numel()``: ``J @ V`` by jvps, ``U @ J`` and ``J.mT @ U`` by vjps.

    Args:
        fn: a function of one tensor, returning one tensor (any shapes).
        x: the point (flattened row-major for the operator).

    Example:
        >>> import torch
        >>> from functransforms.linalg import JacobianOperator
        >>> x = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
        >>> J = JacobianOperator(lambda x: x[:2] * x[1:], x)  # [2, 3]
        >>> J.to_dense().tolist()
        [[2.0, 1.0, 0.0], [0.0, 3.0, 2.0]]
        >>> (J.mT @ torch.ones(2, dtype=torch.float64)).tolist()  # one vjp: [3]
        [2.0, 4.0, 2.0]
    """

    def __init__(self, fn, x: torch.Tensor, **props):
        call = "JacobianOperator(fn, x)"
        _check_fn(fn, call)
        _check_x(x, call)
        self.fn, self.x = fn, x
        self.out_shape = _eval_shape(fn, x, call)
        m = 1
        for s in self.out_shape:
            m *= s
        super().__init__((m, x.numel()), x.dtype, x.device, **props)

    def _matmul(self, X):
        V, back = _columns(X, self.shape[-1])
        x = self.x

        def jv(v):
            return _jvp(self.fn, (x,), (v.reshape(x.shape),))[1].reshape(-1)

        return back(_vmap(jv)(V))

    def _rmatmul(self, X):
        # U J: rows of U are cotangents, one vjp (the pullback is built once)
        V, back = _columns(X.mT, self.shape[-2])
        _, pull = _vjp(self.fn, self.x)
        out_shape = self.out_shape

        def uj(u):
            return pull(u.reshape(out_shape))[0].reshape(-1)

        return back(_vmap(uj)(V)).mT


class HessianOperator(_FunctionOperator):
    """The Hessian of a scalar ``fn`` at ``x``, ``(n, n)``: ``H @ V`` by forward-over-reverse
    (``jvp`` of ``grad``), symmetric.

    Example:
        >>> import torch
        >>> from functransforms.linalg import HessianOperator
        >>> x = torch.tensor([1.0, 2.0], dtype=torch.float64)
        >>> H = HessianOperator(lambda x: (x**3).sum() + x[0] * x[1], x)  # [2, 2]
        >>> H.to_dense().tolist()
        [[6.0, 1.0], [1.0, 12.0]]
    """

    def __init__(self, fn, x: torch.Tensor, **props):
        call = "HessianOperator(fn, x)"
        _check_fn(fn, call)
        _check_x(x, call)
        shape = _eval_shape(fn, x, call)
        if len(shape) != 0:
            raise ValueError(
                f"{call}: expected `fn` to return a scalar, received shape {tuple(shape)}; for a "
                "vector function use JacobianOperator, or GGNOperator with a loss."
            )
        self.fn, self.x = fn, x
        props["symmetric"] = True
        n = x.numel()
        super().__init__((n, n), x.dtype, x.device, **props)

    def _matmul(self, X):
        V, back = _columns(X, self.shape[-1])
        x, g = self.x, _grad(self.fn)

        def hv(v):
            return _jvp(g, (x,), (v.reshape(x.shape),))[1].reshape(-1)

        return back(_vmap(hv)(V))

    def _rmatmul(self, X):
        return self._matmul(X.mT).mT

    def _transpose(self):
        return self


class GGNOperator(_FunctionOperator):
    """The generalized Gauss-Newton matrix ``G = J^T H_L J`` of a model ``z = fn(x)`` and a loss
    ``L(z)`` (a scalar function of the output), ``(n, n)``, symmetric; positive semi-definite
    for a convex loss (the Fisher information for softmax cross-entropy and Gaussian
    likelihoods). ``G @ V``: a jvp through fn, a Hessian-vector product of L, a vjp through fn.

    Example:
        >>> import torch
        >>> from functransforms.linalg import GGNOperator
        >>> A = torch.tensor([[1.0, 2.0], [0.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
        >>> G = GGNOperator(lambda x: A @ x, lambda z: 0.5 * (z**2).sum(), torch.ones(2))
        >>> G.to_dense().tolist()  # A^T A for a linear model and a squared loss: [2, 2]
        [[2.0, 2.0], [2.0, 5.0]]
    """

    _static_fields = ("fn", "loss")

    def __init__(self, fn, loss, x: torch.Tensor, **props):
        call = "GGNOperator(fn, loss, x)"
        _check_fn(fn, call)
        _check_fn(loss, call)
        _check_x(x, call)
        self.fn, self.loss, self.x = fn, loss, x
        props["symmetric"] = True
        n = x.numel()
        super().__init__((n, n), x.dtype, x.device, **props)

    def _matmul(self, X):
        V, back = _columns(X, self.shape[-1])
        x = self.x
        z, pull = _vjp(self.fn, x)
        g = _grad(self.loss)

        def ggn_v(v):
            jv = _jvp(self.fn, (x,), (v.reshape(x.shape),))[1]
            hjv = _jvp(g, (z,), (jv,))[1]
            return pull(hjv)[0].reshape(-1)

        return back(_vmap(ggn_v)(V))

    def _rmatmul(self, X):
        return self._matmul(X.mT).mT

    def _transpose(self):
        return self


def _eval_shape(fn, x, call):
    out = fn(x)
    if not isinstance(out, torch.Tensor):
        raise TypeError(
            f"{call}: expected `fn` to return one tensor, received {type(out).__name__}."
        )
    return out.shape
