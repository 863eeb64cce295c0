"""vmap: the public entry point of batching. Rules live in functransforms.batching."""

from __future__ import annotations

import functools
import sys
from collections.abc import Hashable

import torch

from . import _pytree as pt
from ._compat import dispatch_tls_is_dispatch_key_included as _is_included
from ._compat import dispatch_tls_set_dispatch_key_included as _set_included
from ._compat import functorch_interpreter as _functorch_interpreter
from ._core import compiling as _compiling
from ._core import levels as _core
from ._core.compiling import eager_under_compile
from ._core.gcpause import collector_paused
from ._typing import Dims, Func, Randomness
from .errors import describe

_RANDOMNESS = ("error", "different", "same")


def vmap(
    func: Func,
    in_dims: Dims = 0,
    out_dims: Dims = 0,
    randomness: Randomness = "error",
    *,
    chunk_size: int | None = None,
    axis_name: Hashable | None = None,
    axis_size: int | None = None,
) -> Func:
    """Vectorize ``func`` over a dimension of its inputs.

    Args:
        func: a function of tensors (pytrees of tensors) returning tensors (a pytree of them).
        in_dims: which dim of each input is mapped: an int, ``None`` (not mapped), or a tree
            prefix of the positional inputs (a tuple with one entry per input). Keyword
            arguments are never mapped.
        out_dims: where the mapped dim goes in each output: an int or a prefix of the outputs.
        randomness: ``'error'`` (random ops raise), ``'different'`` (independent draws per
            example) or ``'same'`` (one draw for the whole batch).
        chunk_size: map over at most this many examples at a time (saves memory).
        axis_name: a name for the mapped axis (any hashable), so that collectives inside
            ``func`` (``psum(x, axis_name)``, ``all_gather``, ``axis_index``, ...) can combine
            the examples along it (JAX's ``axis_name``; docs/distributed.md).
        axis_size: the size of the mapped axis; needed only when no input is mapped (every
            in_dim is None), and checked against the inputs otherwise (JAX's ``axis_size``).

    Returns:
        A function with the signature of ``func`` whose outputs have the mapped dim.

    Example:
        >>> import torch, functransforms as ft
        >>> x = torch.randn(5, 3)                       # [N, D]
        >>> w = torch.randn(3)                          # [D]
        >>> ft.vmap(torch.dot, in_dims=(0, None))(x, w).shape   # [N]
        torch.Size([5])
    """
    if randomness not in _RANDOMNESS:
        raise RuntimeError(
            f"vmap(func, randomness={randomness!r}): expected one of {_RANDOMNESS}, "
            f"got {randomness!r}."
        )
    check_chunk_size(chunk_size, "vmap")
    if not callable(func):
        raise TypeError(f"vmap(func): expected a callable, got {type(func).__name__}.")

    if axis_size is not None and (
        not isinstance(axis_size, int) or isinstance(axis_size, bool) or axis_size < 0
    ):
        raise ValueError(
            f"vmap(func, axis_size={axis_size!r}): expected None or a non-negative int, "
            f"got {axis_size!r}."
        )
    if axis_name is not None:
        try:
            hash(axis_name)
        except TypeError:
            raise TypeError(
                f"vmap(func, axis_name={axis_name!r}): expected a hashable name (e.g. a str), "
                f"got a {type(axis_name).__name__}."
            ) from None
    axis = (axis_name, axis_size)
    # Note [vmap's lean path] (docs/design/fast-paths.md): calls that fit skip _vmap_call's
    # generality
    lean = (
        chunk_size is None
        and axis_size is None
        and randomness != "different"
        and type(out_dims) is int
        and (
            type(in_dims) is int
            or (type(in_dims) is tuple and all(d is None or type(d) is int for d in in_dims))
        )
    )
    # what the lean path needs beyond the arguments, built at its first call (not here: a
    # vmap(f) made for one call would pay for it twice): (the call's name, the per-input dims)
    facts = []

    @functools.wraps(func)
    def vmapped(*args, **kwargs):
        if lean:
            # eager_under_compile's test (the general path below is wrapped by it)
            dynamo = _modules.get("torch._dynamo")
            if dynamo is not None and not _compiling.DYNAMO_KEPT_OUT:
                _compiling.keep_dynamo_out()
            if dynamo is None or not torch.compiler.is_compiling():
                if _functorch_interpreter() is not None:
                    _core._raise_inside_torch_func()
                if not facts:
                    facts.append(_lean_facts(func, in_dims, out_dims, randomness))
                try:
                    out = _lean_call(func, facts[0], out_dims, axis_name, args, kwargs)
                except RuntimeError as e:  # Note [Pre-dispatch tracing]
                    _compiling.raise_if_pre_dispatch(e)
                    raise
                if out is not _GENERAL:
                    return out
        return _vmap_call(func, in_dims, out_dims, randomness, chunk_size, args, kwargs, axis)

    return vmapped


def check_chunk_size(chunk_size, transform):
    if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool)):
        raise TypeError(
            f"{transform}(func, chunk_size={chunk_size!r}): expected None or a positive int, "
            f"got a {type(chunk_size).__name__}."
        )
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(
            f"{transform}(func, chunk_size={chunk_size!r}): expected None or a positive int, "
            f"got {chunk_size!r}."
        )


def _fname(func):
    return getattr(func, "__name__", type(func).__name__)


def _call_repr(func, in_dims, out_dims=0):
    s = f"vmap({_fname(func)}, in_dims={in_dims!r}"
    if out_dims != 0:
        s += f", out_dims={out_dims!r}"
    return s + ")(<inputs>)"


def _shape_repr(x):
    if x.is_nested:
        return "nested " + str([tuple(c.shape) for c in x.unbind()])
    return tuple(x.shape)


def _not_a_tensor(call, i, d, x):
    return ValueError(
        f"{call}: input {i} (flattened) has in_dim={d}, but it is {describe(x)}; expected a "
        "tensor (vmap maps over tensors only). Do: use None as its in_dim."
    )


def _dim_out_of_range(call, i, d, x):
    n = x.dim()
    want = f"in_dim in [{-n}, {n - 1}]" if n else "in_dim=None (a 0-d tensor has no dim)"
    return ValueError(
        f"{call}: input {i} (flattened) has in_dim={d}, but it has {n} dims (shape "
        f"{tuple(x.shape)}); expected {want}."
    )


def _check_mappable(x, d, i, call):
    """Raise _vmap_call's error for input ``i`` if in_dim ``d`` cannot map it at all."""
    if d is None:
        return
    if not isinstance(x, torch.Tensor):
        raise _not_a_tensor(call, i, d, x)
    if x.is_nested:
        _check_nested_input(x, d, i, call)
    elif not -x.dim() <= d < x.dim():
        raise _dim_out_of_range(call, i, d, x)


def _check_nested_input(x, d, i, call):
    """Note [Nested tensors under vmap] (batching/_nested.py): a nested tensor maps over its
    components (dim 0), and needs at least one."""
    if d not in (0, -x.dim()):
        raise ValueError(
            f"{call}: input {i} (flattened) is a nested tensor with in_dim={d}; vmap maps a "
            "nested tensor over its components only. Expected in_dim=0 (as PyTorch). Do: "
            "pad it (`torch.nested.to_padded_tensor(x, 0.0)`) to map over another dim."
        )
    if x.size(0) == 0:
        raise ValueError(
            f"{call}: input {i} (flattened) is a nested tensor with no components; expected "
            "at least one (an empty batch has no example to run)."
        )


def broadcast_prefix(prefix, tree, what, call):
    """Flatten ``prefix`` against ``tree``: one entry per leaf of ``tree``."""
    leaves, _ = pt.tree_flatten(tree)
    if prefix is None or isinstance(prefix, int):
        return [prefix] * len(leaves)
    out = []
    _broadcast(prefix, tree, what, call, out, path=what)
    return out


def _broadcast(prefix, tree, what, call, out, path):
    if prefix is None or isinstance(prefix, int):
        if isinstance(prefix, bool):  # functorch's class (its size(dim) refuses a bool)
            raise TypeError(
                f"{call}: {path} is {prefix!r}; expected an int or None (a bool is not a dim)."
            )
        if tree is None and prefix is not None and what == "in_dims":
            _raise_mapped_none(call, path, prefix)
        out.extend([prefix] * len(pt.tree_leaves(tree)))
        return
    if isinstance(prefix, (tuple, list)):
        if not isinstance(tree, (tuple, list)) or len(tree) != len(prefix):
            raise ValueError(
                f"{call}: {path} is a {type(prefix).__name__} of length {len(prefix)}, so the "
                f"matching value must be a tuple/list of that length; got {describe(tree)}. "
                "Expected "
                f"{what} to be a tree prefix of the values (an int or None applies to a whole "
                "subtree)."
            )
        for i, (p, t) in enumerate(zip(prefix, tree)):
            _broadcast(p, t, what, call, out, f"{path}[{i}]")
        return
    if isinstance(prefix, dict):
        if not isinstance(tree, dict) or set(tree) != set(prefix):
            raise ValueError(
                f"{call}: {path} is a dict with keys {sorted(map(str, prefix))}, which must match "
                f"the keys of the value; got {describe(tree)}."
            )
        # in the order the leaves are flattened: optree sorts a dict's keys, so iterating in
        # insertion order paired {"x": 0, "w": None} with the wrong leaves (silently)
        for k in pt.keys_in_flatten_order(tree):
            _broadcast(prefix[k], tree[k], what, call, out, f"{path}[{k!r}]")
        return
    node = pt.one_level(prefix)
    if node is not None:  # any other registered node: dataclass, LinearOperator, ...
        children, spec = node
        value = pt.one_level(tree)
        if value is None or value[1] != spec:
            raise ValueError(
                f"{call}: {path} is a {type(prefix).__name__} node, so the matching value must "
                f"be a {type(prefix).__name__} with the same structure; got "
                f"{describe(tree)}. Expected {what} to be a tree prefix of the values."
            )
        for i, (p, t) in enumerate(zip(children, value[0])):
            _broadcast(p, t, what, call, out, f"{path}.<child {i}>")
        return
    raise ValueError(  # functorch's class for a malformed in_dims/out_dims
        f"{call}: {path} is {describe(prefix)}; expected an int, None, or a tree (tuple/list/"
        "dict or registered pytree node) of those."
    )


def _raise_mapped_none(call, path, in_dim):
    """An int in_dim for an input that is None: torch's vmap raises; JAX maps over nothing. We
    raise, as torch does (docs/torch_func_differences.md, section 6): a None where a mapped
    tensor was declared is a mistake more often than an optional argument."""
    raise ValueError(
        f"{call}: {path} is {in_dim!r}, but the matching input is None; expected a tensor to "
        "map over. Do: use None as its in_dim (`in_dims=(0, None)`), or pass a tensor."
    )


_BATCHING: tuple = ()


@collector_paused  # Note [Long-lived setup without young collections]
def _import_batching():
    """The batching machinery vmap calls, imported at the first call (functransforms.batching
    imports this package) and kept: an import statement per call cost 0.7 us."""
    global _BATCHING
    global ensure_table
    from functransforms.batching._fastpath import ensure_table
    from functransforms.batching._nested import wrap_nested
    from functransforms.batching._tensor import BatchedTensor, VmapInterpreter, wrap_batched
    from functransforms.batching.random import (
        different_randomness,
        error_guard_key,
        no_random_ops,
    )

    # one store: another thread reads it without the lock (a 5-tuple seen between two stores
    # failed its unpacking: Note [One-time setup under one lock], _core/gcpause.py)
    batching = (wrap_nested, BatchedTensor, VmapInterpreter, wrap_batched, different_randomness)
    _BATCHING = batching + (no_random_ops, error_guard_key)
    return _BATCHING


_GENERAL = object()  # _lean_call's answer for a call it leaves to _vmap_call
_modules = sys.modules
_Tensor = torch.Tensor
_new = object.__new__


def _lean_facts(func, in_dims, out_dims, randomness):
    """What every lean call of ``vmap(func, in_dims, out_dims, randomness)`` shares: the call's
    name (for errors, as ``_vmap_call`` builds it), in_dims, randomness and the thread-local
    dispatch key of the randomness guard (None for randomness='same')."""
    error_guard_key = (_BATCHING or _import_batching())[6]
    ensure_table()  # what VmapInterpreter() does, done once: _lean_call builds it inline
    # the name _vmap_call gives the interpreter (out_dims omitted when in_dims is a tuple)
    if type(in_dims) is tuple:
        call = _call_repr(func, in_dims)
    else:
        call = _call_repr(func, in_dims, out_dims)
    return call, in_dims, randomness, error_guard_key() if randomness == "error" else None


def _lean_call(func, facts, out_dims, axis_name, args, kwargs):
    """``_vmap_call`` for positional tensors whose in_dims are ints (or None) that fit them, and
    an int out_dims (Note [vmap's lean path]); anything else returns ``_GENERAL`` before any
    side effect, and ``_vmap_call`` handles it (and raises its errors)."""
    call, in_dims, randomness, key = facts
    if len(args) == 1 and type(in_dims) is int:  # the commonest call: one tensor, mapped
        x = args[0]
        if not isinstance(x, _Tensor) or x.is_nested:
            return _GENERAL
        shape = x.shape
        n = len(shape)
        d = in_dims
        if not -n <= d < n:
            return _GENERAL
        if d < 0:
            d += n
        batch_size = shape[d]
        mapped = None
    else:
        if type(in_dims) is int:
            dims = (in_dims,) * len(args)
        elif len(in_dims) == len(args):
            dims = in_dims
        else:
            return _GENERAL
        batch_size = None
        mapped = []
        for x, d in zip(args, dims):
            if not isinstance(x, _Tensor):
                return _GENERAL
            if d is None:
                mapped.append(None)
                continue
            if x.is_nested:
                return _GENERAL
            shape = x.shape
            n = len(shape)
            if not -n <= d < n:
                return _GENERAL
            if d < 0:
                d += n
            if batch_size is None:
                batch_size = shape[d]
            elif shape[d] != batch_size:
                return _GENERAL
            mapped.append(d)
        if batch_size is None:
            return _GENERAL

    _, BatchedTensor, VmapInterpreter, wrap_batched = _BATCHING[:4]
    # VmapInterpreter(batch_size, randomness, call), its __enter__ and __exit__, inline: five
    # Python frames fewer (the table ensure_table builds was built by _lean_facts; the test
    # test_lean_interpreter_matches_the_class keeps the attributes those methods set in step),
    # its attributes in one store
    interp = _new(VmapInterpreter)
    interp.__dict__ = {
        "level": next(_core._level_counter),
        "alive": True,
        "batch_size": batch_size,
        "randomness": randomness,
        "call": call,
        "axis_name": axis_name,
        "chunked": False,
    }
    if _core._entry_pending:
        _core._install_entry()
    stack = _core._state.stack
    stack.append(interp)
    try:
        if mapped is None:
            wrapped = (wrap_batched(x, d, interp),)
        else:
            wrapped = []
            for x, m in zip(args, mapped):
                wrapped.append(x if m is None else wrap_batched(x, m, interp))
        if key is None:
            out = func(*wrapped, **kwargs)
        else:  # Note [Random ops by their tags]: no_random_ops, inline
            prev = _is_included(key)
            _set_included(key, True)
            try:
                out = func(*wrapped, **kwargs)
            finally:
                _set_included(key, prev)
    finally:
        popped = stack.pop()
        if popped is not interp:  # Note [Entering is all or nothing] (_core/levels.py)
            _core.unwind_to(interp, popped)
        interp.alive = False
        if interp._on_exit:
            for fn in reversed(interp._on_exit):
                fn()
    if type(out) is BatchedTensor and out._interp is interp and out._bdim == out_dims == 0:
        v = out._value
        if type(v) is _Tensor and not v.is_nested:
            # _shares_an_input, inline: a fresh result (no input's storage) is returned as is
            p = 0 if v.is_meta else v.untyped_storage().data_ptr()
            for x in args if p else ():
                if (
                    type(x) is _Tensor
                    and not x.is_nested
                    and not x.is_meta
                    and x.untyped_storage().data_ptr() == p
                ):
                    break
            else:
                return v
    out = _unwrap_outputs(out, out_dims, interp, batch_size, func, in_dims, BatchedTensor)
    return _as_views_of_inputs(out, args)


@eager_under_compile
def _vmap_call(
    func,
    in_dims,
    out_dims,
    randomness,
    chunk_size,
    args,
    kwargs,
    axis=(None, None),
    chunked=False,
    pmap=None,
    views=True,
):
    (
        wrap_nested,
        BatchedTensor,
        VmapInterpreter,
        wrap_batched,
        different_randomness,
        no_random_ops,
        _,
    ) = _BATCHING or _import_batching()

    if not isinstance(in_dims, (int, tuple, type(None))) or isinstance(in_dims, bool):
        # ValueError as functorch (its TypeError for a bool comes from x.size(True))
        raise (TypeError if isinstance(in_dims, bool) else ValueError)(
            f"{_call_repr(func, in_dims)}: expected in_dims to be an int, None or a tuple with one "
            f"entry per positional input; got {describe(in_dims)}."
        )
    if isinstance(in_dims, tuple) and len(in_dims) != len(args):
        raise ValueError(
            f"{_call_repr(func, in_dims)}: in_dims has {len(in_dims)} entries but {len(args)} "
            "positional inputs were given. Expected one in_dim per positional input."
        )
    # tensors are leaves: positional tensors need no pytree round trip (spec None)
    if all(isinstance(a, torch.Tensor) for a in args):
        flat_args, spec = list(args), None
    else:
        flat_args, spec = pt.tree_flatten(args)
    call = None
    if isinstance(in_dims, int) or in_dims is None:
        if spec is not None and in_dims is not None:  # not all tensors: a None among them?
            for i, a in enumerate(args):
                if a is None:
                    _raise_mapped_none(
                        _call_repr(func, in_dims), f"in_dims (for input {i})", in_dims
                    )
        flat_dims = [in_dims] * len(flat_args)
    else:
        call = _call_repr(func, in_dims)
        flat_dims = broadcast_prefix(in_dims, args, "in_dims", call)

    batch_size = None
    nested = False
    norm_dims = []
    for i, (x, d) in enumerate(zip(flat_args, flat_dims)):
        if d is None:
            norm_dims.append(None)
            continue
        if not isinstance(x, torch.Tensor):
            raise _not_a_tensor(call or _call_repr(func, in_dims), i, d, x)
        if x.is_nested:  # Note [Nested tensors under vmap] (batching/_nested.py)
            _check_nested_input(x, d, i, call or _call_repr(func, in_dims))
            d, nested = 0, True
        n = x.dim()
        if not -n <= d < n:
            raise _dim_out_of_range(call or _call_repr(func, in_dims), i, d, x)
        d %= n
        norm_dims.append(d)
        if batch_size is None:
            batch_size = x.size(d)
        elif x.size(d) != batch_size:
            # a later input that cannot be mapped at all is the first mistake to report (as
            # torch.func, which checks every input before the sizes)
            for j in range(i + 1, len(flat_args)):
                _check_mappable(flat_args[j], flat_dims[j], j, call or _call_repr(func, in_dims))
            sizes = [
                (j, _shape_repr(a), e)
                for j, (a, e) in enumerate(zip(flat_args, flat_dims))
                if e is not None
            ]
            raise ValueError(
                f"{call or _call_repr(func, in_dims)}: expected all mapped inputs to have the same "
                f"size along their in_dim, got: "
                + ", ".join(f"input {j} of shape {s} mapped over dim {e}" for j, s, e in sizes)
                + "."
            )
    axis_name, axis_size = axis
    if axis_size is not None:
        if batch_size is not None and batch_size != axis_size:
            raise ValueError(
                f"{call or _call_repr(func, in_dims)}: axis_size={axis_size}, but the mapped "
                f"inputs have size {batch_size} along their in_dim. Expected them to agree."
            )
        batch_size = axis_size
    if batch_size is None:
        raise ValueError(
            f"{call or _call_repr(func, in_dims)}: no input is mapped: every in_dim is None or no "
            "tensor was given. Expected at least one tensor input with a non-None in_dim, or "
            "vmap(..., axis_size=n)."
        )

    # nested inputs already run one component at a time: chunking changes nothing
    if chunk_size is not None and chunk_size < batch_size and not nested:
        if spec is None:
            spec = pt.tree_flatten(args)[1]
        return _chunked(
            func,
            in_dims,
            out_dims,
            randomness,
            chunk_size,
            flat_args,
            norm_dims,
            spec,
            kwargs,
            batch_size,
            axis,
            views,
        )

    interp = VmapInterpreter(batch_size, randomness)
    interp.call = call or _call_repr(func, in_dims, out_dims)
    # Note [Collectives are ops] (functransforms/distributed/_collective_ops.py)
    interp.axis_name = axis_name
    interp.chunked = chunked  # a chunk does not see the whole axis: collectives must raise
    if pmap is not None:  # Note [pmap's collectives] (distributed/_collective_ops.py)
        interp.group, interp.world, interp.rank = pmap
    if randomness == "error":  # Note [Random ops by their tags]
        mode = no_random_ops()
    elif randomness == "different":
        mode = different_randomness()
    else:
        mode = None
    with interp:
        wrapped = [
            x
            if d is None
            else (wrap_nested if nested and x.is_nested else wrap_batched)(x, d, interp)
            for x, d in zip(flat_args, norm_dims)
        ]
        if mode is None:
            out = func(*(wrapped if spec is None else pt.tree_unflatten(spec, wrapped)), **kwargs)
        else:
            with mode:
                out = func(
                    *(wrapped if spec is None else pt.tree_unflatten(spec, wrapped)), **kwargs
                )
    # the commonest result, one plain value of this level with its batch dim already where
    # out_dims puts it: what _unwrap_outputs returns for it, and _as_views_of_inputs too when
    # it shares no storage with an input (a fresh result), without their loops and pytrees
    # (with them, 6 us of the ~60 us overhead of bench_distributed.py's (a) on a cold cache)
    if (
        type(out) is BatchedTensor
        and out._interp is interp
        and type(out_dims) is int
        and out._bdim == out_dims == 0
    ):
        v = out._value
        if type(v) is torch.Tensor and not v.is_nested and not _shares_an_input(v, flat_args):
            return v
    out = _unwrap_outputs(out, out_dims, interp, batch_size, func, in_dims, BatchedTensor)
    # views=False: the caller's own inputs, never seen by the user (jacrev's basis)
    return _as_views_of_inputs(out, flat_args) if views else out


def _shares_an_input(v, flat_args):
    """Whether ``v`` shares storage with an input that ``_as_views_of_inputs`` considers."""
    p = 0 if v.is_meta else v.untyped_storage().data_ptr()
    if not p:
        return False
    for x in flat_args:
        if (
            type(x) is torch.Tensor
            and not x.is_nested
            and not x.is_meta
            and x.untyped_storage().data_ptr() == p
        ):
            return True
    return False


def _as_views_of_inputs(out, flat_args):
    """Outputs that alias a plain input become views of it, as PyTorch returns them.

    Note [Views of vmap's inputs]
        Rules run inside ``__torch_dispatch__``, below the ADInplaceOrView key, so a view op on
        the physical value shares memory with the input but is not *registered* as a view
        (``out._base`` is None). Writes through it already reach the input (same memory); to
        give the view relation back (``out._base is x``, torch's version counter and
        view+inplace checks) each output that shares storage with a plain input is rebuilt, at
        the end of the outermost vmap, as ``x.as_strided(...)`` with the same geometry: a real
        view of ``x``, no copy. Outputs that carry an autograd graph keep it instead (their
        graph is the one ordinary autograd must see).
    """
    # (this runs on every vmap call: is_meta, not device.type, which costs ten times more;
    # the storage lookup first, which rejects every fresh result; no pytree for one tensor)
    inputs = [
        x
        for x in flat_args
        if type(x) is torch.Tensor
        and not x.is_nested
        and not x.is_meta
        and x.untyped_storage().data_ptr()
    ]
    if not inputs:
        return out
    storages = {x.untyped_storage().data_ptr(): x for x in inputs}

    def view_of_input(o):
        if type(o) is not torch.Tensor or o.is_nested or o.is_meta:
            return o
        x = storages.get(o.untyped_storage().data_ptr())
        if x is None or o.requires_grad:
            return o
        base = o._base  # a view registered on an intermediate (a fast path's) is rebuilt too
        if base is not None and any(base is i for i in inputs):
            return o
        if getattr(o, "_ft_detached", False) or getattr(base, "_ft_detached", False):
            return o  # an alias, not a view, as torch's detach (or a view of that alias)
        if x is o or x.dtype != o.dtype or x.is_conj() or x.is_neg() or o.is_neg():
            return o
        view = x.as_strided(o.shape, o.stride(), o.storage_offset())
        return view.conj() if o.is_conj() else view  # Note [Lazy conj outputs]

    if isinstance(out, torch.Tensor):
        return view_of_input(out)
    flat, spec = pt.tree_flatten(out)
    return pt.tree_unflatten(spec, [view_of_input(o) for o in flat])


def _unwrap_outputs(out, out_dims, interp, batch_size, func, in_dims, BatchedTensor):
    one = isinstance(out, torch.Tensor)  # a tensor is a leaf: no pytree round trip for it
    flat_out, out_spec = ([out], None) if one else pt.tree_flatten(out)
    if isinstance(out_dims, int) or out_dims is None:
        flat_od = [out_dims] * len(flat_out)
    else:
        if isinstance(out_dims, tuple) and not isinstance(out, tuple) and len(out_dims) == 1:
            out_dims = out_dims[0]
        flat_od = broadcast_prefix(out_dims, out, "out_dims", _call_repr(func, in_dims, out_dims))
    results = []
    for i, (o, od) in enumerate(zip(flat_out, flat_od)):
        if not isinstance(o, torch.Tensor):
            if od is None:  # returned as it is, as PyTorch does
                results.append(o)
                continue
            raise ValueError(
                f"{_call_repr(func, in_dims, out_dims)}: output {i} (flattened) is "
                f"{describe(o)}; vmap's function must return tensors (or pytrees of "
                "tensors). Expected: a tensor, or out_dims=None for this output to return it "
                "as it is."
            )
        if isinstance(o, BatchedTensor) and o._interp is interp:
            v, b = o._value, o._bdim
            if v.is_nested and type(od) is int and od not in (0, -v.dim()):
                raise ValueError(
                    f"{_call_repr(func, in_dims, out_dims)}: output {i} is a nested tensor (one "
                    f"component per example), and out_dims for it is {od!r}; a nested tensor "
                    "stacks its examples along dim 0 only. Expected out_dims=0 for it (as "
                    "PyTorch)."
                )
            # Note [Lazy conj outputs]: a lazily conjugated wrapper (``t.conj()``, views of it:
            # Note [Conjugate views under vmap], batching/views.py) holds only the lazy view,
            # which vmap returns (is_conj(), a view of the input), as PyTorch returns it.
            lazy = getattr(o, "_lazy_conj", None)
            v, b = (o._value if lazy is None else lazy[0]), o._bdim
            if od is None:
                raise ValueError(
                    f"{_call_repr(func, in_dims, out_dims)}: output {i} has out_dim=None but it "
                    "depends on the mapped inputs (it differs per example). Expected out_dim=None "
                    "only for outputs that are the same for every example."
                )
        else:
            if od is None:
                results.append(o)
                continue
            v = o.unsqueeze(0).expand((batch_size,) + tuple(o.shape))
            b = 0
        n = v.dim()
        if isinstance(od, bool) or not isinstance(od, int):
            raise TypeError(
                f"{_call_repr(func, in_dims, out_dims)}: out_dims for output {i} is "
                f"{od!r}; expected an int or None."
            )
        if not -n <= od < n:
            raise IndexError(  # PyTorch raises IndexError here
                f"{_call_repr(func, in_dims, out_dims)}: out_dim={od} is out of range for output "
                f"{i}, which has {n} dims with the mapped dim (shape {tuple(v.shape)}): expected "
                f"out_dim in [{-n}, {n - 1}]."
            )
        results.append(v.movedim(b, od) if b != od % n else v)
    return results[0] if one else pt.tree_unflatten(out_spec, results)


class _RngSnapshot:
    """The state of the CPU generator and of every initialised CUDA generator."""

    def __init__(self):
        self.cpu = torch.random.get_rng_state()
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        self.cuda = torch.cuda.get_rng_state_all() if cuda else None

    def restore(self):
        torch.random.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)


def _chunked(
    func,
    in_dims,
    out_dims,
    randomness,
    chunk_size,
    flat_args,
    norm_dims,
    spec,
    kwargs,
    batch_size,
    axis,
    views=True,
):
    # randomness='same' means one draw for the whole batch, so every chunk draws from the same
    # generator state (PyTorch's chunks do too); 'different' chunks draw in sequence
    rng = _RngSnapshot() if randomness == "same" else None
    pieces = []
    for start in range(0, batch_size, chunk_size):
        if rng is not None:
            rng.restore()
        length = min(chunk_size, batch_size - start)
        chunk_args = [
            x if d is None else x.narrow(d, start, length) for x, d in zip(flat_args, norm_dims)
        ]
        chunk_dims = tuple(pt.tree_unflatten(spec, list(norm_dims)))
        pieces.append(
            _vmap_call(
                func,
                chunk_dims,
                out_dims,
                randomness,
                None,
                pt.tree_unflatten(spec, chunk_args),
                kwargs,
                (axis[0], None if axis[1] is None else length),
                chunked=True,
                views=views,
            )
        )
    first_flat, out_spec = pt.tree_flatten(pieces[0])
    flat_od = (
        [out_dims] * len(first_flat)
        if isinstance(out_dims, int) or out_dims is None
        else broadcast_prefix(out_dims, pieces[0], "out_dims", _call_repr(func, in_dims, out_dims))
    )
    flats = [pt.tree_leaves(p) for p in pieces]
    merged = [
        flats[0][j] if od is None else torch.cat([f[j] for f in flats], od)
        for j, od in enumerate(flat_od)
    ]
    return pt.tree_unflatten(out_spec, merged)
