"""The `LinearOperator` base: metadata, algebra, pytree registration and torch integration.

A LinearOperator represents a (batch of) matrices of shape ``batch_shape + (m, n)`` by a few
tensors and the algorithms that exploit its structure. Nothing is materialized unless asked
(`to_dense()`), and `torch` functions called on an operator are routed to structured algorithms
through `__torch_function__` (see `_dispatch.py`).

# Note [Properties are promises]
Properties (``symmetric``, ``positive_definite``, ``lower``/``upper`` triangular, ``unitary``)
are declared by the user or derived by algebra, and are *not checked* unless ``check=True`` is
passed on construction. They choose algorithms (Cholesky instead of LU, a transpose for an
inverse, ...). A false promise gives a wrong answer, as with ``torch.linalg.eigh`` on a
non-symmetric matrix. For complex dtypes "symmetric" means Hermitian (self-adjoint).

# Note [Operators are pytrees]
Every subclass is registered in the ``functransforms`` optree namespace: its children are its
tensors (and child operators), its aux data the static configuration and the properties.
Unflattening calls the constructor again, so that shapes are recomputed from the children: under
`vmap` the same operator class is rebuilt around per-example or batched tensors.
"""

from __future__ import annotations

import functools
import math
import pathlib
import sys
import types
import warnings
from typing import Any

import torch

from functransforms._core.levels import TransformTensor
from functransforms._pytree import register_pytree_node
from functransforms.errors import DenseFallbackWarning

from . import _rules

# Note [The base class's import cycles]: the base class's algebra (A.mT, A @ B, A + B) builds
# TransposeOperator, ProductOperator and SumOperator, which subclass LinearOperator
# (_composite.py), and __torch_function__ routes through _dispatch.py's table, which needs every
# operator module. Neither is imported here (that would be an import cycle): each of those two
# modules puts its functions into ``_late`` when it is imported, and the package's __init__
# imports both before any operator can exist. A namespace read per call, no import on the hot
# path (every torch function on an operator).
_late = types.SimpleNamespace()

_PROPERTY_NAMES = ("symmetric", "positive_definite", "lower", "upper", "unitary")


class LinearOperator:
    """A structured (batch of) matrices, never materialized unless asked.

    Subclasses implement ``_matmul(X)`` for ``X`` of shape ``(..., n, k)`` and, where structure
    allows, a faster ``_rmatmul``, ``_to_dense`` and ``_transpose``. Everything else (solve,
    inv, slogdet, cholesky, eigh, svd, trace, diagonal, scale, sums and products) is a
    single-dispatch rule in ``_rules.py`` with a dense default: an operator's module registers
    the identities its structure allows (Note [Dispatch precedence]).

    Args:
        shape: ``batch_shape + (m, n)``.
        dtype, device: of the represented matrix.
        symmetric, positive_definite, lower, upper, unitary: declared properties, unchecked
            promises (see Note [Properties are promises]).
        check: verify the declared properties on construction (dense, for debugging).

    Example:
        >>> import torch
        >>> from functransforms.linalg import DiagonalOperator
        >>> D = DiagonalOperator(torch.tensor([1.0, 2.0, 4.0]))  # [3, 3]
        >>> (D @ torch.ones(3)).tolist()  # [3]
        [1.0, 2.0, 4.0]
    """

    # Names of constructor arguments that are children (tensors/operators), in order.
    _tree_fields: tuple[str, ...] = ()
    # Names of constructor keyword arguments that are static aux data.
    _static_fields: tuple[str, ...] = ()
    # Number of trailing non-batch dims of each tensor child (for batch indexing).
    _core_ndims: tuple[int, ...] = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        register_pytree_node(cls, _flatten_operator, lambda aux, ch: _unflatten_operator(aux, ch))

    def __init__(
        self,
        shape,
        dtype: torch.dtype,
        device: torch.device,
        *,
        symmetric: bool = False,
        positive_definite: bool = False,
        lower: bool = False,
        upper: bool = False,
        unitary: bool = False,
        check: bool = False,
    ):
        self._shape = shape if type(shape) is torch.Size else torch.Size(shape)
        self._dtype = dtype
        self._device = device
        self.symmetric = bool(symmetric or positive_definite)
        self.positive_definite = bool(positive_definite)
        self.lower = bool(lower)
        self.upper = bool(upper)
        self.unitary = bool(unitary)
        if check:
            self.check_properties()

    # ----------------------------------------------------------------- metadata
    @property
    def shape(self) -> torch.Size:
        return self._shape

    def size(self, dim: int | None = None):
        return self._shape if dim is None else self._shape[dim]

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def batch_shape(self) -> torch.Size:
        return self._shape[:-2]

    @property
    def ndim(self) -> int:
        return len(self._shape)

    def dim(self) -> int:
        return len(self._shape)

    @property
    def is_square(self) -> bool:
        return self._shape[-1] == self._shape[-2]

    @property
    def is_complex(self) -> bool:
        return self._dtype.is_complex

    def properties(self) -> dict[str, bool]:
        """The declared/derived properties, e.g. ``{'symmetric': True, ...}``."""
        return {name: getattr(self, name) for name in _PROPERTY_NAMES}

    def _props(self, **overrides) -> dict[str, bool]:
        props = self.properties()
        props.update(overrides)
        return props

    def check_properties(self, rtol: float = 1e-6, atol: float = 1e-8) -> None:
        """Verify the declared properties densely; raise ValueError naming the first false one."""
        A = self.to_dense()
        name = type(self).__name__
        eye = torch.eye(self._shape[-1], dtype=A.dtype, device=A.device)

        def close(x, y):
            return torch.allclose(x, y, rtol=rtol, atol=atol)

        failures = []
        if self.symmetric and not close(A, A.mH):
            failures.append("symmetric (A != A^H)")
        if self.positive_definite:
            if torch.linalg.cholesky_ex(A)[1].any():
                failures.append("positive_definite (Cholesky failed)")
        if self.lower and not close(A, A.tril()):
            failures.append("lower (nonzero entries above the diagonal)")
        if self.upper and not close(A, A.triu()):
            failures.append("upper (nonzero entries below the diagonal)")
        if self.unitary and not close(A.mH @ A, eye.expand_as(A)):
            failures.append("unitary (A^H A != I)")
        if failures:
            raise ValueError(
                f"{name}(..., check=True): declared properties do not hold: "
                f"{', '.join(failures)}. Fix the operator or drop the declaration."
            )

    def __repr__(self) -> str:
        if getattr(self, "_placeholder", False):
            fields = ", ".join(f"{n}={getattr(self, n)!r}" for n in self._tree_fields)
            return f"{type(self).__name__}({fields})"
        props = [k for k, v in self.properties().items() if v]
        try:
            extra = self._repr_extra()
        except RuntimeError:  # values unreadable here (another library's batched tensor)
            extra = ""
        parts = [f"shape={tuple(self._shape)}", f"dtype={self._dtype}"]
        if extra:
            parts.insert(0, extra)
        if props:
            parts.append("props=" + "|".join(props))
        return f"{type(self).__name__}({', '.join(parts)})"

    def _repr_extra(self) -> str:
        return ""

    # ----------------------------------------------------------------- to be specialized
    def _matmul(self, X: torch.Tensor) -> torch.Tensor:
        """``self @ X`` for a tensor ``X`` of shape ``(..., n, k)``."""
        raise NotImplementedError(f"{type(self).__name__} must implement _matmul")

    def _rmatmul(self, X: torch.Tensor) -> torch.Tensor:
        """``X @ self`` for ``X`` of shape ``(..., k, m)``: ``(self^T @ X^T)^T``."""
        return self._transpose()._matmul(X.mT).mT

    def _to_dense(self) -> torch.Tensor:
        eye = torch.eye(self._shape[-1], dtype=self._dtype, device=self._device)
        return self._matmul(eye)

    def _transpose(self) -> LinearOperator:
        return _late.TransposeOperator(self)

    def _adjoint(self) -> LinearOperator:
        if not self.is_complex:
            return self._transpose()
        return _late.AdjointOperator(self)

    def _conj(self) -> LinearOperator:
        return self._adjoint()._transpose()

    # ----------------------------------------------------------------- user-facing algebra
    def to_dense(self) -> torch.Tensor:
        """The materialized ``batch_shape + (m, n)`` tensor (ground truth in tests)."""
        return self._to_dense()

    def matmul(self, other):
        return _late.matmul(self, other)

    def __matmul__(self, other):
        return _late.matmul(self, other)

    def __rmatmul__(self, other):
        return _late.matmul(other, self)

    def __mul__(self, c):
        if isinstance(c, LinearOperator):  # elementwise, as for tensors: `@` is the product
            return _late.hadamard(self, c)
        if isinstance(c, torch.Tensor) and c.dim() > 0 and c.numel() != 1:
            raise ValueError(
                f"{type(self).__name__} * tensor: expected a scalar (Python number or 1-element "
                f"tensor), received a tensor of shape {tuple(c.shape)}."
            )
        if isinstance(c, torch.Tensor):
            c = c.reshape(())
        return _rules.scale(self, c)

    __rmul__ = __mul__

    def __truediv__(self, c):
        return self * (1.0 / c)

    def __neg__(self):
        return _rules.scale(self, -1.0)

    def __add__(self, other):
        return _late.add(self, other)

    def __radd__(self, other):
        return _late.add(other, self)

    def __sub__(self, other):
        return _late.add(self, -other)

    def __rsub__(self, other):
        return _late.add(other, -self)

    @property
    def mT(self) -> LinearOperator:
        return self._transpose()

    @property
    def mH(self) -> LinearOperator:
        return self._adjoint()

    @property
    def T(self) -> LinearOperator:
        if self.ndim != 2:
            raise ValueError(
                f"{type(self).__name__}.T: expected a 2-D operator, received shape "
                f"{tuple(self._shape)}; use .mT to transpose the last two dimensions of a batch."
            )
        return self._transpose()

    @property
    def H(self) -> LinearOperator:
        return self.T._conj() if self.is_complex else self.T

    def transpose(self, dim0: int = -2, dim1: int = -1) -> LinearOperator:
        if {dim0 % self.ndim, dim1 % self.ndim} != {self.ndim - 2, self.ndim - 1}:
            raise ValueError(
                f"{type(self).__name__}.transpose({dim0}, {dim1}): only the last two dimensions "
                "can be transposed."
            )
        return self._transpose()

    def adjoint(self) -> LinearOperator:
        return self._adjoint()

    def conj(self) -> LinearOperator:
        return self._conj() if self.is_complex else self

    def diagonal(self, offset: int = 0, dim1: int = -2, dim2: int = -1) -> torch.Tensor:
        """The main diagonal through the structure (``diagonal`` rule); other offsets: dense."""
        nd = self.ndim
        if offset == 0 and {dim1 % nd, dim2 % nd} == {nd - 2, nd - 1}:
            return _rules.diagonal(self)
        return torch.diagonal(self._to_dense(), offset=offset, dim1=dim1, dim2=dim2)

    def evaluate(self) -> torch.Tensor:
        return self._to_dense()

    def repeat(self, *sizes) -> LinearOperator:
        """``torch.Tensor.repeat`` semantics, structure kept (`functransforms.linalg.repeat`)."""
        return _late.repeat(self, *sizes)

    def sum(self, dim: int) -> LinearOperator:
        """The sum over batch dimension ``dim`` (`functransforms.linalg.sum_batch`)."""
        return _late.sum_batch(self, dim)

    # ----------------------------------------------------------------- indexing
    def __getitem__(self, key):
        if not isinstance(key, tuple):
            key = (key,)
        nb = len(self.batch_shape)
        if any(k is Ellipsis for k in key):
            i = next(j for j, k in enumerate(key) if k is Ellipsis)
            fill = self.ndim - (len(key) - 1)
            if fill < 0:
                raise IndexError(f"{type(self).__name__}[...]: too many indices for {self!r}")
            key = key[:i] + (slice(None),) * fill + key[i + 1 :]
        if len(key) > self.ndim:
            raise IndexError(
                f"{type(self).__name__}[...]: too many indices ({len(key)}) for an operator of "
                f"shape {tuple(self._shape)}."
            )
        key = key + (slice(None),) * (self.ndim - len(key))
        batch_key, (rows, cols) = key[:nb], key[nb:]
        op = self
        if any(not _is_full_slice(k) for k in batch_key):
            op = op._batch_getitem(batch_key)
        if _is_full_slice(rows) and _is_full_slice(cols):
            return op
        return op._select(rows, cols)

    def _select(self, rows, cols) -> torch.Tensor:
        # Rows and columns of A are A^T e_i and A e_j: one matmul with the selected unit vectors.
        if _is_full_slice(rows):
            eye = torch.eye(self._shape[-1], dtype=self._dtype, device=self._device)
            return self._matmul(eye[:, cols]) if _is_index_seq(cols) else self @ eye[:, cols]
        eye = torch.eye(self._shape[-2], dtype=self._dtype, device=self._device)
        if _is_index_seq(rows):
            out = self._rmatmul(eye[rows, :])  # (..., k, n)
        else:
            out = eye[rows, :] @ self  # (..., n) for an int row
        if _is_full_slice(cols):
            return out
        return out[..., cols]

    def _batch_getitem(self, batch_key) -> LinearOperator:
        """Index the batch dimensions: expand every child to the full batch shape, then index."""
        children, aux = _flatten_operator(self)
        new = []
        bshape = self.batch_shape
        for child, core in zip(children, self._child_core_ndims(children)):
            if isinstance(child, LinearOperator):
                child = child._expand_batch(bshape)._batch_getitem(batch_key)
            elif isinstance(child, torch.Tensor):
                child = child.expand(bshape + child.shape[child.dim() - core :])[batch_key]
            new.append(child)
        return _unflatten_operator(aux, new)

    def _expand_batch(self, batch_shape) -> LinearOperator:
        if self.batch_shape == torch.Size(batch_shape):
            return self
        children, aux = _flatten_operator(self)
        new = []
        for child, core in zip(children, self._child_core_ndims(children)):
            if isinstance(child, LinearOperator):
                child = child._expand_batch(batch_shape)
            elif isinstance(child, torch.Tensor):
                child = child.expand(torch.Size(batch_shape) + child.shape[child.dim() - core :])
            new.append(child)
        return _unflatten_operator(aux, new)

    def _child_core_ndims(self, children):
        if len(self._core_ndims) == len(children):
            return self._core_ndims
        return tuple(0 if isinstance(c, LinearOperator) else 2 for c in children)

    # ----------------------------------------------------------------- internal fast paths
    def _solve_closed_form(self, B: torch.Tensor) -> torch.Tensor | None:
        """``A^{-1} B`` as one node whose derivatives are exact in every mode and order, or
        None (then `implicit_solve` differentiates the structure rule's solve implicitly)."""
        return None

    def _logdet_pd(self, scale=1) -> torch.Tensor:
        """``scale * log det`` of a positive definite operator (no sign bookkeeping)."""
        rule = _rules.slogdet.dispatch(type(self))
        if rule is not _rules.slogdet.dispatch(LinearOperator):  # a structured slogdet
            out = rule(self)[1]
            return out if scale == 1 else scale * out
        warn_dense_algorithm("logdet", self)
        return self._dense_logdet_pd(scale)

    def _stores_dense(self) -> bool:
        """Whether ``to_dense()`` only reads stored entries (no dense fallback warning)."""
        return False

    def _dense_logdet_pd(self, scale=1) -> torch.Tensor:
        d = dense_cholesky(self._to_dense(), self).diagonal(dim1=-2, dim2=-1)
        return (2 * scale) * (d.real if d.is_complex() else d).log().sum(-1)

    def _frobenius_sq(self) -> torch.Tensor:
        A = self._to_dense()
        return (A * A.conj()).real.sum((-2, -1))

    # ----------------------------------------------------------------- torch integration
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _late.torch_function(func, args, kwargs or {})


# ------------------------------------------------------------------ the dense fallback
def _densify(x):
    if isinstance(x, LinearOperator):
        return x._to_dense()
    if isinstance(x, (list, tuple)):
        return type(x)(_densify(y) for y in x)
    if isinstance(x, dict):
        return {k: _densify(v) for k, v in x.items()}
    return x


def _func_name(func) -> str:
    mod = getattr(func, "__module__", None) or ""
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
    if "TensorBase" in name or mod.startswith("torch._C"):
        return name.replace("TensorBase", "Tensor")
    return f"{mod}.{name}" if mod else name


@functools.cache
def _warn_once(func_name: str, op_names: str) -> None:
    warnings.warn(
        f"{func_name} has no structured rule for {op_names}: computing it on the dense "
        f"matrix (to_dense()). Every later call does the same, silently.",
        stacklevel=4,
    )


_DENSE_WARNED: set = set()
_OUR_DIRS = (
    str(pathlib.Path(torch.__file__).parent),
    str(pathlib.Path(sys.modules["functransforms"].__file__).parent),
    str(pathlib.Path(__file__).parent),
    functools.__file__,  # singledispatch's frame
)


def warn_dense_algorithm(rule: str, A) -> None:
    """Warn once per operator class, function and call site that ``rule`` (solve, logdet, ...)
    of the structured operator ``A`` runs densely (a `DenseFallbackWarning` naming the
    operator and its size), unless A stores a dense matrix anyway."""
    if A._stores_dense():
        return
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_OUR_DIRS):
        frame = frame.f_back
    site = (frame.f_code.co_filename, frame.f_lineno) if frame is not None else ("?", 0)
    key = (type(A).__name__, rule, site)
    if key in _DENSE_WARNED:
        return
    _DENSE_WARNED.add(key)
    n = A._shape[-1]
    batch = f" (batch {tuple(A._shape[:-2])})" if len(A._shape) > 2 else ""
    warnings.warn_explicit(
        f"{rule} of {A!r}: no structured algorithm for this operator, so it runs on the dense "
        f"{n} x {n} matrix{batch}: O(n^3) time, O(n^2) memory. Register one "
        f"(functransforms.linalg.{rule}.register({type(A).__name__})) or build an operator that "
        "has one (a Kronecker product plus a scaled identity, say). Warned once per operator "
        "class and call site.",
        DenseFallbackWarning,
        site[0],
        site[1],
    )


def dense_fallback(func, args, kwargs, reason: str | None = None):
    """``func`` on the materialized operators, with a one-time warning naming it and them."""
    ops = sorted({type(x).__name__ for x in _flat_ops((args, kwargs))})
    _warn_once(reason or _func_name(func), ", ".join(ops))
    return func(*_densify(args), **_densify(kwargs))


def _flat_ops(x):
    if isinstance(x, LinearOperator):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _flat_ops(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _flat_ops(y)


def dense_cholesky(A: torch.Tensor, op: Any = None, max_tries: int = 6) -> torch.Tensor:
    """Cholesky of a dense PD matrix, retrying with increasing jitter (and warning) on failure.

    Inside a transform that cannot read the failure flag (vmap), the factorization is returned
    without the check (data-dependent control flow).
    """
    L, info = torch.linalg.cholesky_ex(A)
    try:  # reading one int (unbatched) is cheaper than torch.linalg.cholesky's own check
        failed = bool(info) if info.dim() == 0 else bool(info.any())
    except RuntimeError:  # unreadable inside a transform (data-dependent): keep the factor
        return L
    if not failed:
        return L

    name = type(op).__name__ if op is not None else "tensor"
    diag_mean = A.detach().diagonal(dim1=-2, dim2=-1).abs().mean(-1)
    scale = float(diag_mean.max()) if diag_mean.numel() else 1.0
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
    jitter = (1e-8 if A.dtype == torch.float64 else 1e-5) * (scale or 1.0)
    for _ in range(max_tries):
        L, info = torch.linalg.cholesky_ex(A + jitter * eye)
        if not _try_bool(info.ne(0).any()):
            warnings.warn(
                f"cholesky({name}): the matrix is not numerically positive definite; "
                f"added jitter {jitter:.3g} * I to the diagonal.",
                stacklevel=3,
            )
            return L
        jitter *= 10
    raise ValueError(
        f"cholesky({name}): the matrix is not positive definite even with jitter "
        f"{jitter / 10:.3g} * I. Declare it without positive_definite=True to use LU-based "
        "algorithms, or check its construction."
    )


def _try_bool(t: torch.Tensor) -> bool:
    """``bool(t)``, or False when the value cannot be read (inside a vmap, say)."""
    try:
        return bool(t)
    except RuntimeError:
        return False


def read_through(t: torch.Tensor, test) -> bool:
    """``bool(test(v))`` on the plain values inside ``t``'s transform wrappers (all examples of
    a vmap at once: a physical read, not data-dependent control flow of the program), or False
    when there are no values to read (meta, fake tensors under jit's trace)."""
    v = t
    while isinstance(v, TransformTensor):  # as functransforms.debug_unwrap
        v = v._value if hasattr(v, "_value") else v._primal
    if v.device.type == "meta":
        return False
    try:
        return bool(test(v))
    except (RuntimeError, NotImplementedError):
        return False


def _sign_prod(d: torch.Tensor) -> torch.Tensor:
    if d.is_complex():
        return (d / d.abs()).prod(-1)
    return torch.sign(d).prod(-1)


def _is_full_slice(k) -> bool:
    return isinstance(k, slice) and k == slice(None)


def _is_index_seq(k) -> bool:
    return isinstance(k, (slice, list)) or (isinstance(k, torch.Tensor) and k.dim() > 0)


def _flatten_operator(op: LinearOperator):
    children = [getattr(op, name) for name in op._tree_fields]
    static = tuple((name, getattr(op, name)) for name in op._static_fields)
    props = tuple(getattr(op, name) for name in _PROPERTY_NAMES)
    return children, (type(op), static, props)


def _unflatten_operator(aux, children):
    cls, static, props = aux
    kwargs = dict(static)
    kwargs.update(zip(_PROPERTY_NAMES, props))
    if not all(_is_tensor_tree(c) for c in children):
        # Not tensors: a tree of per-leaf annotations (vmap in_dims, ...), never an operator to
        # compute with. Rebuild the structure without validating it.
        op = object.__new__(cls)
        op._placeholder = True
        for name, child in zip(cls._tree_fields, children):
            setattr(op, name, child)
        for name, value in kwargs.items():
            setattr(op, name, value)
        return op
    return cls._from_children(list(children), kwargs)


def _is_tensor_tree(x) -> bool:
    if isinstance(x, LinearOperator):
        return not getattr(x, "_placeholder", False)
    if x is None or isinstance(x, torch.Tensor):
        return True
    if isinstance(x, (list, tuple)):
        return all(_is_tensor_tree(y) for y in x)
    return False


def _from_children(cls, children, kwargs):
    return cls(*children, **kwargs)


LinearOperator._from_children = classmethod(_from_children)


def broadcast_batch(*shapes) -> torch.Size:
    """Broadcast batch shapes (pure Python: `torch.broadcast_shapes` imports sympy on first use,
    half a second of cold start)."""
    if not any(shapes):
        return _EMPTY
    if len(shapes) == 1 or all([s == shapes[0] for s in shapes[1:]]):
        return torch.Size(shapes[0])
    ndim = max(len(s) for s in shapes)
    out = [1] * ndim
    for s in shapes:
        for i, d in enumerate(s, ndim - len(s)):
            if d != 1:
                if out[i] not in (1, d):
                    raise ValueError(
                        f"incompatible batch shapes {[tuple(x) for x in shapes]}: they do not "
                        "broadcast (sizes must match or be 1, aligned from the right)."
                    )
                out[i] = d
    return torch.Size(out)


_EMPTY = torch.Size()


def prod(xs) -> int:
    return math.prod(xs)
