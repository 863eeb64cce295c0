"""Reverse mode: GradTensor, the tape, the grad interpreter and the backward sweep.

Note [The tape]
    Each op on a GradTensor of level L records a ``Node`` holding the vjp rule, the unwrapped
    inputs, the output and, per input, the node that produced it. Node ids grow with creation, so
    sweeping the nodes reachable from the outputs in decreasing id order visits every node after
    all its consumers. The sweep runs ordinary torch ops on cotangents after level L has exited:
    the values it touches are plain tensors or wrappers of *lower* levels, so an enclosing vmap
    batches the backward pass and an enclosing grad/jvp differentiates it.
"""

from __future__ import annotations

import heapq
import itertools
import weakref

import torch

from functransforms._core import Interpreter, TransformTensor, is_floating
from functransforms._decomp import decomposition
from functransforms._ops import facts, op_name
from functransforms.errors import InplaceError

from ._registry import VJP_RULES, missing_rule
from ._util import match_dtype

_mk = torch.Tensor._make_wrapper_subclass
_ids = itertools.count()


class Node:
    __slots__ = ("id", "rule", "primals", "kwargs", "out", "inputs", "needs", "__weakref__")

    def __init__(self, rule, primals, kwargs, out, inputs, needs):
        self.id = next(_ids)
        self.rule = rule
        self.primals = primals
        self.kwargs = kwargs
        self.out = out
        self.inputs = inputs  # per positional arg: None | (Node, idx) | list of those
        self.needs = needs

    def __lt__(self, other):  # max-heap by id through negation is done by the caller
        return self.id > other.id


class Leaf(Node):
    """The node of a value the user differentiates with respect to."""

    __slots__ = ()

    def __init__(self):
        self.id = next(_ids)
        self.inputs = ()


class GradTensor(TransformTensor):
    """A value tracked by one grad/vjp level: its primal and the node that produced it."""

    _primal: torch.Tensor
    _node: Node
    _idx: int

    def _describe(self):
        return f"GradTensor(lvl={self._interp.level}, primal={self._primal!r})"


def wrap_grad(primal, node, idx, interp):
    r = _mk(GradTensor, primal.shape, dtype=primal.dtype, device=primal.device)
    r._primal = primal
    r._node = node
    r._idx = idx
    r._interp = interp
    r._views = None
    return r


class GradInterpreter(Interpreter):
    name = "grad"

    def _unwrap(self, args):
        primals = list(args)
        inputs = [None] * len(args)
        needs = [False] * len(args)
        for i, a in enumerate(args):
            if isinstance(a, GradTensor):
                if a._interp is self:
                    primals[i] = a._primal
                    inputs[i] = (a._node, a._idx)
                    needs[i] = True
            elif type(a) is list or type(a) is tuple:
                if any(isinstance(b, GradTensor) and b._interp is self for b in a):
                    p, inp, nd = self._unwrap(a)
                    primals[i], inputs[i], needs[i] = p, inp, True
        return primals, inputs, needs

    def process(self, func, args, kwargs):
        f = facts(func)
        if f.inplace or f.inplace_view:
            return self._inplace(func, f, args, kwargs)
        primals, inputs, needs = self._unwrap(args)
        rule = VJP_RULES.get(func)
        if rule is None:
            d = decomposition(func)
            if d is not None:
                return d(*args, **kwargs)
        out = func(*primals, **kwargs)
        if rule is None:
            if isinstance(out, torch.Tensor):
                if not is_floating(out):
                    return out
            elif not any(isinstance(o, torch.Tensor) and is_floating(o) for o in out):
                return out
            raise missing_rule(func, "vjp", "register_vjp_rule")
        if rule is NONDIFFERENTIABLE:
            return out
        node = Node(rule, primals, kwargs, out, inputs, needs)
        if isinstance(out, torch.Tensor):
            if not is_floating(out):
                return out
            w = wrap_grad(out, node, 0, self)
            if f.view:
                _note_view(args[0], w)
            return w
        return type(out)(
            wrap_grad(o, node, i, self) if isinstance(o, torch.Tensor) and is_floating(o) else o
            for i, o in enumerate(out)
        )

    def _inplace(self, func, f, args, kwargs):
        """Note [In-place under grad]: the functional op is recorded and the wrapper is rebound to
        its result, so saved values are never mutated. A wrapper with live views cannot be
        rebound consistently, so that case raises instead of giving wrong gradients."""
        self_ = args[0]
        if not (isinstance(self_, GradTensor) and self_._interp is self):
            raise InplaceError(
                f"grad: {op_name(func)} writes a differentiated value in place into a tensor that "
                "is not differentiated (captured from outside the transform or created inside it, "
                "e.g. `out = torch.zeros(3); out[0] = x`). Do: build the result out of place "
                "(torch.stack / torch.cat / torch.where), or start from a differentiated value "
                "(`out = x.new_zeros(3) + 0 * x.sum()` is not needed: use torch.stack([...]))."
            )
        if _has_live_views(self_) or getattr(self_, "_is_view", False):
            raise NotImplementedError(
                f"grad: {op_name(func)} mutates a differentiated tensor that shares memory with "
                "another one (a view such as `x[0]`, `x.T`, `x.view(...)`, or the base of one). "
                "In-place updates through views are not supported under grad/vjp yet. Do: use "
                "the out-of-place form (e.g. `x = torch.cat([x[:1] * 2, x[1:]])` or "
                "`x = x.index_put((idx,), v)`)."
            )
        functional = f.functional
        if functional is None:
            raise missing_rule(func, "vjp", "register_vjp_rule")
        new = self.process(functional, args, kwargs)
        if isinstance(new, GradTensor) and new._interp is self:
            self_._primal, self_._node, self_._idx = new._primal, new._node, new._idx
        else:  # the result no longer depends on this level (e.g. x.zero_())
            self_._primal, self_._node, self_._idx = new, Leaf(), 0
        if f.inplace_view:
            with torch._C._DisableTorchDispatch():
                self_.as_strided_(self_._primal.shape, _contiguous(self_._primal.shape))
        return self_


NONDIFFERENTIABLE = object()  # a vjp "rule" for ops whose outputs carry no derivative


def _note_view(base, view):
    view._is_view = True
    if isinstance(base, GradTensor):
        if base._views is None:
            base._views = []
        base._views.append(weakref.ref(view))


def _has_live_views(t):
    views = t._views
    return bool(views) and any(r() is not None for r in views)


def _contiguous(shape):
    strides, s = [], 1
    for n in reversed(shape):
        strides.append(s)
        s *= max(n, 1)
    return tuple(reversed(strides))


def backward(roots, leaves):
    """The cotangents of ``leaves`` given ``roots``: a list of (node, idx, cotangent).

    Returns one entry per leaf: its accumulated cotangent, or None (a symbolic zero).
    """
    acc: dict = {}  # node -> list of cotangents per output
    heap = []
    seen = set()
    for node, idx, ct in roots:
        if ct is None:
            continue
        _accumulate(acc, node, idx, ct)
        if node.id not in seen:
            seen.add(node.id)
            heapq.heappush(heap, node)
    while heap:
        node = heapq.heappop(heap)
        if type(node) is Leaf:
            continue
        cts = acc.get(node)
        if cts is None:
            continue
        out = node.out
        if isinstance(out, torch.Tensor):
            ct = cts[0]
        else:
            ct = tuple(cts)
        input_cts = node.rule(ct, node.primals, node.kwargs, out, node.needs)
        for i, inp in enumerate(node.inputs):
            if inp is None:
                continue
            c = input_cts[i]
            if c is None:
                continue
            if type(inp) is list:
                prims = node.primals[i]
                for j, sub in enumerate(inp):
                    if sub is not None and c[j] is not None:
                        _push(acc, heap, seen, sub, match_dtype(c[j], prims[j]))
            else:
                _push(acc, heap, seen, inp, match_dtype(c, node.primals[i]))
        del acc[node]  # free cotangents as soon as they are consumed
    return [_leaf_ct(acc, leaf) for leaf in leaves]


def _leaf_ct(acc, leaf):
    cts = acc.get(leaf)
    return None if cts is None else cts[0]


def _push(acc, heap, seen, inp, ct):
    node, idx = inp
    _accumulate(acc, node, idx, ct)
    if node.id not in seen:
        seen.add(node.id)
        heapq.heappush(heap, node)


def _accumulate(acc, node, idx, ct):
    cts = acc.get(node)
    if cts is None:
        n = 1 if isinstance(getattr(node, "out", None), torch.Tensor) or type(node) is Leaf else len(node.out)
        cts = acc[node] = [None] * n
    prev = cts[idx]
    cts[idx] = ct if prev is None else prev + ct
