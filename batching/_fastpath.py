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
re-enables torch's autograd (Note [Torch autograd through our transforms], ``_core/levels.py``).

Metadata queries on a BatchedTensor (``x.shape``, ``x.dim()``) would pass through that Python
``__torch_function__`` too (3.5 us each under load); the class shadows them instead (Note
[Metadata reads without __torch_function__], ``_tensor.py``).
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from functransforms import _compat
from functransforms._core.levels import (
    OWN_DISPATCH,
    TransformTensor,
    below_torch_autograd,
    linear_args,
)

_aten = torch.ops.aten
_torch_requires_grad = _compat.tensor_requires_grad  # not a wrapper's property


def _is_pointwise_packet(name):
    """True when every functional ATen overload of ``name`` taking a tensor is a deterministic
    pointwise op returning one fresh tensor. Asked through torch's C calls: the table asks
    about every public name of torch, and ``getattr(torch.ops.aten, name)`` would make and keep
    a packet and an ``OpOverload`` per overload (~4.7k objects at the first vmap: Note [Cold
    start and torch's garbage] in benchmarks/bench_core.py)."""
    qualname = "aten::" + name
    try:
        _, overloads = _compat.op_overload_names(qualname)
    except RuntimeError:
        return False
    if overloads is None:
        return False
    seen = False
    for overload in overloads:
        schema = _compat.op_schema(qualname, overload)
        if schema.is_mutable or not any(str(a.type).startswith("Tensor") for a in schema.arguments):
            continue
        tags = _compat.op_overload_entry(qualname, overload)[2]
        returns = schema.returns
        if (
            torch.Tag.pointwise not in tags
            or torch.Tag.nondeterministic_seeded in tags
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
    # the fused pointwise kernels our pullbacks call as ATen ops (Note [Rounding as torch]):
    # under vmap of a pullback (jacrev) they take the fast path too, not the dispatcher trip
    for name in _PULLBACK_KERNELS:
        if _is_pointwise_packet(name):
            packet = getattr(_aten, name)
            for overload in packet.overloads():
                op = getattr(packet, overload)
                if not op._schema.is_mutable:  # not the out= overloads
                    table[op] = -1
    return table


_PULLBACK_KERNELS = (
    "tanh_backward",
    "sigmoid_backward",
    "gelu_backward",
    "elu_backward",
    "softplus_backward",
    "hardswish_backward",
    "hardsigmoid_backward",
    "log_sigmoid_backward",
    "logit_backward",
    "threshold_backward",
    "silu_backward",
)


# Filled on the first vmap call (ensure_table): scanning torch's namespaces costs tens of
# milliseconds, which users of grad or linalg alone should not pay at import.
POINTWISE_FUNCS: dict = {}


def ensure_table():
    if not POINTWISE_FUNCS:
        POINTWISE_FUNCS.update(_build_table())


_NUMBERS = frozenset((int, float, bool, complex))

# Note [Pointwise ops reaching the interpreter]
#     The fast paths above see torch functions; the ATen ops that other levels' rules hand
#     down (``redispatch`` under ``vmap(grad(f))``, a jvp rule under ``jacfwd``) and those of
#     decompositions reach ``VmapInterpreter.process`` instead. For the rule of Note [Batching
#     pointwise ops] with one output (the rules in this set) and no keyword arguments, when
#     every tensor argument is a wrapper of this level and all have one batch dim and one
#     physical rank, the rule's answer is the op applied to the values, batch dim kept: the
#     physical shapes line up dim by dim, and the type promotion that the rule corrects for
#     0-d logical values (Note [0-d type promotion]) cannot differ when all tensors have one
#     rank. ``process`` then skips the generic unwrapping, the rule's argument scan and the
#     per-output wrapping (~2 us of an op's ~6). Anything else runs the rule.
ELEMENTWISE_RULES: set = set()


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
        if "out" in kwargs or kwargs.get("memory_format") not in (None, torch.preserve_format):
            return None  # a format is per example: clone's rule (Note [Memory formats per example])
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
    lower = None
    for a in (*args, *values):
        if isinstance(a, TransformTensor):
            if type(a) is not batched_cls:
                # Note [Lower levels' values in the pointwise fast path]
                #     A Dual/GradTensor of a level below this vmap is a constant here, as a
                #     plain tensor is: the vmap rule broadcasts it against the logical dims and
                #     hands the op on to that level, which is what applying ``func`` to it and
                #     the physical values does (MAML's ``p - lr * g`` under grad(vmap(grad)):
                #     an unbatched parameter of the outer grad level). Checked like a plain
                #     operand below; a level above this one (it sees the call first) and the
                #     classes with their own dispatch decline.
                if type(a) in OWN_DISPATCH:
                    return None
                if lower is None:
                    lower = []
                lower.append(a)
                n_tensors += 1
                d = a.dim()
                if d > plain_nd:
                    plain_nd = d
                continue
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
    if lower is not None:
        level = interp.level
        for a in lower:
            if a._interp.level >= level:
                return None
    if requires_grad and below_torch_autograd():
        return None  # Note [Fast path below torch's autograd]
    if n_tensors > 1:
        # Several tensors broadcast against each other: batch dims must all be in front, and a
        # plain tensor must not reach the batch dim (nor, for 0-d logical values, change the
        # type-promotion category a 0-d tensor has: Note [0-d type promotion]).
        if not front or plain_nd > nd:
            return None
        if nd == 0 and plain_nd >= 0 and not _one_dtype(args, values, batched_cls):
            return None  # with one dtype there is no promotion for the category to change
    unwrapped = [a._value if type(a) is batched_cls else a for a in args]
    if kwargs:
        kwargs = {k: (v._value if type(v) is batched_cls else v) for k, v in kwargs.items()}
        out = func(*unwrapped, **kwargs)
    else:
        out = func(*unwrapped)
    if not isinstance(out, torch.Tensor):  # e.g. x == None
        return out
    return wrap(out, bdim, interp)


def _one_dtype(args, values, batched_cls):
    """Whether every tensor among the arguments has one dtype (then 0-d type promotion has
    nothing to decide: the root cotangent of vmap(grad(loss)), a plain 0-d tensor, meets the
    loss's logical 0-d values in every reduction's pullback)."""
    dtype = None
    for a in (*args, *values):
        if isinstance(a, torch.Tensor):
            d = a._value.dtype if type(a) is batched_cls else a.dtype
            if dtype is None:
                dtype = d
            elif d != dtype:
                return False
    return True


# Note [Shaped fast path]
#     The same shortcut for the non-pointwise functions that dominate attention blocks and
#     MLP heads: ``transpose`` (and ``t``, ``mT``, ``mH``/``adjoint`` of real values),
#     ``to(dtype)``, ``matmul``/``@``, ``mm``, the dim reductions ``sum``/``mean``/``amax``/
#     ``amin``, ``softmax``/``log_softmax``, ``scaled_dot_product_attention``, ``reshape``/
#     ``view`` and ``unsqueeze`` (the last three with the batch dim in front). Each handler
#     maps the logical dims onto the physical value (the batch dim stays where it is, or goes
#     in front for matmul and sdpa) and returns None, for the ordinary path, on anything it
#     does not cover exactly: keyword arguments other than ``dim``/``keepdim``, dtypes, named
#     or out-of-range or repeated dims, 0-d logical values, matmul operands whose batch dims
#     would not line up, values of other levels, and (as above) values that require grad
#     below torch's autograd. Errors are left to the ordinary path, so their messages name
#     logical dims. The ordinary path stays the single source of semantics; every handler is
#     tested against it and PyTorch (tests/batching/test_fastpath_shaped.py).
def _live_value(a, batched_cls):
    """The physical value of a live BatchedTensor that may run here, else None."""
    if type(a) is not batched_cls or not a._interp.alive:
        return None
    v = a._value
    if type(v) is not batched_cls and v.requires_grad and below_torch_autograd():
        return None  # Note [Fast path below torch's autograd]
    return v


def _phys(d, n, bdim):
    """Logical dim ``d`` of a rank-``n`` (n >= 1) value -> its physical index, or None."""
    if type(d) is not int or not -n <= d < n:
        return None
    d %= n
    return d if d < bdim else d + 1


def _transpose(func, args, kwargs, batched_cls, wrap):
    if kwargs or len(args) != 3:
        return None
    a = args[0]
    v = _live_value(a, batched_cls)
    if v is None:
        return None
    n, bdim = v.dim() - 1, a._bdim
    if n == 0:
        return None
    d0, d1 = _phys(args[1], n, bdim), _phys(args[2], n, bdim)
    if d0 is None or d1 is None:
        return None
    return wrap(v.transpose(d0, d1), bdim, a._interp)


def _swap_last_two(func, args, kwargs, batched_cls, wrap):
    """``x.mT``, ``x.mH``/``x.adjoint()`` of a real value, ``x.t()``/``x.T`` of a logical
    matrix: one transpose of the physical value (the vjp rules of mm and linear apply them to
    cotangents under vmap(grad)). Lower ranks (errors, or aliases for ``t``) and complex
    adjoints (a lazy conjugate) take the ordinary path."""
    if kwargs or len(args) != 1:
        return None
    a = args[0]
    v = _live_value(a, batched_cls)
    if v is None:
        return None
    n, bdim = v.dim() - 1, a._bdim
    if n < 2 or (n != 2 and func in _MATRIX_ONLY) or (func in _ADJOINTS and v.is_complex()):
        return None
    return wrap(v.transpose(_phys(-2, n, bdim), _phys(-1, n, bdim)), bdim, a._interp)


def _to_dtype(func, args, kwargs, batched_cls, wrap):
    """``x.to(dtype)``: ``x`` itself when the dtype is already that (as torch returns self),
    else one conversion of the physical value (rules convert cotangents and one-hot
    selections this way). Devices, keywords and other overloads take the ordinary path."""
    if kwargs or len(args) != 2 or type(args[1]) is not torch.dtype:
        return None
    a = args[0]
    v = _live_value(a, batched_cls)
    if v is None:
        return None
    if v.dtype == args[1]:
        return a
    return wrap(v.to(args[1]), a._bdim, a._interp)


_MATRIX_ONLY = {torch.t, torch.Tensor.t, torch.Tensor.T.__get__}
_ADJOINTS = {torch.Tensor.mH.__get__, torch.adjoint, torch.Tensor.adjoint}

_NO_DIM = object()
_DIM_KEEPDIM = frozenset(("dim", "keepdim"))


def _reduction(func, args, kwargs, batched_cls, wrap):
    if len(args) > 3 or (kwargs and not kwargs.keys() <= _DIM_KEEPDIM):
        return None
    a = args[0]
    v = _live_value(a, batched_cls)
    if v is None:
        return None
    n, bdim = v.dim() - 1, a._bdim
    if n == 0:
        return None
    dim = args[1] if len(args) > 1 else kwargs.get("dim", _NO_DIM) if kwargs else _NO_DIM
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False) if kwargs else False
    if type(keepdim) is not bool:
        return None
    if dim is _NO_DIM or dim is None or (type(dim) in (list, tuple) and len(dim) == 0):
        dims = [d for d in range(n + 1) if d != bdim]
    elif type(dim) is int:
        d = _phys(dim, n, bdim)
        if d is None:
            return None
        dims = [d]
    elif type(dim) in (list, tuple):
        dims = [_phys(d, n, bdim) for d in dim]
        if None in dims or len(set(dims)) != len(dims):
            return None
    else:
        return None
    out = func(v, dims, keepdim)
    return wrap(out, bdim if keepdim else bdim - sum(d < bdim for d in dims), a._interp)


def _softmax(func, args, kwargs, batched_cls, wrap):
    if kwargs or len(args) != 2:
        return None
    a = args[0]
    v = _live_value(a, batched_cls)
    if v is None:
        return None
    n, bdim = v.dim() - 1, a._bdim
    d = _phys(args[1], n, bdim) if n > 0 else None
    if d is None:
        return None
    return wrap(func(v, d), bdim, a._interp)


def _matmul(func, args, kwargs, batched_cls, wrap):
    if kwargs or len(args) != 2:
        return None
    a, b = args
    ba, bb = type(a) is batched_cls, type(b) is batched_cls
    if ba and bb:
        if a._interp is not b._interp:
            return None
        va, vb = _live_value(a, batched_cls), _live_value(b, batched_cls)
        if va is None or vb is None:
            return None
        n = va.dim() - 1
        if n < 2 or vb.dim() - 1 != n:  # equal ranks >= 2: batch dims line up
            return None
        va = va if a._bdim == 0 else va.movedim(a._bdim, 0)
        vb = vb if b._bdim == 0 else vb.movedim(b._bdim, 0)
        if n == 2 and va.shape[2] == vb.shape[1] and va.dtype == vb.dtype:
            # Note [Batched matrix products as bmm]
            #     Two batched matrices are one ``bmm`` of the physical values: torch's matmul of
            #     two 3-d tensors with one batch size runs exactly that bmm (its expand and
            #     reshapes are no-op views), so the bits are the same. Called directly, it also
            #     reaches a lower level's wrapper inside as one op: matmul, CompositeImplicit,
            #     decomposed there into six (expand, view, expand, view, bmm, _unsafe_view),
            #     each a node of an outer grad level (MAML's grad(vmap(grad)) sweep). Shapes
            #     or dtypes that do not fit go to matmul, for its error.
            return wrap(torch.bmm(va, vb), 0, a._interp)
        return wrap(func(va, vb), 0, a._interp)
    w, plain = (a, b) if ba else (b, a)
    if type(plain) is not torch.Tensor:
        return None
    v = _live_value(w, batched_cls)
    if v is None or (plain.requires_grad and below_torch_autograd()):
        return None
    n, p = v.dim() - 1, plain.dim()
    # the plain operand's batch dims must align with the logical ones, never with the mapped
    # dim: a batched left operand of rank >= 1 takes a plain right one of rank <= max(n, 2); a
    # batched right operand must be a matrix (or a batch of them) and the plain left one no
    # higher in rank
    if ba:
        if n < 1 or p < 1 or p > max(n, 2):
            return None
    elif n < 2 or p < 1 or p > n:
        return None
    v = v if w._bdim == 0 else v.movedim(w._bdim, 0)
    return wrap(func(v, plain) if ba else func(plain, v), 0, w._interp)


def _mm(func, args, kwargs, batched_cls, wrap):
    """``mm`` of two logical matrices of one dtype (anything else: the ordinary path, for its
    error), as one ``matmul`` of the physical values, batch dims in front."""
    if kwargs or len(args) != 2:
        return None
    a, b = args
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dtype != b.dtype:
        return None
    ba, bb = type(a) is batched_cls, type(b) is batched_cls
    if (a.dim() != 2 or b.dim() != 2) or (ba and bb and a._interp is not b._interp):
        return None
    if not ba and type(a) is not torch.Tensor or not bb and type(b) is not torch.Tensor:
        return None
    va = _live_value(a, batched_cls) if ba else a
    vb = _live_value(b, batched_cls) if bb else b
    if va is None or vb is None:
        return None
    if (not ba and va.requires_grad or not bb and vb.requires_grad) and below_torch_autograd():
        return None  # Note [Fast path below torch's autograd]
    va = va if not ba or a._bdim == 0 else va.movedim(a._bdim, 0)
    vb = vb if not bb or b._bdim == 0 else vb.movedim(b._bdim, 0)
    return wrap(torch.matmul(va, vb), 0, (a if ba else b)._interp)


def _linear(func, args, kwargs, batched_cls, wrap):
    """``F.linear(x, w, b)`` of one example (a contiguous 1-d logical ``x``, batch dim in front)
    with plain ``w`` and ``b``: the ops the ordinary path runs on the physical value, in its
    order. torch decomposes the call into ``view(addmm(b, view(x, [1, n]), w.t()), [m])``
    (``_flatten_nd_linear``), and addmm's vmap rule computes ``matmul(xv, w.t()) + b`` on the
    ``[B, 1, n]`` view: three dispatched ops and two wrappers saved per layer of a per-sample
    MLP (benchmarks/bench_core.py, row (a)). Other shapes, layouts, dtype or device mixes,
    lazy conjugates: the ordinary path (its errors)."""
    args = linear_args(args, kwargs)
    if args is None:
        return None
    x, w, b = args
    if type(w) is not torch.Tensor or type(b) is not torch.Tensor or type(x) is not batched_cls:
        return None
    v = _live_value(x, batched_cls)
    if v is None or type(v) is not torch.Tensor or x._bdim != 0 or v.dim() != 2:
        return None
    B, n = v.shape
    if (
        w.dim() != 2
        or b.dim() != 1
        or w.shape[1] != n
        or b.shape[0] != w.shape[0]
        or not (v.dtype == w.dtype == b.dtype)
        or not (v.device == w.device == b.device)
        or w.layout != torch.strided
        or b.layout != torch.strided
        or w.is_conj()
        or b.is_conj()
        or w.is_neg()
        or b.is_neg()
        or (v.stride(1) != 1 and n > 1)  # a strided x decomposes another way
    ):
        return None
    if (w.requires_grad or b.requires_grad) and below_torch_autograd():
        return None  # Note [Fast path below torch's autograd]
    out = torch.matmul(v.view(B, 1, n), w.t()) + b
    return wrap(out.view(B, w.shape[0]), 0, x._interp)


_SDPA_KWARGS = frozenset(("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"))


def _sdpa(func, args, kwargs, batched_cls, wrap):
    """``scaled_dot_product_attention`` of three values of one level, of equal logical rank,
    with no mask, no dropout and no grouped-query broadcasting: one batched call (its
    kernels take any number of leading dims) instead of the dozen ops of its decomposition."""
    if len(args) != 3 or (kwargs and not kwargs.keys() <= _SDPA_KWARGS):
        return None
    kwargs = kwargs or {}
    if (
        kwargs.get("attn_mask") is not None
        or kwargs.get("dropout_p", 0.0) != 0.0
        or kwargs.get("enable_gqa", False)
        or type(kwargs.get("is_causal", False)) is not bool
    ):
        return None
    scale = kwargs.get("scale")
    if scale is not None and type(scale) is not float and type(scale) is not int:
        return None
    q = args[0]
    values = []
    for a in args:
        v = _live_value(a, batched_cls)
        if v is None or a._interp is not q._interp:
            return None
        values.append(v if a._bdim == 0 else v.movedim(a._bdim, 0))
    n = values[0].dim()
    if n < 3 or values[1].dim() != n or values[2].dim() != n:
        return None
    out = func(*values, is_causal=kwargs.get("is_causal", False), scale=scale)
    return wrap(out, 0, q._interp)


def _shape_arg(args):
    """The target shape of ``x.reshape(*shape)`` / ``x.reshape(shape)``: a list of ints, or
    None."""
    shape = args[1] if len(args) == 2 and type(args[1]) in (list, tuple, torch.Size) else args[1:]
    if any(type(s) is not int or s < -1 for s in shape) or list(shape).count(-1) > 1:
        return None
    return list(shape)


def _reshape(func, args, kwargs, batched_cls, wrap):
    """``reshape``/``view`` with the batch dim in front: the batch dim is kept as its own
    leading dim, so the rest is the logical reshape (a view exactly when the logical one is);
    anything the logical shape does not fit goes on to the ordinary path for its error."""
    if kwargs or len(args) < 2:
        return None
    a = args[0]
    v = _live_value(a, batched_cls)
    if v is None or a._bdim != 0:
        return None
    shape = _shape_arg(args)
    if shape is None:
        return None
    B = v.shape[0]
    if B == 0:
        return None
    numel = v.numel() // B
    known = 1
    for s in shape:
        if s != -1:
            known *= s
    if (-1 in shape and (known == 0 or numel % known)) or (-1 not in shape and known != numel):
        return None
    return wrap(func(v, [B, *shape]), 0, a._interp)


def _unsqueeze(func, args, kwargs, batched_cls, wrap):
    if kwargs or len(args) != 2 or type(args[1]) is not int:
        return None
    a = args[0]
    v = _live_value(a, batched_cls)
    if v is None or a._bdim != 0:
        return None
    n, d = v.dim() - 1, args[1]
    if not -n - 1 <= d <= n:
        return None
    return wrap(func(v, d % (n + 1) + 1), 0, a._interp)


def _shaped_table():
    table = {}
    for fn in (torch.transpose, torch.Tensor.transpose, torch.swapaxes, torch.Tensor.swapaxes):
        table[fn] = _transpose
    for fn in (torch.Tensor.mT.__get__, *_MATRIX_ONLY, *_ADJOINTS):
        table[fn] = _swap_last_two
    table[torch.Tensor.to] = _to_dtype
    for name in ("sum", "mean", "amax", "amin"):
        table[getattr(torch, name)] = _reduction
        table[getattr(torch.Tensor, name)] = _reduction
    for name in ("softmax", "log_softmax"):
        table[getattr(torch, name)] = _softmax
        table[getattr(torch.Tensor, name)] = _softmax
    for fn in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__):
        table[fn] = _matmul
    for fn in (torch.mm, torch.Tensor.mm):
        table[fn] = _mm
    table[F.scaled_dot_product_attention] = _sdpa
    table[F.linear] = _linear
    for fn in (torch.reshape, torch.Tensor.reshape, torch.Tensor.view):
        table[fn] = _reshape
    for fn in (torch.unsqueeze, torch.Tensor.unsqueeze):
        table[fn] = _unsqueeze
    return table


SHAPED_FUNCS: dict = _shaped_table()
