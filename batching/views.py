"""Batching rules for view and shape ops: the batch dim goes to the front, logical dims shift."""

from __future__ import annotations

import itertools

import torch

from functransforms import _compat
from functransforms._core.levels import (
    _AUTOGRAD_KEYS,
    TransformTensor,
    _ForceKeys,
    _tls_exclude,
    _tls_include,
    below_torch_autograd,
    copy_as_torch_records,
)
from functransforms._core.metadata import SLOW_METADATA, metadata
from functransforms.errors import InplaceError

from ._fastpath import SHAPED_FUNCS, _live_value, _phys
from ._registry import register_vmap_rule
from ._tensor import WRITES, BatchedTensor
from ._util import expand_front, flat_batch, in_format, pad_to, to_front, wrap_dim
from .elementwise import def_same_bdim

aten = torch.ops.aten


def _front(args, bdims):
    x = to_front(args[0], bdims[0])
    return x, x.dim() - 1


@register_vmap_rule(aten.resize_.default)
def resize_vmap_rule(interp, args, bdims, kwargs):
    """resize_ per example (it ran as a loop over example views, whose new shapes the batched
    tensor never took: its shape silently stayed). Each example's own shape is a no-op (out=
    kernels resize their output so); a shape of as many elements reinterprets each example's
    contiguous memory, as resize_ does. Any other resize would move the examples' memory."""
    x, _ = _front(args, bdims)
    size = tuple(args[1])
    fmt = kwargs.get("memory_format")
    if size == tuple(x.shape[1:]) and fmt is None:
        return x, 0
    n = 1
    for d in size:
        n *= d
    if x.is_contiguous() and n == x[0].numel() and fmt in (None, torch.contiguous_format):
        return x.view((x.shape[0], *size)), 0
    raise InplaceError(
        f"{interp.call}: aten.resize_ to {list(size)} of a batched tensor whose examples have "
        f"shape {list(x.shape[1:])}: only a resize to as many elements of contiguous examples "
        "is supported (each example would otherwise need memory of its own). Do: build a new "
        "tensor (`torch.empty(size)` / `x.new_zeros(size)`) instead of resizing in place."
    )


@register_vmap_rule(aten.view.default)
def view_vmap_rule(interp, args, bdims, kwargs):
    # The wrapper's strides are the logical ones, and the batch dim (moved to the front) is a
    # dim of its own in both shapes, so the physical view succeeds exactly when the logical one
    # does: errors are torch's own ("view size is not compatible ... use .reshape").
    x, _ = _front(args, bdims)
    return x.view(_batched_size(x, args[1])), 0


@register_vmap_rule(aten.view_copy.default)
def view_copy_vmap_rule(interp, args, bdims, kwargs):
    # Eager view_copy reshapes where a view would fail (an example that is not contiguous,
    # e.g. batched at in_dims=1); torch._decomp's `view(x).clone()` raised there instead
    x, _ = _front(args, bdims)
    return aten.view_copy.default(x, _batched_size(x, args[1])), 0


def def_copy_in_format(op):
    """A copy (``clone``, ``_to_copy``) that may take a ``memory_format``: Note [Memory formats
    per example] (batching/_util.py)."""

    def copy_in_format_vmap_rule(interp, args, bdims, kwargs):
        return in_format(op, args, bdims, kwargs)

    register_vmap_rule(op)(copy_in_format_vmap_rule)


def_copy_in_format(aten.clone.default)
def_copy_in_format(aten._to_copy.default)


@register_vmap_rule(aten._unsafe_view.default, aten.reshape.default)
def reshape_vmap_rule(interp, args, bdims, kwargs):
    x, _ = _front(args, bdims)
    return x.reshape(_batched_size(x, args[1])), 0


def _batched_size(x, size):
    """The physical size of a view/reshape of ``x`` (batch dim in front) to logical ``size``.
    Over an empty batch a -1 is ambiguous (0 elements), so it is resolved against one example,
    as torch would for that example (on meta: shapes only; the errors are torch's)."""
    if x.shape[0] == 0 and -1 in size:
        size = torch.empty(x.shape[1:], device="meta").reshape(size).shape
    return (x.shape[0], *size)


@register_vmap_rule(aten.expand.default)
def expand_vmap_rule(interp, args, bdims, kwargs):
    x, n = _front(args, bdims)
    size = list(args[1])
    if len(size) > n:
        x = x.reshape((x.shape[0],) + (1,) * (len(size) - n) + tuple(x.shape[1:]))
    return x.expand([x.shape[0], *size]), 0


@register_vmap_rule(aten.permute.default)
def permute_vmap_rule(interp, args, bdims, kwargs):
    x, n = _front(args, bdims)
    return x.permute([0] + [wrap_dim(d, n) + 1 for d in args[1]]), 0


@register_vmap_rule(aten.transpose.int, aten.transpose_.default)
def transpose_vmap_rule(interp, args, bdims, kwargs):
    x, n = _front(args, bdims)
    if n == 0:
        return x, 0
    return x.transpose(wrap_dim(args[1], n) + 1, wrap_dim(args[2], n) + 1), 0


@register_vmap_rule(aten.t.default, aten.t_.default)
def t_vmap_rule(interp, args, bdims, kwargs):
    x, n = _front(args, bdims)
    if n > 2:  # the check torch.t makes on one example
        raise RuntimeError(f"t() expects a tensor with <= 2 dimensions, but self is {n}D")
    return (x.transpose(1, 2) if n == 2 else x), 0


@register_vmap_rule(aten.unsqueeze.default, aten.unsqueeze_.default)
def unsqueeze_vmap_rule(interp, args, bdims, kwargs):
    x, n = _front(args, bdims)
    return x.unsqueeze(wrap_dim(args[1], n + 1) + 1), 0


@register_vmap_rule(aten.squeeze.dim, aten.squeeze_.dim, aten.squeeze.dims, aten.squeeze_.dims)
def squeeze_dim_vmap_rule(interp, args, bdims, kwargs):
    x, n = _front(args, bdims)
    if n == 0:
        return x, 0
    dims = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
    return x.squeeze(tuple(wrap_dim(d, n) + 1 for d in dims)), 0


@register_vmap_rule(aten.squeeze.default, aten.squeeze_.default)
def squeeze_vmap_rule(interp, args, bdims, kwargs):
    x, n = _front(args, bdims)
    dims = tuple(i for i in range(1, n + 1) if x.shape[i] == 1)  # never the batch dim
    return (x.squeeze(dims) if dims else x), 0


@register_vmap_rule(aten.select.int)
def select_vmap_rule(interp, args, bdims, kwargs):
    x, n = _front(args, bdims)
    return x.select(wrap_dim(args[1], n) + 1, args[2]), 0


@register_vmap_rule(aten.slice.Tensor)
def slice_vmap_rule(interp, args, bdims, kwargs):
    x, n = _front(args, bdims)
    a = list(args)
    a[0] = x
    kwargs = dict(kwargs)  # dim may come positionally, by keyword (torch.ops.aten.slice), or not
    dim = a[1] if len(a) > 1 else kwargs.pop("dim", 0)
    a[1:2] = [wrap_dim(dim, n) + 1]
    return aten.slice.Tensor(*a, **kwargs), 0


@register_vmap_rule(aten.diagonal.default)
def diagonal_vmap_rule(interp, args, bdims, kwargs):
    x, n = _front(args, bdims)
    offset = args[1] if len(args) > 1 else 0
    d1 = args[2] if len(args) > 2 else 0
    d2 = args[3] if len(args) > 3 else 1
    return x.diagonal(offset, wrap_dim(d1, n) + 1, wrap_dim(d2, n) + 1), 0


@register_vmap_rule(aten.split.Tensor, aten.split_with_sizes.default, aten.unsafe_split.Tensor)
def split_vmap_rule(interp, args, bdims, kwargs):
    x, n = _front(args, bdims)
    dim = args[2] if len(args) > 2 else 0
    outs = torch.split(x, args[1], wrap_dim(dim, n) + 1)
    return tuple(outs), (0,) * len(outs)


@register_vmap_rule(aten.unbind.int)
def unbind_vmap_rule(interp, args, bdims, kwargs):
    x, n = _front(args, bdims)
    outs = x.unbind(wrap_dim(args[1] if len(args) > 1 else 0, n) + 1)
    return outs, (0,) * len(outs)


def _list_front(interp, tensors, bds):
    return [expand_front(t, b, interp.batch_size) for t, b in zip(tensors, bds)]


@register_vmap_rule(aten.cat.default)
def cat_vmap_rule(interp, args, bdims, kwargs):
    tensors = args[0]
    bds = bdims[0] if bdims[0] is not None else [None] * len(tensors)
    n = max(t.dim() - (b is not None) for t, b in zip(tensors, bds))
    dim = args[1] if len(args) > 1 else 0
    # legacy: cat skips 1-d empty tensors of any other rank
    keep = [
        (t, b)
        for t, b in zip(tensors, bds)
        if not (t.dim() - (b is not None) == 1 and t.shape[-1] == 0 and n > 1)
    ]
    return torch.cat(_list_front(interp, *zip(*keep)), wrap_dim(dim, n) + 1), 0


@register_vmap_rule(aten.stack.default)
def stack_vmap_rule(interp, args, bdims, kwargs):
    tensors = args[0]
    bds = bdims[0] if bdims[0] is not None else [None] * len(tensors)
    n = tensors[0].dim() - (bds[0] is not None)
    dim = args[1] if len(args) > 1 else 0
    return torch.stack(_list_front(interp, tensors, bds), wrap_dim(dim, n + 1) + 1), 0


@register_vmap_rule(aten.unfold.default)
def unfold_vmap_rule(interp, args, bdims, kwargs):
    x, n = _front(args, bdims)
    if n == 0:  # a 0-d example unfolds like a 1-element vector, into shape (1,)
        return x.unsqueeze(1).unfold(1, args[2], args[3]).squeeze(1), 0
    return x.unfold(wrap_dim(args[1], n) + 1, args[2], args[3]), 0


@register_vmap_rule(aten.roll.default)
def roll_vmap_rule(interp, args, bdims, kwargs):
    x, n = _front(args, bdims)
    dims = args[2] if len(args) > 2 else []
    if not dims:
        flat = flat_batch(x)
        return flat.roll(args[1], 1).reshape(x.shape), 0
    return x.roll(args[1], [wrap_dim(d, n) + 1 for d in dims]), 0


@register_vmap_rule(aten.repeat.default)
def repeat_vmap_rule(interp, args, bdims, kwargs):
    x, n = _front(args, bdims)
    reps = list(args[1])
    if len(reps) > n:
        x = x.reshape((x.shape[0],) + (1,) * (len(reps) - n) + tuple(x.shape[1:]))
    return x.repeat([1, *reps]), 0


@register_vmap_rule(aten.movedim.int, aten.movedim.intlist)
def movedim_vmap_rule(interp, args, bdims, kwargs):
    x, n = _front(args, bdims)
    src, dst = args[1], args[2]
    if isinstance(src, int):
        return x.movedim(wrap_dim(src, n) + 1, wrap_dim(dst, n) + 1), 0
    return x.movedim([wrap_dim(d, n) + 1 for d in src], [wrap_dim(d, n) + 1 for d in dst]), 0


def def_last_two(func):
    """tril/triu act on the last two dims: the batch dim in front is one more leading dim."""

    def last_two_vmap_rule(interp, args, bdims, kwargs):
        x, _ = _front(args, bdims)
        out = func(x, *args[1:], **kwargs)
        return (args[0], bdims[0]) if func._schema.name.endswith("_") else (out, 0)

    register_vmap_rule(func)(last_two_vmap_rule)


for _op in (aten.tril.default, aten.triu.default, aten.tril_.default, aten.triu_.default):
    def_last_two(_op)


@register_vmap_rule(aten.diag_embed.default)
def diag_embed_vmap_rule(interp, args, bdims, kwargs):
    x, n = _front(args, bdims)
    offset = args[1] if len(args) > 1 else 0
    d1 = args[2] if len(args) > 2 else -2
    d2 = args[3] if len(args) > 3 else -1
    return torch.diag_embed(x, offset, wrap_dim(d1, n + 1) + 1, wrap_dim(d2, n + 1) + 1), 0


@register_vmap_rule(aten.diag.default)
def diag_vmap_rule(interp, args, bdims, kwargs):
    x, n = _front(args, bdims)
    offset = args[1] if len(args) > 1 else 0
    if n == 1:
        return torch.diag_embed(x, offset), 0
    return x.diagonal(offset, 1, 2), 0


# mT / mH / adjoint are composite, but arrive whole when a rule of an outer level calls them
def def_matrix_transpose(op, conj):
    def matrix_transpose_vmap_rule(interp, args, bdims, kwargs):
        x, n = _front(args, bdims)
        if n < 2:
            raise RuntimeError(
                "tensor.mT/mH is only supported on matrices or batches of matrices. "
                f"Got {n}-D tensor."
            )
        t = x.transpose(-2, -1)
        return (t.conj() if conj and t.is_complex() else t), 0

    register_vmap_rule(op)(matrix_transpose_vmap_rule)


def_matrix_transpose(aten.mT.default, conj=False)
def_matrix_transpose(aten.mH.default, conj=True)
def_matrix_transpose(aten.adjoint.default, conj=True)


# ops whose output keeps the input's layout (metadata, conj/neg bits, complex views)
for _op in (
    aten.alias.default,
    aten.lift_fresh.default,
    aten.resolve_conj.default,
    aten.resolve_neg.default,
    aten._neg_view.default,  # conj().imag: a negative view (materialized when wrapped)
    aten._conj.default,
    aten.view_as_real.default,
    aten.view_as_complex.default,
):
    def_same_bdim(_op)


@register_vmap_rule(aten.copy.default)
def copy_vmap_rule(interp, args, bdims, kwargs):
    """copy(self, src): src broadcast to self's shape, in self's dtype (functional copy_)."""
    self_, src = args[0], args[1]
    n = max(self_.dim() - (bdims[0] is not None), src.dim() - (bdims[1] is not None))
    dst = pad_to(expand_front(self_, bdims[0], interp.batch_size), n)
    s = src if bdims[1] is None else pad_to(to_front(src, bdims[1]), n)
    return copy_as_torch_records(dst, s, *args[2:], **kwargs), 0


@register_vmap_rule(aten.copy_.default)
def copy__vmap_rule(interp, args, bdims, kwargs):
    """copy_(self, src): broadcast src into the (batched) self."""
    self_, src = args[0], args[1]
    sb = bdims[1]
    dst = to_front(self_, bdims[0])
    dst.copy_(src if sb is None else pad_to(to_front(src, sb), dst.dim() - 1), *args[2:])
    return self_, bdims[0]


@register_vmap_rule(aten.flip.default)
def flip_vmap_rule(interp, args, bdims, kwargs):
    x = to_front(args[0], bdims[0])
    n = x.dim() - 1
    dims = [wrap_dim(d, n) + 1 for d in args[1]]  # checked as eager checks them
    # a 0-d example: eager's flip over dim 0 or -1 is a copy; the batch dim is not flipped
    return aten.flip.default(x, dims if n else []), 0


# Note [Many views at once]
#     ``unbind``/``split``/``chunk``/``tensor_split`` return one view per piece, often hundreds
#     (``x.unbind(0)`` of 512 rows). Through ``__torch_dispatch__`` each piece cost ~4 us:
#     ``wrap_batched`` (metadata reads, conj checks, ``_make_wrapper_subclass`` with keyword
#     arguments), three attribute stores, then the dispatcher registered each as an autograd
#     view of the input wrapper (and freed that bookkeeping again): 7-17x PyTorch, which
#     builds its BatchedTensors in C++. These functions take a shortcut in
#     ``__torch_function__`` (Note [Shaped fast path]): one call of the function on the
#     physical value (the logical dim mapped past the batch dim) gives every piece's value,
#     and a lean loop wraps them: the logical strides, dtype and device are the same for every
#     piece and the shape for every piece of a run (all pieces for unbind, all but the last for
#     split/chunk by a size), so each wrapper costs one ``_make_wrapper_subclass`` with
#     positional arguments (keyword parsing costs ~0.2 us per call) and one ``__dict__``
#     store. Measured alternatives: wrappers as C++ views of the input wrapper (one ``unbind``
#     for all) are cheaper, but a C++-made TensorImpl never carries the Python dispatch key
#     (only a subclass's constructor sets it), and ``as_subclass`` to add it costs more than
#     building each wrapper.
#
#     What the pieces are: the physical values are views of the input's value, so writes
#     through a piece reach the input and vmap returns views of its input (Note [Views of
#     vmap's inputs], functransforms/_vmap.py). The wrappers are not registered autograd views
#     of the input wrapper: ``piece._base`` is None inside the function, as for PyTorch's
#     BatchedTensors (the ordinary path's views report the input wrapper, as before). Pieces
#     of a lazy conjugate are lazy conjugates (Note [Conjugate views under vmap]); pieces of
#     ``unbind`` and of ``split``/``chunk`` by a size make their physical view only when read
#     (Note [Pieces made when first read]). Anything else (other keyword arguments, tensor
#     indices, a value that requires grad below torch's autograd, an error) takes the ordinary
#     path, which stays the single source of semantics.
_NoDispatch = _compat.DisableTorchDispatch
_NoTF = _compat.DisableTorchFunctionSubclass
_BelowAD = _compat.AutoDispatchBelowADInplaceOrView
_ERRORS = (RuntimeError, IndexError, ValueError, TypeError)
_UNBIND = frozenset((torch.unbind, torch.Tensor.unbind))


def _many_views(func, args, kwargs, cls, wrap):
    at = 1 if func in _UNBIND else 2  # position of ``dim``
    if kwargs:
        if len(kwargs) != 1 or "dim" not in kwargs or len(args) != at:
            return None
        dim = kwargs["dim"]
    elif len(args) == at + 1:
        dim = args[at]
    elif len(args) == at:
        dim = 0
    else:
        return None
    a = args[0]
    conj = type(a) is ConjBatchedTensor  # Note [Conjugate views under vmap]: pieces stay lazy
    if conj:
        v = a._lazy_conj[0]
        if not a._interp.alive or type(v) is not torch.Tensor:
            return None
        if v.requires_grad and below_torch_autograd():  # Note [Fast path below torch's autograd]
            return None
    else:
        v = _live_value(a, cls)
        if v is None or v.is_conj() or v.is_neg():
            return None
    n, bdim = v.dim() - 1, a._bdim
    pd = _phys(dim, n, bdim) if n else None
    sections = args[1:at]
    if pd is None or (sections and isinstance(sections[0], torch.Tensor)):
        return None
    plain = type(v) is torch.Tensor and not v.requires_grad  # nothing for autograd to see
    if plain and not conj:
        pieces = _lazy_pieces(func, a, v, pd, bdim, sections)
        if pieces is not None:
            return pieces
    try:
        if plain:
            with _BelowAD():
                outs = func(v, *sections, pd)
        else:
            outs = func(v, *sections, pd)
    except _ERRORS:
        return None  # the ordinary path raises it, naming logical dims
    if at == 1:
        return wrap_many(a, outs, bdim - 1 if bdim > pd else bdim, _SAME, conj)
    # split and chunk by a size: every piece but the last has one shape
    uneven = func in _BY_SIZE and type(sections[0]) is int
    return wrap_many(a, outs, bdim, _ALL_BUT_LAST if uneven else None, conj)


_SAME, _ALL_BUT_LAST = "same", "all but last"


def _lazy_pieces(func, a, v, pd, bdim, sections):
    """Note [Pieces made when first read]: ``unbind`` and ``split``/``chunk`` by a positive
    size of a plain value that does not require grad, as LazyPieces; None for anything else."""
    L = v.shape[pd]
    shape, st = list(v.shape), v.stride()
    if func in _UNBIND:
        del shape[pd]
        out_bdim = bdim - 1 if bdim > pd else bdim
        st = st[:pd] + st[pd + 1 :]
        starts = range(L)
        size = shape[:out_bdim] + shape[out_bdim + 1 :]
        last = None
        length = None
    else:
        n = sections[0]
        if func not in _BY_SIZE or type(n) is not int or n <= 0 or L == 0:
            return None
        length = n if func in _SPLIT else -(-L // n)  # chunk: pieces of ceil(L / n)
        starts = range(0, L, length)
        out_bdim = bdim
        shape[pd] = length
        size = shape[:bdim] + shape[bdim + 1 :]
        last = L - starts[-1]
    logical_st = _or_none(size, st[:out_bdim] + st[out_bdim + 1 :])
    interp = a._interp
    tail = _mk_tail(a)
    ws = []
    append = ws.append
    for i in starts:
        w = _mk(LazyPiece, size, logical_st, *tail)
        w.__dict__ = {"_piece": (v, pd, i, length), "_bdim": out_bdim, "_interp": interp}
        append(w)
    if last is not None and last != length:  # the last piece of an uneven split
        shape[pd] = last
        w = _mk(
            LazyPiece, shape[:bdim] + shape[bdim + 1 :], st[:out_bdim] + st[out_bdim + 1 :], *tail
        )
        w.__dict__ = {"_piece": (v, pd, starts[-1], last), "_bdim": out_bdim, "_interp": interp}
        ws[-1] = w
    return tuple(ws)


def _mk_tail(a):
    """The arguments after ``(cls, size, strides)`` that give ``_make_wrapper_subclass`` the
    dtype and device of ``a``: none when its defaults already do (each positional argument
    costs parsing time: ~0.1 us per wrapper for dtype, layout and device), checked on a probe
    wrapper since the defaults can be changed (``torch.set_default_dtype``)."""
    dtype, device = a.dtype, a.device
    probe = _mk(BatchedTensor, ())
    with _NoTF():
        if probe.dtype == dtype and probe.device == device:
            return ()
    return (None, None, dtype, _STRIDED, device)


# Note [Pieces made when first read]
#     Most pieces of a big ``unbind``/``split`` are never used (``t.unbind(0)[0]``, a loop that
#     stops early), and each physical view costs about half as much as its wrapper (~0.35 us
#     with its deallocation). A LazyPiece holds ``(value, dim, start, length)`` and makes its
#     physical view (``select``/``narrow``, a view of the same memory, so it sees every write
#     made before) the first time anything reads ``_value``; it then becomes an ordinary
#     BatchedTensor (``__class__`` reassigned: the layouts are identical), so the fast paths
#     apply to it from then on. Its ``__torch_function__`` makes the pieces among the
#     arguments first, then runs BatchedTensor's. Only for values that are plain tensors not
#     requiring grad: a view made later, inside a rule (below torch's autograd), would be
#     missing from torch's graph otherwise (and if the value has been written since with one
#     that requires grad, the view is made with torch's autograd on, as ``process`` would).
class LazyPiece(BatchedTensor):
    """A piece of a many-views op whose physical view is made when first read (Note [Pieces
    made when first read])."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        for x in args:
            if type(x) is LazyPiece:
                x._materialize()
        if kwargs:
            for x in kwargs.values():
                if type(x) is LazyPiece:
                    x._materialize()
        return _batched_torch_function(BatchedTensor, func, types, args, kwargs or {})

    @property
    def _value(self):
        return self._materialize()

    def _materialize(self):
        d = self.__dict__
        v, pd, start, length = d.pop("_piece")
        if v.requires_grad and below_torch_autograd():  # written with a grad-requiring value
            with _ForceKeys(_tls_include(), _tls_exclude() - _AUTOGRAD_KEYS):  # since: record
                value = v.select(pd, start) if length is None else v.narrow(pd, start, length)
        else:
            value = v.select(pd, start) if length is None else v.narrow(pd, start, length)
        d["_value"] = value
        self.__class__ = BatchedTensor
        return value


def _runs(outs, kind):
    """``(count, first index)`` of each run of consecutive pieces of one shape."""
    m = len(outs)
    if kind is _SAME or m == 1:
        return ((m, 0),)
    if kind is _ALL_BUT_LAST:
        return ((m - 1, 0), (1, m - 1))
    runs, i = [], 0
    for _, group in itertools.groupby([o.shape for o in outs]):  # torch.Size: compared in C
        k = len(list(group))
        runs.append((k, i))
        i += k
    return runs


def _or_none(size, strides):
    """``strides``, or None when they are the contiguous ones of ``size`` (what
    ``_make_wrapper_subclass`` then computes itself, ~0.07 us faster per call)."""
    expected = 1
    for n, s in zip(reversed(size), reversed(strides)):
        if s != expected:  # exactly (torch reports the strides of size-1 dims too)
            return strides
        expected *= n
    return None


def wrap_many(a, outs, bdim, kind=None, conj=False):
    """Note [Many views at once]: wrappers of ``a``'s level around the physical views ``outs``
    (batch dim ``bdim``); ``kind`` says which pieces share a shape (all, all but the last, or
    unknown); ``conj``: the views are lazy conjugates (ConjBatchedTensors)."""
    if not outs:
        return ()
    st = outs[0].stride()
    logical_st = st[:bdim] + st[bdim + 1 :]
    interp = a._interp
    tail = _mk_tail(a)
    ws = []
    append = ws.append
    for k, i in _runs(outs, kind):
        shape = outs[i].shape
        size = shape[:bdim] + shape[bdim + 1 :]
        run_st = _or_none(size, logical_st)
        if conj:
            for p in outs[i : i + k]:
                w = _mk(ConjBatchedTensor, size, run_st, *tail)
                _compat.set_conj(w, True)
                w.__dict__ = {"_lazy_conj": (p,), "_bdim": bdim, "_interp": interp}
                append(w)
            continue
        for p in outs[i : i + k]:
            w = _mk(BatchedTensor, size, run_st, *tail)
            w.__dict__ = {"_value": p, "_bdim": bdim, "_interp": interp}  # one store, not three
            append(w)
    return tuple(ws)


_mk = _compat.make_wrapper_subclass
_STRIDED = torch.strided
_SPLIT = frozenset((torch.split, torch.Tensor.split))
_BY_SIZE = _SPLIT | {torch.chunk, torch.Tensor.chunk}
for _fn in (
    torch.unbind,
    torch.Tensor.unbind,
    torch.split,
    torch.Tensor.split,
    torch.chunk,
    torch.Tensor.chunk,
    torch.tensor_split,
    torch.Tensor.tensor_split,
    torch.split_with_sizes,
    torch.Tensor.split_with_sizes,
):
    SHAPED_FUNCS[_fn] = _many_views


# Note [Conjugate views under vmap]
#     ``t.conj()`` is a lazy view in torch: no copy, ``is_conj()``, a view of ``t``, and views of
#     it (``t.conj()[1:]``, ``.transpose``, ``.unbind``) are lazy views of ``t`` too. Inside
#     ``__torch_dispatch__`` the Conjugate key is excluded, so a rule handed the lazy physical
#     value would compute with the unconjugated numbers. A wrapper around a lazy conjugate is
#     therefore a ConjBatchedTensor: it holds only the lazy physical view (``_lazy_conj``) and
#     carries the conj bit itself (``is_conj()`` as PyTorch; ``c.real``/``c.imag`` decompose
#     as torch does for conj tensors). Its ``_value``, which rules and the fallback read, is the
#     resolved copy, made when first read and remade when a tensor may have been written since
#     (``WRITES``, bumped by vmap's ``process`` before every op that writes, and the lazy
#     view's version counter): a write into ``t`` after ``c = t.conj()`` shows in ``c``, as in
#     torch. View ops on it (``process`` sends them here) apply the op's rule to the lazy
#     value instead: the result keeps the conj bit and is wrapped lazily again, or is a plain
#     view when the op dropped the bit (``_conj`` of it, ``resolve_conj``). ``view_as_real``
#     raises torch's error, as torch does for a conj tensor. vmap returns the lazy view (Note
#     [Lazy conj outputs], functransforms/_vmap.py). In-place writes *into* such a wrapper or
#     its views raise InplaceError (docs/torch_func_differences.md): the fast paths skip the
#     subclass (they test ``type(a) is BatchedTensor``), so every op on it comes here.
class ConjBatchedTensor(BatchedTensor):
    """A BatchedTensor whose physical value is a lazy conjugate view (Note [Conjugate views
    under vmap])."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # the fast paths take values whose type is the ``cls`` they are given: not this one
        return _batched_torch_function(BatchedTensor, func, types, args, kwargs)

    @property
    def _value(self):
        lazy = self._lazy_conj[0]
        key = (WRITES[0], lazy._version)
        cached = self.__dict__.get("_resolved")
        if cached is not None and cached[0] == key:
            return cached[1]
        value = lazy.resolve_conj()
        self._resolved = (key, value)
        return value

    def _inner_requires_grad(self):  # Note [Torch autograd through our transforms]
        v = self._lazy_conj[0]
        return not isinstance(v, TransformTensor) and v.requires_grad

    def _describe(self):
        return (
            f"BatchedTensor(lvl={self._interp.level}, bdim={self._bdim}, "
            f"value={self._lazy_conj[0]!r})"
        )


_batched_torch_function = BatchedTensor.__torch_function__.__func__
SLOW_METADATA.add(ConjBatchedTensor)
SLOW_METADATA.add(LazyPiece)  # Note [Reading a wrapper's metadata]


def wrap_lazy_conj(value, bdim, interp):
    """A ConjBatchedTensor around ``value``, a lazy conjugate view with batch dim ``bdim``."""
    shape, st, dtype, device = metadata(value)
    r = _mk(
        ConjBatchedTensor,
        shape[:bdim] + shape[bdim + 1 :],
        st[:bdim] + st[bdim + 1 :],
        None,
        None,
        dtype,
        _STRIDED,
        device,
    )
    _compat.set_conj(r, True)
    r.__dict__ = {"_lazy_conj": (value,), "_bdim": bdim, "_interp": interp}
    return r


def lazy_conj_view(interp, f, args, kwargs):
    """A view op on a ConjBatchedTensor: its rule applied to the lazy value (None: no rule,
    the ordinary path then works on the resolved copy)."""
    rule = f.vmap_rule
    if rule is None:
        return None
    a = args[0]
    vals, bdims = interp._unwrap(args[1:])
    out, out_bdim = rule(interp, [a._lazy_conj[0], *vals], [a._bdim, *bdims], kwargs)
    if f.inplace_view:  # squeeze_, t_, ...: the wrapper takes the new view and shape
        a._lazy_conj = (out,)
        a._bdim = out_bdim
        a.__dict__.pop("_resolved", None)
        shape, st = out.shape, out.stride()
        with _NoTF(), _NoDispatch():
            a.as_strided_(
                shape[:out_bdim] + shape[out_bdim + 1 :], st[:out_bdim] + st[out_bdim + 1 :]
            )
        return a
    return interp._as_batched(out, out_bdim)
