"""Note [Pointwise fast path]

Every ATen op on a BatchedTensor costs one trip through ``__torch_dispatch__``: the dispatcher
boxes the arguments into Python objects, we route, unwrap, apply the rule, and build a new
wrapper. For a pointwise op on a (64, 8) input that trip costs several times the op itself,
and pointwise chains are most of what users vmap (activations, losses, physics formulas).

So BatchedTensor also defines ``__torch_function__``, which runs *before* the dispatcher: for
the public torch functions whose every ATen overload is pointwise (derived from the op tags,
not a hand list), when every wrapper among the arguments belongs to one live vmap level with
its batch dim in front and the logical ranks line up, the function is applied to the
physical values directly and the result wrapped once. Right-aligned broadcasting then lines
logical dims up with logical dims exactly as the slow path's rule does
(Note [Batching pointwise ops]). Anything else (other levels, a batch dim elsewhere, rank
mismatches, ``out=``, in-place) takes the ordinary path through ``__torch_dispatch__``, which
stays the single source of semantics; the fast path is a shortcut to the same answer, tested
against it (tests/batching/test_fastpath.py).

Note [Fast path below torch's autograd]: at top level the function runs above the Autograd
keys, so torch records it on values that require grad. Called from inside a rule (a rule of
another level applying ``x * y`` to this level's wrappers), it runs below them, where nothing
is recorded: then, if a value requires grad, the ordinary path is taken, whose dispatch
re-enables torch's autograd (Note [Torch autograd through our transforms], ``_core.py``).

The price is that metadata queries on a BatchedTensor (``x.shape``, ``x.dim()``) now pass through
a Python ``__torch_function__`` too; they return at its first line.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from functransforms import _compat
from functransforms._core import TransformTensor, below_torch_autograd

_aten = torch.ops.aten
_torch_requires_grad = _compat.tensor_requires_grad  # not a wrapper's property


def _is_pointwise_packet(name):
    """True when every functional ATen overload of ``name`` taking a tensor is a deterministic
    pointwise op returning one fresh tensor."""
    packet = getattr(_aten, name, None)
    if not isinstance(packet, _compat.OpOverloadPacket):
        return False
    seen = False
    for overload in packet.overloads():
        op = getattr(packet, overload)
        schema = op._schema
        if schema.is_mutable or not any(str(a.type).startswith("Tensor") for a in schema.arguments):
            continue
        returns = schema.returns
        if (
            torch.Tag.pointwise not in op.tags
            or torch.Tag.nondeterministic_seeded in op.tags
            or len(returns) != 1
            or str(returns[0].type) != "Tensor"
            or returns[0].alias_info is not None
        ):
            return False
        seen = True
    return seen


_DUNDERS = {
    "add": ("__add__", "__radd__"),
    "sub": ("__sub__", "__rsub__"),
    "mul": ("__mul__", "__rmul__"),
    "div": ("__truediv__", "__rtruediv__", "__div__", "__rdiv__"),
    "floor_divide": ("__floordiv__", "__rfloordiv__"),
    "remainder": ("__mod__", "__rmod__"),
    "pow": ("__pow__", "__rpow__"),
    "neg": ("__neg__",),
    "abs": ("__abs__",),
    "eq": ("__eq__",),
    "ne": ("__ne__",),
    "lt": ("__lt__",),
    "le": ("__le__",),
    "gt": ("__gt__",),
    "ge": ("__ge__",),
    "bitwise_and": ("__and__", "__rand__"),
    "bitwise_or": ("__or__", "__ror__"),
    "bitwise_xor": ("__xor__", "__rxor__"),
    "bitwise_not": ("__invert__",),
}


def _build_table():
    """func -> index of its ``inplace`` parameter (-1 when it has none)."""
    table = {}
    names = {n for src in (torch, torch.Tensor, F) for n in dir(src) if not n.startswith("_")}
    for name in names:
        if name.endswith("_") or not _is_pointwise_packet(name):
            continue
        for src in (torch, torch.Tensor):
            fn = getattr(src, name, None)
            if callable(fn):
                table[fn] = -1
        for dunder in _DUNDERS.get(name, ()):
            fn = getattr(torch.Tensor, dunder, None)
            if callable(fn):
                table[fn] = -1
        fn = getattr(F, name, None)
        if callable(fn) and fn not in table:
            try:
                params = list(inspect.signature(fn).parameters)
            except (TypeError, ValueError):  # C builtins without a signature: no inplace flag
                params = []
            table[fn] = params.index("inplace") if "inplace" in params else -1
    return table


# Filled on the first vmap call (ensure_table): scanning torch's namespaces costs tens of
# milliseconds, which users of grad or linalg alone should not pay at import.
POINTWISE_FUNCS: dict = {}


def ensure_table():
    if not POINTWISE_FUNCS:
        POINTWISE_FUNCS.update(_build_table())


_NUMBERS = frozenset((int, float, bool, complex))


def pointwise_fast(func, inplace_at, args, kwargs, batched_cls, wrap):
    """Apply ``func`` to the physical values, or return None to take the ordinary path.

    ``inplace_at`` is the position of the function's ``inplace`` flag, -1 when it has none. The
    two shapes that dominate real code (one wrapper, optionally with a Python number) are
    checked first without building anything."""
    if inplace_at >= 0 and (
        (len(args) > inplace_at and args[inplace_at]) or (kwargs and kwargs.get("inplace"))
    ):
        return None
    if not kwargs:
        n = len(args)
        if n == 1 or (n == 2 and type(args[1]) in _NUMBERS):
            a = args[0]
            if type(a) is batched_cls and a._interp.alive:
                v = a._value
                if (
                    type(v) is not batched_cls
                    and _torch_requires_grad(v)
                    and below_torch_autograd()
                ):
                    return None  # Note [Fast path below torch's autograd]
                return wrap(func(v, *args[1:]), a._bdim, a._interp)
            return None
        if n == 2 and type(args[0]) in _NUMBERS:
            b = args[1]
            if type(b) is batched_cls and b._interp.alive:
                v = b._value
                if (
                    type(v) is not batched_cls
                    and _torch_requires_grad(v)
                    and below_torch_autograd()
                ):
                    return None
                return wrap(func(args[0], v), b._bdim, b._interp)
            return None
    return _pointwise_general(func, args, kwargs, batched_cls, wrap)


def _pointwise_general(func, args, kwargs, batched_cls, wrap):
    if kwargs:
        if "out" in kwargs:
            return None
        values = kwargs.values()
    else:
        values = ()
    interp = None
    bdim = 0
    front = True
    nd = -1
    n_tensors = 0
    plain_nd = -1
    requires_grad = False
    for a in (*args, *values):
        if isinstance(a, TransformTensor):
            if type(a) is not batched_cls:
                return None
            if interp is None:
                interp = a._interp
            elif a._interp is not interp:
                return None
            v = a._value
            if not requires_grad and type(v) is not batched_cls:
                requires_grad = _torch_requires_grad(v)
            d = v.dim() - 1
            if nd == -1:
                nd = d
            elif d != nd:
                return None
            bdim = a._bdim
            front = front and bdim == 0
            n_tensors += 1
        elif isinstance(a, torch.Tensor):
            n_tensors += 1
            requires_grad = requires_grad or _torch_requires_grad(a)
            d = a.dim()
            if d > plain_nd:
                plain_nd = d
        elif type(a) is list or type(a) is tuple:
            return None
    if interp is None or not interp.alive:
        return None
    if requires_grad and below_torch_autograd():
        return None  # Note [Fast path below torch's autograd]
    if n_tensors > 1:
        # Several tensors broadcast against each other: batch dims must all be in front, and a
        # plain tensor must not reach the batch dim (nor, for 0-d logical values, change the
        # type-promotion category a 0-d tensor has: Note [0-d type promotion]).
        if not front or plain_nd > nd or (nd == 0 and plain_nd >= 0):
            return None
    unwrapped = [a._value if type(a) is batched_cls else a for a in args]
    if kwargs:
        kwargs = {k: (v._value if type(v) is batched_cls else v) for k, v in kwargs.items()}
        out = func(*unwrapped, **kwargs)
    else:
        out = func(*unwrapped)
    if not isinstance(out, torch.Tensor):  # e.g. x == None
        return out
    return wrap(out, bdim, interp)
