"""Random ops under vmap.

Note [Batching random ops]
    randomness='error' (the default): any random draw inside vmap is an error. Ops with a batched
    tensor argument are caught when they reach the vmap interpreter (they carry the
    ``nondeterministic_seeded`` tag); factory ops with no tensor argument (``torch.randn(3)``)
    never reach a tensor subclass, so they are caught by what they are, at a dispatch key:
    Note [Random ops by their tags].
    randomness='same': one draw shared by the batch: a factory op runs as is; an op on a batched
    tensor draws for one example's shape and is broadcast.
    randomness='different': independent draws per example. Factory ops must be seen, so only this
    setting installs a TorchDispatchMode (``DifferentRandomnessMode``) for the duration of the call.
"""

from __future__ import annotations

import inspect
import sys
import threading

import torch

from functransforms import _compat
from functransforms._core.gcpause import collector_paused
from functransforms._core.levels import TransformTensor, interpreter_stack
from functransforms._core.ops import facts, op_name
from functransforms.errors import (
    RandomnessError,
    raise_random,
    raise_same_with_batched_parameters,
)

from ._registry import register_vmap_rule
from ._tensor import BatchedTensor, VmapInterpreter, wrap_batched
from ._util import pad_to, to_front

aten = torch.ops.aten


# Note [Random ops by their tags]
#     A draw with no tensor argument (``torch.randn(3)``, ``torch.randn(3, generator=g)``, on
#     any device, ``meta`` included) never reaches a tensor subclass. Comparing the global RNG
#     state before and after the call (the first design) missed user generators, other devices
#     and meta, and fired when another *thread* drew. A ``TorchDispatchMode`` sees every op but
#     costs ~10 us on each. Instead, every ATen op tagged ``nondeterministic_seeded`` gets a
#     Python kernel at a dispatch key that no tensor carries and that is included in the
#     thread-local dispatch state only while a ``randomness='error'`` vmap runs on this thread;
#     every other op has a fallthrough at that key, which the dispatcher skips at no cost. The
#     kernel raises ``RandomnessError`` naming the op and the vmap call. Rules and the
#     per-example fallback run inside ``__torch_dispatch__``, where the dispatcher excludes the
#     key, so only the user's draws are seen. The key is ``TESTING_ONLY_GenericMode`` (torch
#     registers nothing there; checked on torch 2.13): torch has no key reserved for
#     third-party modes. Registration scans the op tags once, at the first such vmap.
_RANDOM_KEY = _compat.RANDOM_GUARD_KEY
# The same key as an enum value, for the thread-local state calls: given the name, pybind
# parses the string on every call (1.8 us each; three per vmap call and per guarded draw), and
# torch exposes no enum attribute for this key, so it is taken from a key set once.
_RANDOM_KEY_ENUM = _compat.DispatchKeySet(_RANDOM_KEY).highestPriorityTypeId()
_libs: list = []  # keeps the registrations alive
_COMPOSITE = _compat.CompositeImplicitAutograd
_dispatch_modes = _compat.len_torch_dispatch_stack


def _jit_tracing():
    # jit loads on first use (Note [Lazy parts of the package]): not loaded, nothing traces
    jit = sys.modules.get("functransforms._jit._trace")  # half imported by another thread: no trace
    return getattr(getattr(jit, "_tracing", None), "active", False)


def _dropout_p_position(op):
    for i, a in enumerate(op._schema.arguments):
        if a.name == "dropout_p":
            return i
    return None


def _random_op_kernel(op):
    p_at = _dropout_p_position(op)  # attention ops draw only when dropout_p > 0

    def random_op_in_error_vmap(*args, **kwargs):
        # under a tracing/fake dispatch mode (torch.compile's pattern tracing, FakeTensor) the
        # call records a graph, it does not draw; functransforms.jit's trace is replayed, so
        # its recorded draw is a real one
        draws = not _dispatch_modes() or _jit_tracing()
        if draws and p_at is not None:
            p = args[p_at] if len(args) > p_at else kwargs.get("dropout_p", 0.0)
            draws = p > 0
        for interp in reversed(interpreter_stack()) if draws else ():
            # a dead level is suspended (a custom function's replay): it sees no draw
            if (
                isinstance(interp, VmapInterpreter)
                and interp.alive
                and interp.randomness == "error"
            ):
                raise_random(interp, op)
        # included but no 'error' level on this thread's stack (e.g. a grad level's backward
        # run later): draw as usual, past this key
        _compat.dispatch_tls_set_dispatch_key_excluded(_RANDOM_KEY_ENUM, True)
        try:
            return op(*args, **kwargs)
        finally:
            _compat.dispatch_tls_set_dispatch_key_excluded(_RANDOM_KEY_ENUM, False)

    return random_op_in_error_vmap


@collector_paused  # Note [Long-lived setup without young collections]
def _register_random_kernels():
    # published whole, last, and checked again under the setup lock: another thread's first
    # vmap took a half-filled ``_libs`` for done, and its random ops were let through (Note
    # [One-time setup under one lock], functransforms/_core/gcpause.py)
    if _libs:
        return
    libs = []
    everything = torch.library.Library("_", "IMPL")
    everything.fallback(torch.library.fallthrough_kernel, _RANDOM_KEY)
    libs.append(everything)
    for ns in ("aten",):
        lib = torch.library.Library(ns, "IMPL")
        libs.append(lib)
        namespace = getattr(torch.ops, ns)
        for name in dir(namespace):
            packet = getattr(namespace, name, None)
            if not isinstance(packet, _compat.OpOverloadPacket):
                continue
            qualname = packet._qualified_op_name
            for overload in packet.overloads():
                # the tags through torch's C call: an OpOverload object for each of the ~900
                # packets' overloads would be made and kept (~2.9k objects at the first vmap,
                # Note [Cold start and torch's garbage] in benchmarks/bench_core.py)
                tags = _compat.op_overload_entry(
                    qualname, "" if overload == "default" else overload
                )[2]
                if torch.Tag.nondeterministic_seeded not in tags:
                    continue
                op = getattr(packet, overload)
                # composite ops are skipped: what they decompose into draws (or not: dropout
                # with train=False), and is caught there
                if not op.has_kernel_for_dispatch_key(_COMPOSITE):
                    lib.impl(op, _random_op_kernel(op), _RANDOM_KEY)
    _libs.extend(libs)


class no_random_ops:
    """While active on this thread, any random ATen op raises (Note [Random ops by their
    tags]); nests, and restores the previous state on exit."""

    def __enter__(self):
        if not _libs:
            _register_random_kernels()
        self.prev = _compat.dispatch_tls_is_dispatch_key_included(_RANDOM_KEY_ENUM)
        _compat.dispatch_tls_set_dispatch_key_included(_RANDOM_KEY_ENUM, True)
        return self

    def __exit__(self, *exc):
        _compat.dispatch_tls_set_dispatch_key_included(_RANDOM_KEY_ENUM, self.prev)
        return False


def error_guard_key():
    """The key ``no_random_ops`` includes, its kernels registered: vmap's lean path (Note
    [vmap's lean path], functransforms/_vmap.py) sets it itself, without the object."""
    if not _libs:
        _register_random_kernels()
    return _RANDOM_KEY_ENUM


def _has_tensor(args, kwargs):
    return any(isinstance(a, torch.Tensor) for a in args) or any(
        isinstance(v, torch.Tensor) for v in kwargs.values()
    )


class _Drawing(threading.local):
    active = False


_drawing = _Drawing()


class DifferentRandomnessMode(_compat.UncompiledDispatchMode):
    """Batches tensor-free random factory ops over every enclosing randomness='different' vmap.

    Uncompiled: its first op does not import torch._dynamo (~1 s); vmap's entry has put our
    packages on dynamo's skip list if dynamo is loaded (_compat.UncompiledDispatchMode)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _drawing.active:  # the draw of an inner mode, already batched for every level
            return func(*args, **kwargs)
        if (
            args
            and type(args[0]) is torch.Tensor
            and torch.Tag.nondeterministic_seeded in func.tags
            and facts(func).inplace
        ):
            _raise_different_inplace(func)
        if torch.Tag.nondeterministic_seeded in func.tags and not _has_tensor(args, kwargs):
            levels = [i for i in interpreter_stack() if isinstance(i, VmapInterpreter) and i.alive]
            for interp in levels:
                if interp.randomness == "error":
                    raise_random(interp, func)
            sizes = [i.batch_size for i in levels if i.randomness == "different"]
            _drawing.active = True
            try:
                out = _draw_with_batch_dims(func, args, kwargs, sizes)
            finally:
                _drawing.active = False
            for interp in (i for i in levels if i.randomness == "different"):
                out = wrap_batched(out, 0, interp)
            return out
        if torch.Tag.nondeterministic_seeded in func.tags and _only_plain_tensors(args, kwargs):
            # Note [Draws from unbatched tensors]
            args = [_batched_at_every_different_level(a) if _is_plain(a) else a for a in args]
            kwargs = {
                k: _batched_at_every_different_level(v) if _is_plain(v) else v
                for k, v in kwargs.items()
            }
        return func(*args, **kwargs)


# Note [Draws from unbatched tensors]
#     ``vmap(f, randomness='different')`` where f draws from a tensor the vmap does not batch
#     (``torch.rand_like(w)``, ``torch.bernoulli(p)``, ``Normal(mu, s).sample()`` with a shared
#     ``mu``): PyTorch gives each example its own draw, of the batched shape, in one call. Only
#     plain tensors, no wrapper, reach the kernel, so no batching rule sees the call and every
#     example got the same values. This mode sees it first and makes the tensor arguments
#     batched at every 'different' level (a batched 0-d zero added, as for dropout): the
#     op's batching rule then draws the batched shape, the same bits as functorch.
def _is_plain(a):
    return type(a) is torch.Tensor


def _only_plain_tensors(args, kwargs):
    seen = False
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            if type(a) is not torch.Tensor:
                return False
            seen = True
    return seen


# Note [Dropout of an unbatched tensor]
#     ``vmap(f, randomness='different')`` where f drops out a tensor the vmap does not batch (an
#     ensemble's shared input, ``nn.Dropout`` first): PyTorch gives each example its own mask.
#     torch's CPU dropout is a composite kernel drawing into ``empty_like(input)`` in place;
#     for an unbatched input that buffer is a plain tensor the C++ kernel holds, which cannot
#     take one draw per example (``_raise_different_inplace``). So, under a 'different' vmap
#     only, a function mode sees the dropout functions first and makes their input batched at
#     every 'different' level (plus a batched 0-d zero, which broadcasts): the kernel then draws
#     into a batched buffer. In-place dropout still raises (it writes into the unbatched input).
def _dropout_funcs():
    F = torch.nn.functional
    return frozenset(
        (F.dropout, F.alpha_dropout, F.feature_alpha_dropout, F.dropout1d, F.dropout2d,
         F.dropout3d, F.rrelu, torch.dropout, torch.alpha_dropout, torch.feature_dropout,
         torch.feature_alpha_dropout, torch.rrelu)
    )  # fmt: skip


_DROPOUT_FUNCS: frozenset = frozenset()


def _inplace(func, args, kwargs):
    if kwargs.get("inplace"):
        return True
    try:  # the nn.functional forms have a signature with `inplace`; torch.* builtins do not
        params = list(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        return False
    return (
        "inplace" in params
        and len(args) > params.index("inplace")
        and bool(args[params.index("inplace")])
    )


def _levels_batching(x):
    """The vmap levels at which ``x`` is batched (its chain of wrappers)."""
    levels = []
    while isinstance(x, TransformTensor):
        if isinstance(x, BatchedTensor):
            levels.append(x._interp)
        x = x._value if hasattr(x, "_value") else x._primal
    return levels


def _batched_at_every_different_level(x):
    batching = _levels_batching(x)  # levels that batch x already need nothing
    for interp in interpreter_stack():
        if (
            isinstance(interp, VmapInterpreter)
            and interp.alive
            and interp.randomness == "different"
            and all(level is not interp for level in batching)
        ):
            zero = torch.zeros(interp.batch_size, dtype=x.dtype, device=x.device)
            x = x + wrap_batched(zero, 0, interp)
    return x


def _front_contiguous(x):
    """functorch's dropout draws its mask for the batch as one [B, ...] tensor in row-major
    order, whatever the input's batch dim (in_dims=1): a mask drawn like the input's layout
    would hold the same numbers in other places."""
    if isinstance(x, BatchedTensor) and x._interp.randomness == "different":
        v = x._value
        if x._bdim != 0 or not v.is_contiguous():
            return wrap_batched(to_front(v, x._bdim).contiguous(), 0, x._interp)
    return x


class _DifferentDropoutInputs(torch.overrides.TorchFunctionMode):
    """Note [Dropout of an unbatched tensor]."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (
            func in _DROPOUT_FUNCS
            and args
            and isinstance(args[0], torch.Tensor)
            and args[0].is_floating_point()
            and not _inplace(func, args, kwargs)
        ):
            x = _front_contiguous(_batched_at_every_different_level(args[0]))
            args = (x, *args[1:])
        return func(*args, **kwargs)


class different_randomness:
    """What a randomness='different' vmap runs under: DifferentRandomnessMode and the dropout
    function mode (Note [Dropout of an unbatched tensor])."""

    def __enter__(self):
        global _DROPOUT_FUNCS
        if not _DROPOUT_FUNCS:
            _DROPOUT_FUNCS = _dropout_funcs()
        modes = (DifferentRandomnessMode(), _DifferentDropoutInputs())
        self.modes = ()
        try:
            for m in modes:
                m.__enter__()
                self.modes += (m,)
        except BaseException:  # Note [Entering is all or nothing] (functransforms/_core/levels.py)
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        modes, self.modes = self.modes, ()
        _exit_all(list(reversed(modes)), exc)
        return False


def _exit_all(modes, exc):
    """``m.__exit__`` of each mode, in order, even if one raises (a KeyboardInterrupt inside the
    first left the second on the stack: Note [Entering is all or nothing], _core/levels.py)."""
    if modes:
        try:
            modes[0].__exit__(*exc)
        finally:
            _exit_all(modes[1:], exc)


def _raise_different_inplace(func):
    """PyTorch's rule: an in-place draw into a tensor that is not batched would have to hold
    one value per example."""
    interp = next(
        i for i in reversed(interpreter_stack()) if isinstance(i, VmapInterpreter) and i.alive
    )
    raise RandomnessError(
        f"{interp.call}: {op_name(func)} draws random numbers in place into a tensor that is not "
        "batched, but vmap was called with randomness='different' (one draw per example), which "
        "that tensor cannot hold. Expected: the tensor written to is batched. Do: draw out of "
        "place (`torch.randn(shape)`), or make the target batched (`x.expand(...).clone()` per "
        "example)."
    )


def _draw_with_batch_dims(func, args, kwargs, sizes):
    if not sizes:
        return func(*args, **kwargs)
    # every tensor-free random factory takes its size as the first list argument
    # (randn/rand/randint(size) have it first; randint(high, size)/(low, high, size) later)
    a = list(args)
    for i, v in enumerate(a):
        if isinstance(v, (list, tuple)) and all(isinstance(s, int) for s in v):
            a[i] = [*sizes, *v]
            return func(*a, **kwargs)
    if "size" in kwargs:
        kw = dict(kwargs)
        kw["size"] = [*sizes, *kwargs["size"]]
        return func(*args, **kw)
    # e.g. randperm(n): no size list; draw one per example and stack
    out = torch.stack(
        [_draw_with_batch_dims(func, args, kwargs, sizes[1:]) for _ in range(sizes[0])]
    )
    return out


# ops whose tensor arguments are distribution parameters, not only a shape to fill
_PARAMETRIZED = frozenset((aten.bernoulli.default, aten.normal.Tensor_float))


def def_random_like(func):
    """rand_like(x), randn_like(x), bernoulli(x), dropout-style ops on a batched tensor."""

    n_out = len(func._schema.returns)
    out_bdims = 0 if n_out == 1 else (0,) * n_out

    def random_vmap_rule(interp, args, bdims, kwargs):
        if interp.randomness == "error":
            raise_random(interp, func)
        if interp.randomness == "same" and func in _PARAMETRIZED:
            raise_same_with_batched_parameters(interp, func)
        x = to_front(args[0], bdims[0])
        if interp.randomness == "different":
            a = list(args)
            a[0] = x
            if any(b is not None for b in bdims[1:]):
                for i in range(1, len(a)):
                    if bdims[i] is not None:
                        a[i] = to_front(a[i], bdims[i])
            return func(*a, **kwargs), out_bdims
        # 'same': one example's draw, broadcast over the batch
        a = list(args)
        a[0] = x[0]
        out = func(*a, **kwargs)
        if n_out > 1:  # native_dropout: (output, mask)
            return tuple(o.unsqueeze(0).expand(x.shape) for o in out), out_bdims
        return out.unsqueeze(0).expand(x.shape), 0

    register_vmap_rule(func)(random_vmap_rule)


for _op in (
    aten.rand_like.default,
    aten.randn_like.default,
    aten.bernoulli.default,
    aten.bernoulli.p,
    aten.native_dropout.default,
    aten.randint_like.default,
    aten.randint_like.low_dtype,
    aten.normal.Tensor_float,
):
    def_random_like(_op)


def _normal_tensor_params_vmap_rule(func):
    """normal(mean, std) with a tensor mean and/or std, at least one batched: 'different'
    draws the whole batched shape in one call, as functorch does (same bits with the same
    seed; the per-example loop this op fell to drew other values); 'same' refuses batched
    parameters, as functorch."""

    def normal_vmap_rule(interp, args, bdims, kwargs):
        if interp.randomness == "error":
            raise_random(interp, func)
        if interp.randomness == "same":
            raise_same_with_batched_parameters(interp, func)
        nd = max(a.dim() - (b is not None) for a, b in zip(args[:2], bdims) if torch.is_tensor(a))
        a = list(args)
        for i in (0, 1):
            if bdims[i] is not None:
                a[i] = pad_to(to_front(a[i], bdims[i]), nd)
        return func(*a, **kwargs), 0

    register_vmap_rule(func)(normal_vmap_rule)


_normal_tensor_params_vmap_rule(aten.normal.Tensor_Tensor)
_normal_tensor_params_vmap_rule(aten.normal.float_Tensor)


@register_vmap_rule(aten.multinomial.default)
def multinomial_vmap_rule(interp, args, bdims, kwargs):
    """multinomial(probs [C] or [N, C], k) -> [k] or [N, k]: the rows of every example are
    drawn together ('different'); under 'same' batched probabilities raise, as in PyTorch."""
    if interp.randomness == "error":
        raise_random(interp, aten.multinomial.default)
    if interp.randomness == "same":  # batched probabilities: per-example parameters
        raise_same_with_batched_parameters(interp, aten.multinomial.default)
    p = to_front(args[0], bdims[0])
    out = aten.multinomial.default(p.reshape(-1, p.shape[-1]), *args[1:], **kwargs)
    return out.reshape((*p.shape[:-1], out.shape[-1])), 0


def def_random_inplace(func):
    """x.uniform_(), x.normal_(), x.bernoulli_(p) on a batched x."""

    def random_inplace_vmap_rule(interp, args, bdims, kwargs):
        if interp.randomness == "error":
            raise_random(interp, func)
        if interp.randomness == "same" and any(b is not None for b in bdims[1:]):
            raise_same_with_batched_parameters(interp, func)
        x = to_front(args[0], bdims[0])
        if interp.randomness == "different":
            rest = [  # tensor parameters (bernoulli_'s p) line up with x's batch dim
                a if b is None else pad_to(to_front(a, b), x.dim() - 1)
                for a, b in zip(args[1:], bdims[1:])
            ]
            func(x, *rest, **kwargs)
        else:
            func(x[0], *args[1:], **kwargs)
            x[1:].copy_(x[0].expand(x[1:].shape))
        return args[0], bdims[0]

    register_vmap_rule(func)(random_inplace_vmap_rule)


for _op in (
    aten.uniform_.default,
    aten.normal_.default,
    aten.bernoulli_.float,
    aten.bernoulli_.Tensor,
    aten.exponential_.default,
    aten.random_.default,
    getattr(aten.random_, "from"),
    aten.random_.to,
    aten.cauchy_.default,
    aten.log_normal_.default,
    aten.geometric_.default,
):
    def_random_inplace(_op)
