"""Random ops under vmap.

Note [Batching random ops]
    randomness='error' (the default): any random draw inside vmap is an error. Ops with a batched
    tensor argument are caught when they reach the vmap interpreter (they carry the
    ``nondeterministic_seeded`` tag); factory ops with no tensor argument (``torch.randn(3)``)
    never reach a tensor subclass, so vmap compares the global RNG state before and after the
    call: a change means something drew random numbers, and that is an error too. No dispatch
    mode is needed, so the default pays no per-op cost for it.
    randomness='same': one draw shared by the batch: a factory op runs as is; an op on a batched
    tensor draws for one example's shape and is broadcast.
    randomness='different': independent draws per example. Factory ops must be seen, so only this
    setting installs a TorchDispatchMode (``DifferentRandomnessMode``) for the duration of the call.
"""

from __future__ import annotations

import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from functransforms._core import interpreter_stack

from ._registry import register_vmap_rule
from ._tensor import VmapInterpreter, raise_random, wrap_batched
from ._util import to_front

aten = torch.ops.aten


def rng_state(device_types):
    """A cheap snapshot of the generators a function could draw from."""
    states = [torch.default_generator.get_state()]
    if "cuda" in device_types and torch.cuda.is_available() and torch.cuda.is_initialized():
        states.extend(torch.cuda.get_rng_state_all())
    return states


def rng_changed(before, after):
    return any(not torch.equal(a, b) for a, b in zip(before, after))


def _has_tensor(args, kwargs):
    return any(isinstance(a, torch.Tensor) for a in args) or any(
        isinstance(v, torch.Tensor) for v in kwargs.values()
    )


class _Drawing(threading.local):
    active = False


_drawing = _Drawing()


class DifferentRandomnessMode(TorchDispatchMode):
    """Batches tensor-free random factory ops over every enclosing randomness='different' vmap."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _drawing.active:  # the draw of an inner mode, already batched for every level
            return func(*args, **kwargs)
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
        return func(*args, **kwargs)


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


def _random_like_rule(func):
    """rand_like(x), randn_like(x), bernoulli(x), dropout-style ops on a batched tensor."""

    def random_vmap_rule(interp, args, bdims, kwargs):
        if interp.randomness == "error":
            raise_random(interp, func)
        x = to_front(args[0], bdims[0])
        if interp.randomness == "different":
            a = list(args)
            a[0] = x
            if any(b is not None for b in bdims[1:]):
                for i in range(1, len(a)):
                    if bdims[i] is not None:
                        a[i] = to_front(a[i], bdims[i])
            return func(*a, **kwargs), 0
        # 'same': one example's draw, broadcast over the batch
        a = list(args)
        a[0] = x[0]
        out = func(*a, **kwargs)
        return out.unsqueeze(0).expand(x.shape), 0

    return random_vmap_rule


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
    register_vmap_rule(_op)(_random_like_rule(_op))


@register_vmap_rule(aten.multinomial.default)
def multinomial_vmap_rule(interp, args, bdims, kwargs):
    """multinomial(probs [C] or [N, C], k) -> [k] or [N, k]: the rows of every example are
    drawn together ('different'), or one example's draw is shared ('same')."""
    if interp.randomness == "error":
        raise_random(interp, aten.multinomial.default)
    p = to_front(args[0], bdims[0])
    if interp.randomness == "same":
        out = aten.multinomial.default(p[0], *args[1:], **kwargs)
        return out.unsqueeze(0).expand((p.shape[0], *out.shape)), 0
    out = aten.multinomial.default(p.reshape(-1, p.shape[-1]), *args[1:], **kwargs)
    return out.reshape((*p.shape[:-1], out.shape[-1])), 0


def _random_inplace_rule(func):
    """x.uniform_(), x.normal_(), x.bernoulli_(p) on a batched x."""

    def random_inplace_vmap_rule(interp, args, bdims, kwargs):
        if interp.randomness == "error":
            raise_random(interp, func)
        x = to_front(args[0], bdims[0])
        if interp.randomness == "different":
            func(x, *args[1:], **kwargs)
        else:
            func(x[0], *args[1:], **kwargs)
            x[1:].copy_(x[0].expand(x[1:].shape))
        return args[0], bdims[0]

    return random_inplace_vmap_rule


for _op in (
    aten.uniform_.default,
    aten.normal_.default,
    aten.bernoulli_.float,
    aten.exponential_.default,
    aten.random_.default,
    getattr(aten.random_, "from"),
    aten.random_.to,
    aten.cauchy_.default,
    aten.log_normal_.default,
    aten.geometric_.default,
):
    register_vmap_rule(_op)(_random_inplace_rule(_op))
