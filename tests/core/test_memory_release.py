"""Dropping the results of ``vjp``, ``linearize``, ``jacrev`` and a ``jit``-ted call frees the
tensors they saved at once, by reference counting alone: the garbage collector is disabled while
it is measured, so a reference cycle anywhere in what a call returns would keep them alive.

Measured as the process's resident memory (Linux's /proc/self/statm) around tensors of 40 MB:
allocations that large are mapped and unmapped by the C allocator directly (above glibc's largest
mmap threshold, 32 MB), so the resident size drops as soon as torch frees one. Each case first
checks that holding the result keeps the saved tensors resident (the measurement sees them), then
that dropping it gives all of it back."""

from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch

import functransforms as ft

pytestmark = pytest.mark.skipif(
    not os.path.exists("/proc/self/statm"), reason="resident memory is read from /proc"
)

_N = 5 * 2**20  # float64 elements: 40 MB per tensor
_MB = 2**20
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _resident_mb():
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * _PAGE / _MB


def _f(x):  # [N] -> [N]; its vjp saves sin(x), x and exp(x * sin(x)): 40 MB each
    y = x.sin()
    return (y * x).exp()


def _measure(call):
    """(MB held while the result lives, MB still held once it is dropped), collector off."""
    call()  # one-time setup (rule records, jit's trace) is not what is measured
    gc.collect()
    gc.disable()
    try:
        base = _resident_mb()
        result = call()
        held = _resident_mb() - base
        del result
        return held, _resident_mb() - base
    finally:
        gc.enable()


torch.manual_seed(0)
_X = torch.randn(_N, dtype=torch.float64)
_CT = torch.ones(_N, dtype=torch.float64)

_CASES = {
    "vjp": lambda: ft.vjp(_f, _X),
    "vjp, pullback called": lambda: (lambda r: (r, r[1](_CT)))(ft.vjp(_f, _X)),
    "vjp, has_aux": lambda: ft.vjp(lambda x: (_f(x), {"aux": x.cos()}), _X, has_aux=True),
    "linearize": lambda: ft.linearize(_f, _X),
    "linearize, jvp_fn called": lambda: (lambda r: (r, r[1](_CT)))(ft.linearize(_f, _X)),
    # the Jacobian of a [N] -> [1] map is [1, N]: the result itself is one 40 MB tensor
    "jacrev": lambda: ft.jacrev(lambda x: _f(x).sum(0, keepdim=True))(_X),
    "vjp of grad": lambda: ft.vjp(ft.grad(lambda x: _f(x).sum()), _X),
}


@pytest.mark.parametrize("name", list(_CASES))
def test_dropping_the_result_frees_what_it_saved(name):
    held, after = _measure(_CASES[name])
    assert held >= 35, f"{name}: the result holds {held:.0f} MB; the measurement saw nothing"
    assert after < 8, f"{name}: {after:.0f} of {held:.0f} MB still resident after the drop"


def test_a_jitted_call_keeps_only_its_result_buffer():
    # Note [Large buffers reused across calls] (docs/jit.md): a result of 32 MB or more is kept,
    # once dropped, for the next call to write into; everything the replay computed on the way
    # is freed, and cache_clear() gives back the kept buffer too
    jitted = ft.jit(ft.grad(lambda x: _f(x).sum()))
    jitted(_X)  # the trace, and its first replay
    jitted.cache_clear()
    gc.collect()
    gc.disable()
    try:
        base = _resident_mb()
        result = jitted(_X)
        held = _resident_mb() - base
        del result
        after = _resident_mb() - base
        del_me = jitted(_X)  # written into the kept buffer: no growth
        del del_me
        again = _resident_mb() - base
        jitted.cache_clear()
        cleared = _resident_mb() - base
    finally:
        gc.enable()
    assert held >= 35, f"the 40 MB result holds {held:.0f} MB; the measurement saw nothing"
    assert after < 40 + 8, f"{after:.0f} MB held after the drop: more than the one kept result"
    assert again < 40 + 8, f"{again:.0f} MB held after a second call"
    assert cleared < 8, f"{cleared:.0f} MB still held after cache_clear()"


def test_a_pullback_does_not_keep_its_function_alive():
    # what vjp_fn closes over is the tape, not the user's function or its closure
    class Model:
        def __call__(self, x):
            return _f(x[:8])

    model = Model()
    ref = weakref.ref(model)
    gc.disable()
    try:
        out, vjp_fn = ft.vjp(model, _X)
        del model
        assert ref() is None
        vjp_fn(torch.ones(8, dtype=torch.float64))
    finally:
        gc.enable()


@pytest.mark.parametrize("transform", ["vjp", "linearize"])
def test_dropping_the_pullback_alone_frees_the_tape(transform):
    # the output is a plain tensor: keeping it must not keep what the pullback saved
    make = {"vjp": lambda: ft.vjp(_f, _X), "linearize": lambda: ft.linearize(_f, _X)}[transform]
    make()
    gc.collect()
    gc.disable()
    try:
        base = _resident_mb()
        out, fn = make()
        held = _resident_mb() - base
        del fn
        kept = _resident_mb() - base
    finally:
        gc.enable()
    assert held >= 75, f"output and saved values hold {held:.0f} MB; the measurement saw nothing"
    assert kept < 40 + 8, f"{kept:.0f} MB resident with only the 40 MB output kept"
    assert out.shape == _X.shape
