"""Nested tensors under vmap: one example per component.

Note [Nested tensors under vmap]
    ``vmap(f)(nt)`` with ``nt`` a nested tensor (strided or jagged layout) maps ``f`` over its
    components, which may differ in shape, so no batching rule applies: as PyTorch's
    "nested fallback" does, every op touching the nested value runs once per component, at
    the level below, and its results are nested again.

    *One mechanism.* The value is a ``NestedBatchedTensor``: a BatchedTensor whose physical
    value is the nested tensor (batch dim 0, the only one a nested tensor maps over). Its
    ``__torch_function__`` sees every torch function on it before anything decomposes
    (``reshape``, ``matmul``, ``softmax``, indexing), so a whole function runs on each
    component's real shape (``nested_call``): the nested arguments are unbound, the dense
    batched ones sliced along their batch dim, the call repeated per example, and each
    tensor result nested with ``torch._nested_tensor_from_tensor_list`` (a strided nested
    tensor, also for jagged inputs, as PyTorch returns it). Ops that touch only dense
    values keep their batching rules: an output that never met the nested value stays dense,
    as in PyTorch. ``__torch_dispatch__`` routes an ATen op on it to the same loop (a
    safety net: ops reach it there only from code that disabled torch functions).

    *Shapes.* The examples have no common shape: ``x.shape`` and ``x.size(d)`` answer where
    the components agree and raise naming the ragged dims where they do not (PyTorch
    raises for every size read). Python values computed per component (``x.numel()``,
    ``x.is_contiguous()``) are returned when the components agree; data reads (``.item()``,
    ``bool(x)``) raise as for any batched tensor.

    *Where PyTorch raises and we compute:* view ops (``x.T``, ``reshape``, ``x[0]``,
    ``unsqueeze``, ``to(dtype)``; the results are per-component copies, which cannot be
    observed because in-place ops on nested values raise), a dense argument batched along
    another dim than 0, ``chunk_size`` (ignored: the loop already runs one component at a
    time), empty nested inputs (torch crashes). *Where PyTorch raises, we raise clearly:*
    ``in_dims``/``out_dims`` other than 0 for a nested value, in-place ops and ``out=``,
    random ops under ``randomness='error'``, and another transform of a value whose examples
    differ in shape (``vmap(grad(f))``, ``vmap(vmap(f))``, ``grad`` of a function vmapped over
    nested inputs): the inner level would need one logical shape. See
    docs/torch_func_differences.md.
"""

from __future__ import annotations

import warnings

import torch

from functransforms import _compat
from functransforms import _pytree as pt
from functransforms._core.levels import OWN_DISPATCH, TransformTensor, _innermost
from functransforms._core.metadata import SLOW_METADATA
from functransforms._core.ops import draws_random, op_name
from functransforms.errors import DataDependentError, FallbackWarning, InplaceError, raise_random

from ._tensor import BatchedTensor, _mk
from .random import _drawing

_from_list = _compat.nested_tensor_from_tensor_list
_OpOverload = _compat.OpOverload
_WARNED: set = set()

# functions that read values out as Python data: they raise, as for any batched tensor (other
# Python values, such as x.numel(), are the examples' metadata: returned when they agree)
_DATA_READS = frozenset(
    "item __bool__ __nonzero__ equal allclose is_nonzero is_same_size data_ptr untyped_storage "
    "storage _local_scalar_dense".split()
)
# the ordinary BatchedTensor path: methods about the wrapper object itself, not its values,
# and ``__iter__``, torch's Python code that iterates over ``x.unbind(0)`` (which reaches the
# loop as an op: equal-length examples iterate, ragged ones raise)
_OWN_PATH = frozenset(
    "__hash__ __repr__ __format__ __reduce_ex__ __deepcopy__ __setstate__ __dir__ data "
    "__iter__".split()
)
_INPLACE_DUNDERS = frozenset(
    "__setitem__ __iadd__ __isub__ __imul__ __itruediv__ __ifloordiv__ __imod__ __ipow__ "
    "__iand__ __ior__ __ixor__ __ilshift__ __irshift__ __imatmul__".split()
)


def _name(func):
    """``sin``, ``T`` (a property's getter), or an ATen overload's ``aten.sin.default``."""
    if isinstance(func, _OpOverload):
        return op_name(func)
    owner = getattr(func, "__self__", None)
    if getattr(func, "__name__", None) == "__get__" and owner is not None:
        return getattr(owner, "__name__", repr(owner))
    return getattr(func, "__name__", repr(func))


def _writes(func, name, kwargs):
    if isinstance(func, _OpOverload):
        return func._schema.is_mutable
    if kwargs.get("out") is not None or name in _INPLACE_DUNDERS:
        return True
    return name.endswith("_") and not name.endswith("__")


def _component_metadata(parts, what):
    """Per dim: the components' common value of ``what(component)`` (``shape`` or ``stride``),
    or None where they differ."""
    values = [tuple(what(c)) for c in parts]
    first = values[0]
    return tuple(
        first[d] if all(v[d] == first[d] for v in values) else None for d in range(len(first))
    )


class NestedBatchedTensor(BatchedTensor):
    """A BatchedTensor whose physical value is a nested tensor, mapped over its components
    (Note [Nested tensors under vmap])."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        if name in _OWN_PATH:
            return super().__torch_function__(func, types, args, kwargs)
        interp = _innermost(args, kwargs)
        nested = _nested_leaves(args, kwargs)
        if not any(n._interp is interp for n in nested):
            # a value of an inner level meets a nested one: the inner level cannot give a
            # logical shape to examples that differ in shape
            for n in nested:
                n._common_shape(f"{name} with a value of an inner transform")
            return super().__torch_function__(func, types, args, kwargs)
        return nested_call(interp, func, name, args, kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        interp = _innermost(args, kwargs)
        if any(n._interp is interp for n in _nested_leaves(args, kwargs)):
            return nested_call(interp, func, _name(func), args, kwargs)
        return super().__torch_dispatch__(func, types, args, kwargs)

    # -- metadata: where the components agree ---------------------------------------------
    def _common_shape(self, what):
        shape = _component_metadata(self._parts, lambda c: c.shape)
        ragged = [d for d, s in enumerate(shape) if s is None]
        if ragged:
            sizes = [tuple(c.shape) for c in self._parts]
            raise RuntimeError(
                f"{self._interp.call}: {what} needs the shape of one example, but the examples "
                f"of this nested tensor differ in size along dim(s) {ragged} (their shapes: "
                f"{sizes}). Expected: code that does not depend on the ragged sizes (x.size(d) "
                "works for the dims where the examples agree), and no other transform (grad, "
                "jvp, vjp, vmap) of such a value inside vmap (PyTorch raises too). Do: pad "
                "the input (`torch.nested.to_padded_tensor(x, 0.0)`) or loop over "
                "`x.unbind()`."
            )
        return torch.Size(shape)

    @property
    def shape(self):
        return self._common_shape("x.shape")

    def size(self, dim=None):
        if dim is None:
            return self._common_shape("x.size()")
        shape = _component_metadata(self._parts, lambda c: c.shape)
        d = dim + len(shape) if dim < 0 else dim
        if not 0 <= d < len(shape):
            raise IndexError(
                f"{self._interp.call}: x.size({dim}): expected a dim in [{-len(shape)}, "
                f"{len(shape) - 1}] for an example with {len(shape)} dims."
            )
        if shape[d] is None:
            self._common_shape(f"x.size({dim})")
        return shape[d]

    def stride(self, dim=None):
        self._common_shape("x.stride()")
        st = _component_metadata(self._parts, lambda c: c.stride())
        if None in st:
            raise RuntimeError(
                f"{self._interp.call}: x.stride(): the components of this nested tensor have "
                "different strides, so an example has none. Expected: code that does not read "
                "strides (x.contiguous() first)."
            )
        return st if dim is None else st[dim]

    def dim(self):
        return self._value.dim() - 1

    ndim = property(dim)

    def _describe(self):
        return f"NestedBatchedTensor(lvl={self._interp.level}, value={self._value!r})"


SLOW_METADATA.add(NestedBatchedTensor)


OWN_DISPATCH.add(NestedBatchedTensor)  # Note [Direct route to the inner level]


def wrap_nested(value, bdim, interp, parts=None):
    """The wrapper of nested tensor ``value`` at vmap level ``interp``. Its C++ sizes are the
    components' largest, never read: every function on it is intercepted (the Note).

    ``parts``: the components as separate tensors, when the caller has them (the loop's
    results), else ``value.unbind()``. Kept on the wrapper: unbinding a nested tensor costs
    more than the per-component ops themselves."""
    comps = tuple(parts) if parts is not None else value.unbind()
    ndim = value.dim() - 1
    shape = [max((c.shape[d] for c in comps), default=0) for d in range(ndim)]
    st, acc = [0] * ndim, 1
    for d in reversed(range(ndim)):
        st[d], acc = acc, acc * max(shape[d], 1)
    r = _mk(NestedBatchedTensor, shape, st, dtype=value.dtype, device=value.device)
    assert bdim == 0, "a nested tensor maps over dim 0"
    r._value = value
    r._parts = comps
    r._bdim = 0
    r._interp = interp
    return r


def _nested_leaves(args, kwargs):
    found = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, NestedBatchedTensor):
            found.append(a)
        elif type(a) is list or type(a) is tuple:
            found.extend(b for b in a if isinstance(b, NestedBatchedTensor))
    return found


def nested_call(interp, func, name, args, kwargs):
    """Note [Nested tensors under vmap]: ``func`` once per component, results nested again."""
    if _writes(func, name, kwargs):
        raise InplaceError(
            f"{interp.call}: {name} writes in place (or into `out=`) with a nested tensor's "
            "examples, which vmap maps as one component each; that is not supported (PyTorch "
            "raises too). Expected: out-of-place code. Do: `y = x + z` instead of `x += z`."
        )
    if (
        interp.randomness == "error"
        and isinstance(func, _OpOverload)
        and draws_random(func, args, kwargs)
    ):
        raise_random(interp, func)  # at __torch_function__ the random ops' own key raises
    base = func._schema.name.partition("::")[2] if isinstance(func, _OpOverload) else name
    if base in _DATA_READS:
        raise DataDependentError(
            f"{interp.call}: {name} reads a batched (nested) tensor as a Python value, which "
            "has one answer per example. Expected: tensor code without data-dependent Python "
            "control flow. Do: use `torch.where(cond, a, b)` instead of `if`."
        )
    flat_call = not kwargs and not any(type(a) in (list, tuple, dict) for a in args)
    leaves, spec = (args, None) if flat_call else pt.tree_flatten((args, kwargs))
    per_leaf = [_examples(x, interp) for x in leaves]
    rng = torch.random.get_rng_state() if interp.randomness == "same" else None
    # 'different': a call on one component draws for that example alone, so the draws inside
    # (dropout's bernoulli_ into a fresh buffer) are left to torch, not batched again
    drawing, _drawing.active = _drawing.active, interp.randomness == "different"
    results = []
    try:
        for i in range(interp.batch_size):
            if rng is not None:  # 'same': every component draws from the same generator state
                torch.random.set_rng_state(rng)
            flat = [x if ex is None else ex[i] for x, ex in zip(leaves, per_leaf)]
            if flat_call:
                results.append(func(*flat))
            else:
                a_i, k_i = pt.tree_unflatten(spec, flat)
                results.append(func(*a_i, **k_i))
    finally:
        _drawing.active = drawing
    if name not in _WARNED and isinstance(results[0], (torch.Tensor, tuple, list)):
        _WARNED.add(name)  # metadata queries (x.size(-1), x.is_nested) are not worth one
        warnings.warn(
            f"vmap: {name} on a nested tensor runs once per component (there is no nested "
            "batching rule; as in PyTorch, correct but slow).",
            FallbackWarning,
            stacklevel=3,
        )
    same = _returns_its_input(results, leaves, per_leaf)
    if same is not None:  # e.g. contiguous(): PyTorch returns the input itself
        return same
    return _nest(interp, name, results)


def _examples(x, interp):
    """The per-example values of ``x`` at level ``interp``, or None when it is not batched."""
    if isinstance(x, BatchedTensor) and x._interp is interp:
        if isinstance(x, NestedBatchedTensor):
            return x._parts
        return x._value.unbind(x._bdim)
    return None


def _returns_its_input(results, leaves, per_leaf):
    for x, ex in zip(leaves, per_leaf):
        if ex is not None and isinstance(x, NestedBatchedTensor):
            if all(r is e for r, e in zip(results, ex)):
                return x
    return None


def _nest(interp, name, results):
    first = results[0]
    if first is None:
        return None
    if isinstance(first, torch.Tensor):
        for i, r in enumerate(results):
            if isinstance(r, TransformTensor):
                if isinstance(r, BatchedTensor) and r._interp is interp:
                    # e.g. a draw batched by randomness='different': this component's example
                    results[i] = r._value.select(r._bdim, i)
                else:
                    raise RuntimeError(
                        f"{interp.call}: {name} on a nested tensor's components gave values of "
                        "another transform (grad, jvp, vjp or an inner vmap); nesting them "
                        "again is not supported (PyTorch raises too). Do: pad the input "
                        "(`torch.nested.to_padded_tensor(x, 0.0)`) or loop over `x.unbind()`."
                    )
        # fresh results are the components (views, e.g. t[0], would alias: unbind the copy)
        fresh = all(r._base is None for r in results)
        return wrap_nested(_from_list(results), 0, interp, results if fresh else None)
    if isinstance(first, (tuple, list)) and all(isinstance(o, torch.Tensor) for o in first):
        if any(len(r) != len(first) for r in results):
            raise RuntimeError(
                f"{interp.call}: {name} returns a different number of tensors for the examples "
                f"of a nested tensor ({[len(r) for r in results]}); vmap needs the same "
                "structure per example. Expected: code that does not depend on the ragged "
                "sizes (e.g. `x.unbind()` along a ragged dim)."
            )
        parts = [_nest(interp, name, [r[j] for r in results]) for j in range(len(first))]
        return type(first)(parts)
    if all(r == first for r in results[1:]):
        return first
    raise RuntimeError(
        f"{interp.call}: {name} returns a Python value that differs between the examples of a "
        f"nested tensor ({results!r}); vmap can only return tensors per example. Expected: "
        "code that does not depend on the ragged sizes. Do: pad the input "
        "(`torch.nested.to_padded_tensor(x, 0.0)`) or loop over `x.unbind()`."
    )
