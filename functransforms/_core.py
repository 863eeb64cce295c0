"""The transform core: levels, the interpreter stack, and the one routing path from the
dispatcher to the innermost interpreter.

Note [Levels]
    Every active transform call (one vmap, one jvp, one grad/vjp) pushes an interpreter with a
    fresh, strictly increasing level, and pops it on exit (also on exceptions). Values taking
    part in a level are wrapped in that level's tensor subclass. An op touching wrappers is
    processed by the interpreter with the highest level among its arguments; the interpreter
    unwraps *its own* level only and runs ordinary torch ops on what is inside, which may be
    wrappers of lower levels: that recursion is how transforms compose. Anything not wrapped at
    a level (captured from outside, created inside) is a constant at that level, so perturbation
    confusion cannot happen. Levels are never reused, so a wrapper that escapes its transform is
    recognised (its interpreter is dead) instead of being mistaken for a new level's value.
"""

from __future__ import annotations

import itertools
import threading

import torch

from .errors import EscapedTracerError


class _State(threading.local):
    def __init__(self):
        self.stack: list[Interpreter] = []


_state = _State()
_level_counter = itertools.count(1)  # shared by all threads: levels are globally unique


class Interpreter:
    """One active transform call. Subclasses implement ``process``."""

    name = "transform"

    def __init__(self):
        self.level = next(_level_counter)
        self.alive = True

    def process(self, func, args, kwargs):  # pragma: no cover - abstract
        raise NotImplementedError

    def process_custom(self, custom_fn, args):  # pragma: no cover - abstract
        raise NotImplementedError

    def __enter__(self):
        _state.stack.append(self)
        return self

    def __exit__(self, *exc):
        popped = _state.stack.pop()
        assert popped is self, "interpreter stack corrupted"
        self.alive = False
        return False

    def __repr__(self):
        return f"{type(self).__name__}(level={self.level})"


def interpreter_stack() -> tuple[Interpreter, ...]:
    """The active interpreters, outermost first."""
    return tuple(_state.stack)


class TransformTensor(torch.Tensor):
    """Base of the wrapper subclasses (BatchedTensor, DualTensor, GradTensor).

    A wrapper has the *logical* shape, dtype and device; ``_interp`` is the interpreter of the
    level it belongs to. Every ATen op touching a wrapper arrives in ``__torch_dispatch__``,
    which routes it to the innermost interpreter among the arguments (Note [Levels]).
    """

    _interp: Interpreter

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        interp = _innermost(args, kwargs)
        return interp.process(func, args, kwargs or {})

    def __repr__(self, *, tensor_contents=None):
        return self._describe()

    # Note [Escaping to Python]
    #     torch.func lets a transformed function read values out as Python/NumPy data
    #     (``x.tolist()``, ``x.numpy()``; ``.item()`` arrives as ``aten._local_scalar_dense``):
    #     the values are not differentiated. torch's C++ methods refuse wrapper subclasses, so
    #     the wrappers define them: a Dual/GradTensor hands over its primal; a BatchedTensor
    #     raises (one Python value cannot hold a batch: DataDependentError); a wrapper whose
    #     transform has returned says that it escaped, and from which transform.
    def tolist(self):
        return self._python_value("tolist").tolist()

    def numpy(self, *, force=False):
        return self._python_value("numpy").numpy(force=force)

    def __array__(self, dtype=None, copy=None):
        value = self._python_value("__array__").numpy(force=True)
        return value if dtype is None else value.astype(dtype, copy=False)

    def _python_value(self, method):
        interp = self._interp
        if not interp.alive:
            raise EscapedTracerError(
                f"`.{method}()` of a {interp.name} wrapper tensor (level {interp.level}) after its "
                f"{interp.name} call returned: the value escaped the transformed function "
                "(stored in a global, a closure or an attribute). Return it from the function."
            )
        return self._escape_value(method)

    def _escape_value(self, method):
        return self._primal  # Dual/GradTensor; BatchedTensor overrides

    def requires_grad_(self, requires_grad=True):
        raise RuntimeError(
            f"x.requires_grad_() inside a function transformed by {self._interp.name}: this is "
            "not supported (as in torch.func). Expected: let the transform track derivatives "
            "(grad/vjp/jvp take care of it); use torch.autograd outside the transform."
        )


def _innermost(args, kwargs) -> Interpreter:
    """The interpreter of the highest level among the wrappers in ``args``/``kwargs``."""
    best = None
    level = -1
    for a in args:
        if isinstance(a, TransformTensor):
            i = a._interp
            if i.level > level:
                best, level = i, i.level
        elif type(a) is list or type(a) is tuple:
            for b in a:
                if isinstance(b, TransformTensor):
                    i = b._interp
                    if i.level > level:
                        best, level = i, i.level
    if kwargs:
        for a in kwargs.values():
            if isinstance(a, TransformTensor):
                i = a._interp
                if i.level > level:
                    best, level = i, i.level
    if not best.alive:
        raise EscapedTracerError(
            f"A {best.name} wrapper tensor (level {best.level}) was used after its "
            f"{best.name} call returned: a value leaked out of the transformed function "
            "(stored in a global, a closure or an attribute). Return it from the function instead."
        )
    return best


def wrapper_level(x) -> int:
    """The level of a wrapper, or 0 for a plain tensor / non-tensor."""
    return x._interp.level if isinstance(x, TransformTensor) else 0


def is_floating(t) -> bool:
    """True for floating and complex dtypes: the values that can carry derivatives."""
    return t.dtype.is_floating_point or t.dtype.is_complex


def make_wrapper(cls, like_shape, dtype, device):
    return torch.Tensor._make_wrapper_subclass(cls, like_shape, dtype=dtype, device=device)
