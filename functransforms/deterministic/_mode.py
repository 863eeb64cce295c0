"""The recording dispatch mode shared by audit, check_deterministic and level="threads".

Note [Seeing the ops a transform emits]
    A ``TorchDispatchMode`` runs before subclass dispatch, and inside its ``__torch_dispatch__``
    the mode is popped. So a mode that simply calls ``func(*args)`` on our wrappers sees the
    user's op once (on the wrapper) and none of the physical ops the interpreter then runs: the
    batched kernel, the primal computation, the tangent. ``TransformAwareMode`` therefore
    handles an op on a wrapper by calling the innermost interpreter's ``process`` itself (what
    ``TransformTensor.__torch_dispatch__`` would do) with the mode pushed again, so every op the
    rule emits comes back to the mode, down to the plain tensors. Plain ops go to ``on_op``.
    Nothing is installed when no audit/check/threads-level is active: zero cost otherwise.

Note [Which transform introduced an op]
    While a wrapper op is processed, the mode keeps a context (interpreter, op). An op emitted
    inside a context is the user's own op when it is the same overload as the context's op and
    the first such emission (grad's primal computation, jvp's primal output, vmap's batched
    kernel of the same op): it inherits the context's origin. Any other op was introduced by
    that transform (a tangent, a batched form through another op) unless the context already
    had an origin. Ops of a backward pass run inside ``autodiff.reverse.backward`` after the
    forward returned; the mode remembers, for each tape node it saw created, the user's line of
    the forward op, and a backward op is attributed to that line and to the grad-like transform
    (``grad``, ``vjp``, ``jacrev``...) found through the ``node`` being swept.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback

from functransforms import _compat
from functransforms._core.levels import TransformTensor, _innermost


def _library_dirs():
    import torch

    import functransforms
    import functransforms.autodiff
    import functransforms.batching
    import functransforms.linalg

    dirs = {os.path.dirname(torch.__file__)}
    for m in (
        functransforms,
        functransforms.autodiff,
        functransforms.batching,
        functransforms.linalg,
    ):
        dirs.add(os.path.dirname(os.path.abspath(m.__file__)))
    return tuple(d + os.sep for d in dirs)


_LIB_DIRS = None
_LIB_FILES = {contextlib.__file__, os.path.abspath(contextlib.__file__)}
_is_lib: dict = {}  # code object -> bool


def _library_code(code) -> bool:
    r = _is_lib.get(code)
    if r is None:
        global _LIB_DIRS
        if _LIB_DIRS is None:
            _LIB_DIRS = _library_dirs()
        fn = code.co_filename
        afn = os.path.abspath(fn) if not fn.startswith("<") else fn
        r = fn in _LIB_FILES or afn.startswith(_LIB_DIRS)
        _is_lib[code] = r
    return r


def user_frame(frame=None):
    """The first frame outside torch, functransforms and contextlib (or None)."""
    f = frame or sys._getframe(1)
    while f is not None and _library_code(f.f_code):
        f = f.f_back
    return f


def summary(f) -> traceback.FrameSummary | None:
    if f is None:
        return None
    return traceback.FrameSummary(f.f_code.co_filename, f.f_lineno, f.f_code.co_name)


_BACKWARD_CODE = None


def _backward_code():
    global _BACKWARD_CODE
    if _BACKWARD_CODE is None:
        from functransforms.autodiff.reverse import backward

        # the sweep itself, not the torch.compile entry wrapper around it
        _BACKWARD_CODE = getattr(backward, "__wrapped__", backward).__code__
    return _BACKWARD_CODE


def transform_name(interp) -> str:
    call = getattr(interp, "call", None) or interp.name
    return call.split("(")[0]


class TransformAwareMode(_compat.UncompiledDispatchMode):
    """Sees every op, including those our transforms emit (Note [Seeing the ops...]).
    Uncompiled: its first op does not import torch._dynamo and sympy (~1 s); entering puts
    our packages on dynamo's skip list if dynamo is loaded (_compat.UncompiledDispatchMode)."""

    def __enter__(self):
        from functransforms._core.compiling import keep_dynamo_out

        if "torch._dynamo" in sys.modules:
            keep_dynamo_out()
        return super().__enter__()

    def __init__(self):
        super().__init__()
        self.contexts = []  # [interp, func, first_seen, passthrough]
        self.node_info = {}  # tape node id -> (FrameSummary, transform) of its forward op

    # -- dispatch ------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        passthrough = self._passthrough(func)
        for t in types:
            if issubclass(t, TransformTensor):
                return self._process(func, args, kwargs, passthrough)
        return self.on_op(func, types, args, kwargs, passthrough)

    def _passthrough(self, func):
        if not self.contexts:
            return True
        ctx = self.contexts[-1]
        if ctx[1] is func and not ctx[2]:
            ctx[2] = True
            return True
        return False

    def _process(self, func, args, kwargs, passthrough):
        interp = _innermost(args, kwargs)
        self.contexts.append([interp, func, False, passthrough])
        try:
            with self:
                out = interp.process(func, args, kwargs)
        finally:
            self.contexts.pop()
        if interp.name == "grad" and self.wants_nodes:
            self._note_node(out, interp, passthrough)
        return out

    wants_nodes = True

    def on_op(self, func, types, args, kwargs, passthrough):  # pragma: no cover - abstract
        return func(*args, **kwargs)

    # -- attribution (Note [Which transform introduced an op]) ---------------------------------
    def _note_node(self, out, interp, passthrough):
        node = getattr(out, "_node", None)
        if node is None and isinstance(out, (tuple, list)):
            for o in out:
                node = getattr(o, "_node", None)
                if node is not None:
                    break
        if node is not None and node.id not in self.node_info:
            loc, origin = self.where(sys._getframe(1), passthrough)
            self.node_info[node.id] = (loc, origin or transform_name(interp))

    def where(self, frame, passthrough):
        """(FrameSummary of the user's line, transform that introduced the op or None)."""
        origin = None
        f = frame
        loc = None
        bw = _backward_code()
        while f is not None:
            if f.f_code is bw:
                node = f.f_locals.get("node")
                info = self.node_info.get(getattr(node, "id", None))
                if info is not None:
                    loc, origin = info
                break
            if not _library_code(f.f_code):
                break
            f = f.f_back
        if loc is None:
            loc = summary(user_frame(frame))
        cs = self.contexts
        for i in range(1, len(cs)):
            if origin is None and not cs[i][3]:
                origin = transform_name(cs[i - 1][0])
        if origin is None and not passthrough and cs:
            origin = transform_name(cs[-1][0])
        return loc, origin
