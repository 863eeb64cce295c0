"""The structure rules: one `functools.singledispatch` function per query (lineax's pattern).

`LinearOperator` itself keeps a small abstract surface (``_matmul``, ``_rmatmul``, ``_to_dense``,
``_transpose``, metadata and properties). Everything that structure can make cheaper is a
single-dispatch function here, keyed by the type of the (first) operator:

* the dense default is registered for `LinearOperator` in ``_dense.py`` (materialize, then
  torch's dense algorithm), the lazy default of `scale` in ``_composite.py``;
* each operator module registers the identities of its own operators next to their class, with
  the identity in a comment (``inv(⊗ A_i) = ⊗ inv(A_i)`` in ``_kronecker.py``);
* users register rules for their own operators the same way (docs/linalg.md, "Structure rules
  for your own operators").

This module imports nothing from the package, so every operator module (and the base class)
can import it without a cycle.

# Note [Dispatch precedence]
A unary query dispatches on ``type(A).__mro__``: the most derived class with a registration wins
(a `CholeskyOperator` uses its own `cholesky` rule, not `RootOperator`'s; an operator without
one falls back to the dense default of `LinearOperator`). Binary products and sums of two
operators are resolved in ``_composite.py`` in a fixed order, each step returning an operator or
None ("no identity known"):

* ``a @ b``: ``matmul(a, b)`` (a's rules, by ``type(a)``), then ``rmatmul(b, a)`` (b's rules as
  the right operand, by ``type(b)``), then the lazy ``ProductOperator([a, b])``;
* ``a + b``: ``add(a, b)``, then ``add(b, a)`` (sums commute, so each side's rules see the
  other as their second argument), then the lazy ``SumOperator([a, b])``.

The left operand is asked first, always; nothing else decides.
"""

from __future__ import annotations

import functools


def _no_rule(query: str, A) -> TypeError:
    return TypeError(
        f"{query}(A, ...): expected a LinearOperator, received {type(A).__name__}. Every "
        "LinearOperator has a dense default; register a structured rule with "
        f"`@functransforms.linalg.{query}.register(MyOperator)`."
    )


# ------------------------------------------------------------------ unary queries
@functools.singledispatch
def solve(A, B):
    """``A^{-1} B`` for a square operator ``A`` and ``B`` of shape ``(..., n, k)`` (always a
    matrix: vectors, ``left=False``, validation, iterative methods and implicit derivatives are
    handled by the public `functransforms.linalg.solve`)."""
    raise _no_rule("solve", A)


@functools.singledispatch
def inv(A):
    """The inverse of a square operator, as an operator (structured where A is)."""
    raise _no_rule("inv", A)


@functools.singledispatch
def slogdet(A):
    """``(sign, log|det A|)`` of a square operator."""
    raise _no_rule("slogdet", A)


@functools.singledispatch
def cholesky(A):
    """The lower Cholesky factor ``L`` (``A = L L^H``) of a positive definite operator, as an
    operator."""
    raise _no_rule("cholesky", A)


@functools.singledispatch
def eigh(A):
    """``(eigenvalues ascending, eigenvectors as an operator)`` of a symmetric operator."""
    raise _no_rule("eigh", A)


@functools.singledispatch
def svd(A):
    """The reduced ``(U, S, Vh)``: U and Vh operators, S descending."""
    raise _no_rule("svd", A)


@functools.singledispatch
def trace(A):
    """The trace of a square operator."""
    raise _no_rule("trace", A)


@functools.singledispatch
def diagonal(A):
    """The main diagonal ``(..., min(m, n))``."""
    raise _no_rule("diagonal", A)


@functools.singledispatch
def scale(A, c):
    """``c * A`` for a scalar ``c`` (a number or a 0-d tensor), as an operator."""
    raise _no_rule("scale", A)


# ------------------------------------------------------------------ binary identities
# Base bodies return None: "no identity known", and the resolver (Note [Dispatch precedence])
# asks the other operand, then builds a lazy operator.
@functools.singledispatch
def matmul(a, b):
    """A structured ``a @ b`` of two operators known to ``a``'s class, or None."""
    return None


@functools.singledispatch
def rmatmul(b, a):
    """A structured ``a @ b`` of two operators known to ``b``'s class (the right operand), or
    None."""
    return None


@functools.singledispatch
def add(a, b):
    """A structured ``a + b`` of two operators known to ``a``'s class, or None."""
    return None
