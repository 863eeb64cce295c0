"""BatchedTensor and the vmap interpreter."""

from __future__ import annotations

import warnings

import torch

from functransforms import _compat
from functransforms import _pytree as pt
from functransforms._autograd_function import _has_wrapper
from functransforms._core.decomp import decomposition
from functransforms._core.levels import (
    DEFERRING,
    Interpreter,
    TransformTensor,
    below_torch_autograd,
)
from functransforms._core.metadata import SLOW_METADATA, PlainMetadata, is_floating, metadata
from functransforms._core.ops import draws_random, facts, op_name
from functransforms._core.writes import writing_into
from functransforms._custom import ClosedOverStandIn, _CustomFunction
from functransforms._vmap import vmap
from functransforms.errors import (  # raise_*: re-exported for rule modules
    FallbackWarning,
    InplaceError,
    raise_data_dependent,
    raise_dynamic_shape,
    raise_inplace_into_conj,
    raise_inplace_into_neg,
    raise_inplace_out_unbatched,
    raise_inplace_unbatched,
    raise_random,
    raise_same_with_batched_parameters,  # noqa: F401  (re-exported)
)

from ._fastpath import (
    ELEMENTWISE_RULES,
    POINTWISE_FUNCS,
    SHAPED_FUNCS,
    ensure_table,
    pointwise_fast,
)
from ._registry import WRITES_CHECKED_BY_RULE

_no_torch_function = _compat.disabled_torch_function_impl
_torch_requires_grad = _compat.tensor_requires_grad  # not a wrapper's property
_NUMBERS = frozenset((int, float, bool, complex))
_Tensor = torch.Tensor
_DATA_GET = torch.Tensor.data.__get__
_STRIDED = torch.strided
_NO_RESULT = object()  # the inline fast path did not apply
# Note [Logical metadata without torch.Size]
#     A new wrapper's logical sizes are its value's minus the batch dim. Slicing the ``torch.Size``
#     that ``.shape`` returns builds another ``torch.Size`` through a call of the type (~0.2 us warm
#     per wrapper, several times that right after a large kernel has flushed the caches, as in
#     bench_distributed.py's (a)); ``tuple.__getitem__`` slices it into a plain tuple, which
#     ``_make_wrapper_subclass`` reads the same (an int sequence; SymInts too). A CPU value's device
#     is always ``device(type='cpu')``: the one built here is passed instead of a new one per
#     wrapper (``is_cpu`` reads a flag, ``.device`` allocates).
_tuple_item = tuple.__getitem__
_FROM_1 = slice(1, None)
_CPU = torch.device("cpu")
_ABOVE_ALL = 1 << 62  # a replaced level's ops go to its stand-in first (process_custom)


class BatchedTensor(PlainMetadata, TransformTensor):
    """A value with one extra (physical) batch dimension ``_bdim``, hidden from user code.

    ``_value`` is the physical tensor (possibly a wrapper of a lower level); the wrapper itself
    has the per-example (logical) shape.
    """

    # Not ``__slots__`` for the three fields (~0.1 us less per op): autodiff's promotion of a
    # buffer written under vmap(grad) swaps ``__class__`` between a BatchedTensor and a grad
    # wrapper (autodiff/_util.py, _swap), which needs one object layout
    _value: torch.Tensor
    _bdim: int

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        inplace_at = POINTWISE_FUNCS.get(func)
        if inplace_at is not None:  # Note [Pointwise fast path]
            # its commonest cases first, inline: one plain value with at most a Python number,
            # two values of this level with one batch dim and one logical rank, or a plain
            # tensor that broadcasts against the logical dims (the batch dim in front: what
            # _pointwise_general checks for these two operands)
            if inplace_at < 0 and not kwargs and type(args[0]) is cls:
                a = args[0]
                v, interp = a._value, a._interp
                out = _NO_RESULT
                if type(v) is _Tensor and interp.alive:
                    n = len(args)
                    if n == 1 or (n == 2 and type(args[1]) in _NUMBERS):
                        if not (_torch_requires_grad(v) and below_torch_autograd()):
                            out = func(v) if n == 1 else func(v, args[1])
                    elif n == 2:
                        b = args[1]
                        if type(b) is cls:
                            w = b._value
                            if (
                                b._interp is interp
                                and b._bdim == a._bdim
                                and type(w) is _Tensor
                                and w.dim() == v.dim()
                                and not (
                                    (_torch_requires_grad(v) or _torch_requires_grad(w))
                                    and below_torch_autograd()
                                )
                            ):
                                out = func(v, w)
                        elif (
                            type(b) is _Tensor
                            and a._bdim == 0
                            and v.dim() > max(1, b.dim())  # 1 <= logical rank >= b's rank
                            and not (
                                (_torch_requires_grad(v) or _torch_requires_grad(b))
                                and below_torch_autograd()
                            )
                        ):
                            out = func(v, b)
                if out is not _NO_RESULT:
                    if type(out) is not _Tensor:
                        return out
                    # wrap_batched's common case, inline (a call is ~0.1 us of the ~4 us an op pays
                    # in bench_core's 20-op pointwise row), without its check for lazy conjugate or
                    # negative bits: ``out`` is the fresh result of a function of the pointwise
                    # table (one new tensor, no alias) applied to values that enter wrappers without
                    # such bits, so it has none; its batch dim is the one of ``a``
                    bdim = a._bdim
                    st = out.stride()
                    if bdim == 0:  # Note [Logical metadata without torch.Size]
                        shape, st = _tuple_item(out.shape, _FROM_1), st[1:]
                    else:
                        shape = tuple(out.shape)
                        shape, st = shape[:bdim] + shape[bdim + 1 :], st[:bdim] + st[bdim + 1 :]
                    dev = _CPU if out.is_cpu else out.device
                    r = _mk(BatchedTensor, shape, st, None, None, out.dtype, _STRIDED, dev)
                    r.__dict__ = {"_value": out, "_bdim": bdim, "_interp": interp}  # one store
                    return r
            out = pointwise_fast(func, inplace_at, args, kwargs, cls, wrap_batched)
            if out is not None:
                return out
        elif (shaped := SHAPED_FUNCS.get(func)) is not None:  # Note [Shaped fast path]
            out = shaped(func, args, kwargs, cls, wrap_batched)
            if out is not None:
                return out
        elif func is _getitem and len(args) == 2:
            index = _tensor_index(args[1])
            if index is not None:
                return torch.ops.aten.index.Tensor(args[0], index)
        elif func == _DATA_GET and args[0]._interp.alive:  # a fresh method-wrapper each time
            raise RuntimeError(
                f"{args[0]._interp.call}: `x.data` of a batched tensor is not allowed under vmap "
                "(as in PyTorch): it would bypass the batching. Expected: use x itself, or "
                "x.detach() to stop gradients."
            )
        if len(types) > 1:  # Note [Torch functions at the grad level under vmap]
            for t in types:
                funcs = DEFERRING.get(t)
                if funcs is not None and func in funcs:
                    return NotImplemented  # the inner level's class sees it first
        return _no_torch_function(func, types, args, kwargs or {})

    # Note [Metadata reads without __torch_function__]
    #     Defining ``__torch_function__`` (for the pointwise fast path) makes torch route every
    #     metadata read on a BatchedTensor (``x.dtype``, ``x.shape``, ``x.stride()``) through it:
    #     ~1.5 us instead of ~0.05, and the grad level's bookkeeping under ``vmap(grad(f))``
    #     reads a dozen per op (each wrapper it builds copies shape, strides, dtype and device of
    #     a BatchedTensor). ``__torch_function__`` never changes what these return, so the class
    #     shadows torch's accessors with ones that read the same C++ fields with subclass torch
    #     functions disabled (torch function *modes* still see them, as before).
    #     The accessors are PlainMetadata's (functransforms/_core/metadata.py), a base of this
    #     class.

    def _inner_requires_grad(self):  # Note [Torch autograd through our transforms]
        v = self._value
        return not isinstance(v, TransformTensor) and v.requires_grad

    def _describe(self):
        return f"BatchedTensor(lvl={self._interp.level}, bdim={self._bdim}, value={self._value!r})"

    def _escape_value(self, method):  # Note [Escaping to Python]
        from functransforms.errors import DataDependentError

        raise DataDependentError(
            f"{self._interp.call}: `.{method}()` reads a batched tensor as Python data, which "
            "would need one value per example. Expected: keep the computation in tensor ops "
            "(torch.where instead of if/else), or move it out of vmap."
        )


SLOW_METADATA.add(BatchedTensor)  # Note [Reading a wrapper's metadata]
_mk = _compat.make_wrapper_subclass
_getitem = torch.Tensor.__getitem__


def _is_int_scalar(a):
    return (
        isinstance(a, BatchedTensor)
        and a.dim() == 0
        and not is_floating(a)
        and a.dtype != torch.bool
    )


def _tensor_index(index):
    """``v[i]`` with ``i`` a batched 0-d integer tensor: torch's indexing turns a 0-d integer
    index into a Python int (``.item()``: one value per example, so vmap would raise), but
    ``aten.index.Tensor(v, [i])`` is the same selection as a gather. Returns the index list
    when every entry is a tensor (or None) and one is such an ``i``; else None (ordinary path)."""
    entries = index if type(index) is tuple else (index,)
    if not any(_is_int_scalar(e) for e in entries):
        return None
    if all(e is None or isinstance(e, torch.Tensor) for e in entries):
        return list(entries)
    return None


def _refuse_writes_into(materialized, view, interp):
    """A negative view (``torch._neg_view(x)``, ``z.conj().imag``) is materialized when it enters
    a wrapper, so a write into it reached the copy and never the tensor it views: silently lost.
    As for conjugate views (raise_inplace_into_conj), it raises, once the level exits: writes
    inside dispatch bump no version counter, so the copy is compared with the view (one
    comparison per negative view; they are rare)."""

    def check():
        if materialized.is_floating_point() or materialized.is_complex():
            same = torch.allclose(materialized, view, rtol=0, atol=0, equal_nan=True)
        else:
            same = torch.equal(materialized, view)
        if not same:
            raise_inplace_into_neg(interp)

    return check


def wrap_batched(value, bdim, interp):
    if type(value) is torch.Tensor and not (value.is_conj() or value.is_neg()):
        # the common case, on the per-op path: a plain value (an op's result), no lazy bits;
        # dtype and device positionally: keywords cost _make_wrapper_subclass ~0.5 us of parsing
        st = value.stride()
        if bdim == 0:  # Note [Logical metadata without torch.Size]
            shape, st = _tuple_item(value.shape, _FROM_1), st[1:]
        else:
            shape = tuple(value.shape)
            shape, st = shape[:bdim] + shape[bdim + 1 :], st[:bdim] + st[bdim + 1 :]
        dev = _CPU if value.is_cpu else value.device
        r = _mk(BatchedTensor, shape, st, None, None, value.dtype, _STRIDED, dev)
        r.__dict__ = {"_value": value, "_bdim": bdim, "_interp": interp}  # one store, not three
        return r
    shape, st, dtype, device = metadata(value)  # Note [Reading a wrapper's metadata]
    if value.is_conj() or value.is_neg():
        # Note [Conjugate views]: inside __torch_dispatch__ the dispatcher no longer resolves
        # conjugate/negative bits lazily, so a rule would compute z * z with the physical
        # value of z.conj(). A lazy conjugate is kept lazy, in a wrapper that resolves it
        # when a rule reads it (Note [Conjugate views under vmap], views.py); other bits are
        # materialized when they enter a wrapper.
        if not value.is_neg():
            from .views import wrap_lazy_conj

            return wrap_lazy_conj(value, bdim, interp)
        materialized = value.resolve_conj().resolve_neg()
        if type(value) is torch.Tensor and value.is_neg() and not value.is_meta:
            interp.on_exit(_refuse_writes_into(materialized, value, interp))
        value = materialized
        shape, st, dtype, device = metadata(value)
    # The wrapper reports the logical strides (the physical ones minus the batch dim), so that
    # torch's own view-or-copy decisions (reshape, matmul folding, contiguous) on the logical
    # tensor match what the physical value allows.
    shape = tuple(shape)  # Note [Logical metadata without torch.Size]
    r = _mk(
        BatchedTensor,
        shape[:bdim] + shape[bdim + 1 :],
        st[:bdim] + st[bdim + 1 :],
        None,
        None,
        dtype,
        _STRIDED,
        device,
    )
    r.__dict__ = {"_value": value, "_bdim": bdim, "_interp": interp}
    return r


class VmapInterpreter(Interpreter):
    """Processes ops on this level's BatchedTensors through the batching rules."""

    name = "vmap"

    def __init__(self, batch_size: int, randomness: str, call: str = "vmap(f)"):
        super().__init__()
        ensure_table()
        self.batch_size = batch_size
        self.randomness = randomness
        self.call = call

    # -- unwrapping ------------------------------------------------------------------------
    def _unwrap(self, args):
        vals = list(args)
        bdims = [None] * len(args)
        for i, a in enumerate(args):
            if isinstance(a, BatchedTensor):
                if a._interp is self:
                    vals[i] = a._value
                    bdims[i] = a._bdim
            elif type(a) is list or type(a) is tuple:
                if any(isinstance(b, BatchedTensor) and b._interp is self for b in a):
                    sub_v, sub_b = self._unwrap(a)
                    vals[i] = sub_v
                    bdims[i] = sub_b
        return vals, bdims

    def _as_batched(self, out, bdim):
        if bdim is None:
            return out
        if isinstance(out, torch.Tensor):
            return wrap_batched(out, bdim, self)
        return type(out)(self._as_batched(o, b) for o, b in zip(out, bdim))

    # -- processing ------------------------------------------------------------------------
    def process(self, func, args, kwargs):
        """Autodidax's ``process_primitive``: unwrap this level, apply the op's rule, wrap."""
        f = facts(func)  # Note [One record per op]
        if not kwargs and f.vmap_rule in ELEMENTWISE_RULES:
            out = self._elementwise(func, args)  # Note [Pointwise ops reaching the interpreter]
            if out is not None:
                return out
        if f.written:
            WRITES[0] += 1  # Note [Conjugate views under vmap]: resolutions may go stale
            if f.inplace and getattr(args[0], "_lazy_conj", None) is not None:
                raise_inplace_into_conj(self, func)
        if (f.view or f.inplace_view) and getattr(args[0], "_lazy_conj", None) is not None:
            from .views import lazy_conj_view  # Note [Conjugate views under vmap]

            out = lazy_conj_view(self, f, args, kwargs)
            if out is not None:
                return out
        if (
            kwargs
            and self._batched_kwargs(func, f, kwargs)
            and not getattr(f.vmap_rule, "unwraps_kwargs", False)
        ):
            return self._fallback(func, args, kwargs)
        vals, bdims = self._unwrap(args)
        # self for add_, the target of prims.copy_to, ... (batch norm checks its own)
        for i in f.written if func not in WRITES_CHECKED_BY_RULE else ():
            if bdims[i] is None and any(b is not None for b in bdims):
                raise_inplace_unbatched(self, func)
        rule = f.vmap_rule
        if rule is None:
            return self._without_rule(func, f, args, kwargs)
        if f.inplace:
            if not below_torch_autograd() and torch.is_grad_enabled():
                vals = _tracked_destination(self, args, vals)
            with _write_target(self, args, vals):  # Note [Physical roots of writes under vmap]
                rule(self, vals, bdims, kwargs)
            return args[0]
        out, out_bdim = rule(self, vals, bdims, kwargs)
        if f.inplace_view:
            return _set_view_inplace(args[0], out, out_bdim)
        if not below_torch_autograd():
            out, out_bdim = self._batched_where_torch_records(out, out_bdim)
        return self._as_batched(out, out_bdim)

    # Note [Unbatched outputs under torch's autograd]
    #     An op's output that the rule leaves unbatched (``bdim`` None: lstsq's empty residuals,
    #     an output that does not depend on the batched inputs) goes back as the plain tensor.
    #     When torch's autograd records the op (a plain input requires grad: Note [Torch
    #     autograd through our transforms], functransforms/_core/levels.py), torch's Autograd kernel
    #     above this call then gives that plain tensor the history it recorded on the wrappers
    #     (saving them), replacing the real one: ``torch.autograd.grad`` through
    #     ``ft.vmap(lstsq, in_dims=(0, None))`` reached a dead wrapper (EscapedTracerError).
    #     There, such an output is returned batched (a view expanded over the batch: the value
    #     vmap returns for it anyway), so torch's history lands on a wrapper, as for the others.
    def _batched_where_torch_records(self, out, out_bdim):
        def expand(o, b):
            if (
                b is None
                and isinstance(o, torch.Tensor)
                and (o.is_floating_point() or o.is_complex())
            ):
                return o.unsqueeze(0).expand(self.batch_size, *o.shape), 0
            return o, b

        if isinstance(out, torch.Tensor):
            return expand(out, out_bdim)
        if type(out_bdim) is tuple and None in out_bdim and type(out) in (tuple, list):
            pairs = [expand(o, b) for o, b in zip(out, out_bdim)]
            return type(out)(o for o, _ in pairs), tuple(b for _, b in pairs)
        return out, out_bdim

    def _elementwise(self, func, args):
        """Note [Pointwise ops reaching the interpreter]: the op on the values when every tensor
        argument is a BatchedTensor (not a lazy subclass) of this level, all with one batch dim
        and one physical rank; else None."""
        bdim = nd = -1
        vals = []
        for a in args:
            if type(a) is BatchedTensor:
                if a._interp is not self:
                    return None
                v = a._value
                d = v.dim()
                if bdim == -1:
                    bdim, nd = a._bdim, d
                elif a._bdim != bdim or d != nd:
                    return None
                vals.append(v)
            elif isinstance(a, torch.Tensor) or type(a) is list or type(a) is tuple:
                return None
            else:
                vals.append(a)
        if bdim == -1:
            return None
        out = func(*vals)
        return (
            wrap_batched(out, bdim, self) if type(out) is _Tensor else self._as_batched(out, bdim)
        )

    def _batched_kwargs(self, func, f, kwargs):
        """Whether a keyword argument is batched at this level (rules see positional arguments
        only, so such an op loops); an ``out=`` tensor that is not batched raises."""
        for k in f.written_kwargs:
            v = kwargs.get(k)
            if v is not None and not (isinstance(v, BatchedTensor) and v._interp is self):
                raise_inplace_out_unbatched(self, func, k)
        return any(isinstance(v, BatchedTensor) and v._interp is self for v in kwargs.values())

    def _without_rule(self, func, f, args, kwargs):
        # Note [Composite ops inside rules] (autodiff/_util.py), then Note [Decomposition
        # fallback]: composite kernels batch op by op, as under jvp and vjp.
        d = _composite(func) or decomposition(func)
        if d is not None and not f.written:
            try:
                with _lazy_conj_enabled():
                    return d(*args, **kwargs)
            except InplaceError:  # it fills a fresh (unbatched) buffer: loop instead
                pass
        return self._fallback(func, args, kwargs)

    def _fallback(self, func, args, kwargs):
        """Note [vmap fallback]: run the op once per example and stack the results."""
        f = facts(func)
        random = draws_random(func, args, kwargs)
        if random and self.randomness == "error":
            raise_random(self, func)
        if func in _DYNAMIC_SHAPE:  # PyTorch refuses them even when the sizes agree
            raise_dynamic_shape(self, func)
        same_draw = random and self.randomness == "same"
        if same_draw and any(
            _is_batched_at(a, self) for i, a in enumerate(args) if i not in f.written
        ):
            raise_same_with_batched_parameters(self, func)
        if func not in _WARNED:
            _WARNED.add(func)
            warnings.warn(
                f"vmap: there is no batching rule for {op_name(func)}, so it runs as a "
                "per-example loop (correct but slow). Register one with "
                f"`@functransforms.batching.register_vmap_rule({op_name(func)})`.",
                FallbackWarning,
                stacklevel=3,
            )
        if f.inplace_view:  # as_strided_, set_: an example's new view cannot reshape the batch
            raise InplaceError(
                f"{self.call}: {op_name(func)} changes the shape or memory of a batched tensor in "
                "place, and it has no batching rule: run once per example, it would leave the "
                "batched tensor unchanged. Do: use the out-of-place form (`x.as_strided(...)`, a "
                "new tensor) instead."
            )
        B = self.batch_size
        results = []
        # 'same': every example draws from the same generator state, so the draws agree
        rng = (torch.random.get_rng_state(), _cuda_rng()) if same_draw else None
        with _lazy_conj_enabled():
            for i in range(B):
                if rng is not None:
                    torch.random.set_rng_state(rng[0])
                    if rng[1] is not None:
                        torch.cuda.set_rng_state_all(rng[1])
                a_i = [_select(a, self, i) for a in args]
                k_i = {k: _select(v, self, i) for k, v in kwargs.items()}
                results.append(func(*a_i, **k_i))
        written = f.written
        if written:  # each example wrote into its slice of the (batched) target
            return args[written[0]]
        first = results[0]
        if isinstance(first, torch.Tensor):
            return wrap_batched(self._stack(func, results), 0, self)
        if isinstance(first, (tuple, list)) and all(isinstance(o, torch.Tensor) for o in first):
            return type(first)(
                wrap_batched(self._stack(func, [r[j] for r in results]), 0, self)
                for j in range(len(first))
            )
        raise_data_dependent(self, func)

    def _stack(self, func, results):
        shapes = [tuple(r.shape) for r in results]
        if any(s != shapes[0] for s in shapes):  # bincount, repeat_interleave: value-sized
            raise_dynamic_shape(self, func, shapes)
        return torch.stack(results)

    def process_custom(self, custom_fn, args):
        """Note [Custom rules across levels]: the user's vmap rule, or a custom function whose
        ``fn``, ``fwd``, ``bwd`` and jvp rule are this level's vmap of the originals, so the
        custom rules stay visible to the levels below."""
        flat, spec = pt.tree_flatten(args)
        vals, bdims = self._unwrap(flat)
        if custom_fn.vmap_rule is not None:
            return self._user_vmap_rule(custom_fn, vals, bdims, spec)
        in_dims = tuple(pt.tree_unflatten(spec, bdims))
        r = self.randomness
        generated = None
        if custom_fn.generic_vmap is not None:
            batched, *generated = self._generated_rules(custom_fn.generic_vmap, in_dims)
            bwd = custom_fn.generic_vmap[2]
        else:
            fn, fwd, bwd, jvp_rule = (
                custom_fn.fn,
                custom_fn.fwd,
                custom_fn.bwd,
                custom_fn.jvp_rule,
            )
            batched = _CustomFunction(vmap(fn, in_dims=in_dims, randomness=r))
            if fwd is not None:
                batched.fwd = vmap(fwd, in_dims=in_dims, randomness=r)
            if jvp_rule is not None:
                batched.defjvp(vmap(jvp_rule, in_dims=(in_dims, in_dims), randomness=r))
        if bwd is not None:
            # one mapped argument holding both: residuals or cotangents may be None (an empty
            # pytree), which an int in_dim of their own would refuse (a user's mistake there)
            packed_bwd = vmap(lambda res_ct: bwd(*res_ct), in_dims=0, randomness=r)

            def batched_bwd(res, ct):
                return packed_bwd((res, ct))

            if any(d is None for d in bdims):
                batched_bwd = _summed_over_unmapped(batched_bwd, args, bdims)
            batched.defvjp(batched.fwd, batched_bwd)
            # the residuals are this level's vmap of the original's, the flag with them: an
            # autograd.Function after ctx.set_materialize_grads(False) gets None for an
            # output without a cotangent at every level, as in functorch (not zeros)
            batched.materialize_grads = custom_fn.materialize_grads
        if generated is not None:
            # a vmap nested in this one batches the batched pieces the same way
            run, residuals, tangents = generated
            bwd_piece = batched_bwd if bwd is not None else None
            batched.generic_vmap = (run, residuals, bwd_piece, tangents)
        # Note [Random draws in custom functions under vmap]: the vmapped pieces replace this
        # level (its values are unwrapped), so it must not batch their draws a second time:
        # under randomness='different' the dropout and factory modes batched a draw inside
        # ``vmap(fn)`` at this level too, and the result leaked a wrapper of this level out
        # of the inner vmap (an EscapedTracerError). The level is dead while they run.
        self.alive = False
        # Note [Values a custom function closes over under vmap] (functransforms/_custom.py)
        level, self.level, self.stand_in = self.level, _ABOVE_ALL, ClosedOverStandIn(self)
        try:
            out = batched(*pt.tree_unflatten(spec, vals))
        finally:
            self.alive, self.level, self.stand_in = True, level, None
        return pt.tree_map(lambda o: wrap_batched(o, 0, self), out)

    def _generated_rules(self, pieces, in_dims):
        """Note [Generated vmap rules of autograd.Function]

        An ``autograd.Function`` with ``generate_vmap_rule=True`` is batched as functorch does
        it: a new custom function whose forward is the vmap of the original's ``forward`` and
        whose rules are the vmaps of its ``setup_context``, ``backward`` and ``jvp``. The
        levels enclosing this vmap must see that function as their op and use its rules:
        its forward re-enters it while an enclosing level still wraps the arguments, and runs
        the vmapped forward's ops only on plain values. Running those ops on values the
        enclosing levels still wrapped made them differentiate the forward's own ops instead
        (zero for the implicit solves, whose forward is ``zeros_like``): a second derivative
        outside a vmap of a structured solve (``hessian(lambda P: vmap(f)(P).sum())``) was
        wrong, silently. A vmap nested in this one batches the batched function's pieces
        again (its ``generic_vmap``), never its re-entering forward. Returns ``(batched
        function, vmapped forward, vmapped setup, vmapped jvp)``."""
        forward_ops, setup, bwd, tangents_out = pieces
        r = self.randomness
        run = vmap(forward_ops, in_dims=in_dims, randomness=r)
        residuals = vmap(setup, in_dims=(in_dims, 0), randomness=r)

        def fn(*a):
            if _has_wrapper(a, {}):  # an enclosing level: the batched Function is its op too
                return batched(*a)
            return run(*a)

        def fwd(*a):
            out = fn(*a)
            return out, residuals(a, out)

        batched = _CustomFunction(fn)
        batched.fwd = fwd
        tangents = None
        if tangents_out is not None:
            tangents = vmap(tangents_out, in_dims=(0, in_dims, in_dims), randomness=r)

            def jvp_rule(primals, tangents_in):
                out, ctx = fwd(*primals)
                return out, tangents(ctx, primals, tangents_in)

            batched.defjvp(jvp_rule)
        return batched, run, residuals, tangents

    def _user_vmap_rule(self, cf, vals, bdims, spec):
        """custom_vmap: the user's rule sees the batched arguments with the mapped dim in
        front."""
        front = [v if d is None else v.movedim(d, 0) for v, d in zip(vals, bdims)]
        in_batched = [d is not None for d in bdims]
        args = pt.tree_unflatten(spec, front)
        out, out_batched = cf.vmap_rule(self.batch_size, in_batched, *args)
        flat_out, out_spec = pt.tree_flatten(out)
        flags = (
            [out_batched] * len(flat_out)
            if isinstance(out_batched, bool)
            else pt.tree_leaves(out_batched)
        )
        if len(flags) != len(flat_out):
            raise ValueError(
                f"vmap rule of {cf.__name__}: returned out_batched={out_batched!r} for "
                f"{len(flat_out)} outputs; expected one bool per output leaf (or one bool for "
                "all)."
            )
        wrapped = []
        for o, b in zip(flat_out, flags):
            if getattr(o, "_interp", None) is self:  # Note [Values a custom function closes ...]
                raise ValueError(
                    f"vmap rule of {cf.__name__}: it returned a value batched by the enclosing "
                    "vmap itself: the rule (or what it calls) used a tensor of that vmap that is "
                    "not among its arguments (a closure, a global, an attribute), but a vmap rule "
                    "sees the arguments' batched values only (functorch raises here too). Pass "
                    "that tensor to the custom function as an argument."
                )
            has_batch = (
                isinstance(o, torch.Tensor) and o.dim() > 0 and o.shape[0] == self.batch_size
            )
            if b and not has_batch:
                got = tuple(o.shape) if isinstance(o, torch.Tensor) else type(o).__name__
                raise ValueError(
                    f"vmap rule of {cf.__name__}: an output marked batched has shape {got}; "
                    f"expected the mapped dim of size {self.batch_size} in front."
                )
            wrapped.append(wrap_batched(o, 0, self) if b else o)
        return pt.tree_unflatten(out_spec, wrapped)


def _summed_over_unmapped(batched_bwd, args, bdims):
    """Note [Cotangents of unmapped arguments of custom functions]: the vmapped ``bwd`` gives
    one cotangent per example for every argument, but an argument this level does not map
    (in_dim None: a weight shared by the batch) is one value, used by every example: its
    cotangent is the sum over the examples (the transpose of broadcasting it). Left per
    example, an enclosing grad received a cotangent of the batched shape (grad of a vmapped
    vjp_fn through a custom function that calls itself in its bwd, as linalg's implicit solves
    do: a wrong value, silently)."""
    per_arg = [len(pt.tree_leaves(a)) for a in args]

    def summed(ct):
        return ct.sum(0) if isinstance(ct, torch.Tensor) else ct

    def bwd(res, ct):
        cts = batched_bwd(res, ct)
        cts = cts if isinstance(cts, tuple) else (cts,)
        flat = pt.tree_leaves(cts)
        if len(cts) != len(args) and len(flat) == len(bdims):  # one cotangent per leaf
            return tuple(summed(c) if d is None else c for c, d in zip(flat, bdims))
        out, start = [], 0
        for c, n in zip(cts, per_arg):
            dims = bdims[start : start + n]
            start += n
            leaves, spec = pt.tree_flatten(c)
            if c is None or len(leaves) != n:
                out.append(c)
                continue
            leaves = [summed(x) if d is None else x for x, d in zip(leaves, dims)]
            out.append(pt.tree_unflatten(spec, leaves))
        return tuple(out)

    return bwd


_WARNED: set = set()
# ops PyTorch refuses under vmap because their output size depends on the values
_DYNAMIC_SHAPE = frozenset(
    getattr(torch.ops.aten, n).default
    for n in ("nonzero", "_unique", "_unique2", "unique_consecutive", "unique_dim")
)
# Note [Conjugate views under vmap] (views.py): bumped before every op that writes a tensor
WRITES = [0]


def _is_batched_at(a, interp):
    if isinstance(a, BatchedTensor):
        return a._interp is interp
    return (type(a) is list or type(a) is tuple) and any(_is_batched_at(b, interp) for b in a)


def _cuda_rng():
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.get_rng_state_all()
    return None


# native_batch_norm's schema does not mark the running statistics it updates as written, so
# its composite kernel (which hands them to _native_batch_norm_legit) is not safe to batch op
# by op: it keeps its own rule or loop.
_NOT_DECOMPOSED = {torch.ops.aten.native_batch_norm.default}


def _composite(func):
    from functransforms.autodiff._util import composite_implicit

    return None if func in _NOT_DECOMPOSED else composite_implicit(func)


_K = _compat.DispatchKey
_set_excluded = _compat.SetExcludeDispatchKeyGuard


class _lazy_conj_enabled:
    """Note [Conjugate views]: inside ``__torch_dispatch__`` torch excludes the Conjugate and
    Negative keys, so a kernel that builds a lazy ``conj()``/``neg()`` view and hands it to an
    op without native support reads the raw values (``torch.linalg.pinv`` of a complex matrix
    comes out wrong). Wrapping resolves such views (``wrap_batched``), and rules use resolved
    values; the per-example fallback and decompositions run arbitrary kernels, so they turn
    the two keys back on (a few microseconds: too much for the per-op hot path)."""

    def __enter__(self):
        self._guards = (_set_excluded(_K.Conjugate, False), _set_excluded(_K.Negative, False))
        for g in self._guards:
            g.__enter__()

    def __exit__(self, *exc):
        for g in reversed(self._guards):
            g.__exit__(*exc)
        return False


def _select(a, interp, i):
    if isinstance(a, BatchedTensor) and a._interp is interp:
        return a._value.select(a._bdim, i)
    if type(a) is list or type(a) is tuple:
        return type(a)(_select(b, interp, i) for b in a)
    return a


def _write_target(interp, args, vals):
    """`writing_into` for an in-place op's target: its physical value, or for a view of a
    wrapper of this level that wrapper's physical value with the view's as an alias."""
    base = args[0]._base
    if base is None:
        return writing_into(vals[0])
    if type(base) is BatchedTensor and base._interp is interp:
        return writing_into(base._value, (args[0]._value,))
    return writing_into(None)


def _tracked_destination(interp, args, vals):
    """Note [Writes into views that torch records]: the physical destination of an in-place
    op, as a view torch's autograd knows of its base's physical value."""
    base = args[0]._base
    if type(base) is not BatchedTensor or base._interp is not interp:
        return vals
    bv, dv = base._value, vals[0]
    if type(bv) is not _Tensor or type(dv) is not _Tensor or dv is bv or dv._base is not None:
        return vals
    if dv.untyped_storage().data_ptr() != bv.untyped_storage().data_ptr():
        return vals
    vals = list(vals)
    vals[0] = bv.as_strided(dv.size(), dv.stride(), dv.storage_offset())
    return vals


# Note [Writes into views that torch records]
#     Rules make their physical views below torch's autograd, so torch does not know a
#     physical slice as a view of its base: a write of a value that requires grad into it
#     (``buf[:, 1:3].copy_(x)``, as the decompositions of circular padding do) gave the slice
#     a history and left the base without one, so ``loss.backward()`` through ``vmap`` of
#     ``F.pad(..., mode="circular")`` raised, and a base that had a history kept only it.
#     When torch records the write (a value requiring grad takes part), a destination whose
#     wrapper is a view of a wrapper of this level is written through a view of the base's
#     physical value made with torch's autograd on (``as_strided`` over the same memory), so
#     torch rebases the base's history as in eager code.


def _set_view_inplace(self_wrapper, new_value, bdim):
    """In-place view ops (squeeze_, t_, ...) change the wrapper's own shape: give it the new
    physical value and reset its logical metadata without dispatching back to us."""
    self_wrapper._value = new_value
    self_wrapper._bdim = bdim
    shape = tuple(new_value.shape)
    shape = shape[:bdim] + shape[bdim + 1 :]
    st = new_value.stride()
    with _compat.DisableTorchDispatch():
        self_wrapper.as_strided_(shape, st[:bdim] + st[bdim + 1 :])
    return self_wrapper
