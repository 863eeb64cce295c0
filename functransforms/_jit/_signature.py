"""The signature of a ``jit`` call (Note [Trace and replay], functransforms/_jit/_trace.py): the
per-call key of the graph cache, read on every call, so every microsecond here is paid by
every replay."""

from __future__ import annotations

import torch

_Tensor = torch.Tensor
_TENSOR = object()  # marks a tensor leaf among the non-tensor leaves of a signature


def _tensor_key(t):
    # is_conj/is_neg only matter (and only can be set) for complex and negative views.
    return (t.shape, t.stride(), t.dtype, t.device, t.requires_grad, t.is_conj(), t.is_neg())


def _leaf_key(x):
    if isinstance(x, float):
        return (float, x.hex())  # -0.0 and nan are values of their own
    try:
        hash(x)
    except TypeError:
        return None
    return (type(x), x)


def _dict_orders(tree, out=None):
    """The key order of every dict in ``tree`` (through lists, tuples and dicts), in
    traversal order. optree's spec of ``{1: a, 2: b}`` equals that of ``{2: b, 1: a}`` (it
    sorts keys) though ``f`` may see the difference (``list(d.values())``, a returned dict's
    order), so the general path's key holds the orders too."""
    if out is None:
        out = []
    if isinstance(tree, dict):
        out.append(tuple(tree))
        for v in tree.values():
            if isinstance(v, (list, tuple, dict)):
                _dict_orders(v, out)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            if isinstance(v, (list, tuple, dict)):
                _dict_orders(v, out)
    return out


def _dyn_tensor_key(t):
    return (t.dim(), t.dtype, t.device, t.requires_grad, t.is_conj(), t.is_neg())


def _globals_key():
    return (
        torch.is_grad_enabled(),
        torch.get_default_dtype(),
        torch.are_deterministic_algorithms_enabled(),
    )


# Note [Signature walk]
# ~~~~~~~~~~~~~~~~~~~~~
# Most calls pass plain tensors and plain dicts of them (``functional_call``'s parameters and
# buffers). For those, a Python walk replaces the optree flatten (~3.5 us for a dict of 4
# parameters plus a tensor, a third of a hit's cost): one structure token per argument, None
# for a tensor, the tuple of its keys (insertion order) for a dict, and the tensors in optree's
# leaf order (sorted keys, kwargs sorted by name), so ``jitted.graph(...)`` takes its inputs in
# ``tree_leaves((args, kwargs))`` order whichever path keyed it. A token determines the
# structure exactly (only ``str`` keys, so ``{1: t}`` and ``{True: t}`` are never confused;
# only ``type(...) is dict`` / ``is Tensor``, so no subclass slips through), and
# ``_rebuild_walked`` rebuilds the same dicts in the caller's key order from it. Every
# per-tensor field is read anew on each call, so a dict mutated between calls (a key added, a
# value swapped or resized in place) is a new signature as before. Anything else (tuples,
# lists, None, numbers, nested dicts, kwargs of other kinds) takes the optree path.


def _walk_node(a, tensors):
    if type(a) is _Tensor:
        if a.is_nested:
            return _NOWALK
        tensors.append(a)
        return None
    if type(a) is dict:
        for k, v in a.items():
            if type(k) is not str or type(v) is not _Tensor or v.is_nested:
                return _NOWALK
        tensors.extend(map(a.__getitem__, sorted(a)))  # optree's leaf order: sorted keys
        return tuple(a)
    return _NOWALK


def _walk(args, kwargs):
    """``(arg tokens, kwarg tokens, tensors)`` for plain tensors and str-keyed dicts of plain
    tensors, else None (Note [Signature walk]). Flat tensors give ``(None, None, tensors)``,
    the key of the fast path in ``__call__``."""
    tensors = []
    tokens = tuple([_walk_node(a, tensors) for a in args])
    if _NOWALK in tokens:
        return None
    if not kwargs:
        if tokens.count(None) == len(tokens):
            return None, None, tensors
        return tokens, (), tensors
    kw = []
    for k in sorted(kwargs):
        tok = _walk_node(kwargs[k], tensors)
        if tok is _NOWALK:
            return None
        kw.append((k, tok))
    return tokens, (tuple(kwargs), tuple(kw)), tensors


def _rebuild_flat(ts):
    return tuple(ts), {}


def _rebuild_walked(tokens, kw_tokens, ts):
    it = iter(ts)

    def build(tok):
        if tok is None:
            return next(it)
        values = {k: next(it) for k in sorted(tok)}
        return {k: values[k] for k in tok}  # the caller's key order

    args = tuple([build(t) for t in tokens])
    if not kw_tokens:
        return args, {}
    order, kw = kw_tokens
    values = {k: build(t) for k, t in kw}
    return args, {k: values[k] for k in order}


_NOWALK = object()  # a walk token: this argument needs the optree path
