"""Hypothesis strategies for random programs under random stacks of transforms.

A drawn :class:`Stack` is a small program of 3-8 differentiable ops (pointwise, reductions,
matmuls, views, indexing, in-place writes into intermediates, complex detours) wrapped in 2-4
transforms (``vmap`` with drawn ``in_dims``/``out_dims``/``chunk_size``, ``grad``, ``vjp``,
``jvp``, ``jacrev``, ``jacfwd``, ``hessian``, ``linearize``), with arguments of the right shapes.
``stack.build(lib)`` returns the transformed function written against ``lib``, any module with
the functorch API (``functransforms`` or the reference), so two libraries run the same stack on
the same arguments and a differential test compares them.

Every program is valid for its shapes by construction: each op is drawn among those that run on
the sample values (an op that raises or makes non-finite values is redrawn). The transforms'
options are drawn freely, so a stack may be one that both libraries refuse (an ``out_dims``
beyond the output's dims, ``jacfwd`` of a complex input): a differential test compares errors too.

Example:
    >>> import torch.func
    >>> import functransforms as ft
    >>> from hypothesis import given, settings
    >>> from functransforms.testing import stacks
    >>> @settings(max_examples=3, derandomize=True, deadline=None)
    ... @given(stacks.stacks(max_depth=2))
    ... def test_agrees(stack):                 # e.g. vmap(grad(program))(x: [B, 2], y: [2])
    ...     try:
    ...         expected = stack.build(torch.func)(*stack.args())
    ...     except Exception:                   # refused by torch.func: compare errors instead
    ...         return
    ...     torch.testing.assert_close(stack.build(ft)(*stack.args()), expected)
    >>> test_agrees()
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from hypothesis import strategies as st

from .. import _compat

D = torch.float64


def probe(t, shift=0.0):
    """A fixed tensor of ``t``'s (logical) shape and dtype, the same whatever the level: used
    as tangents, cotangents and weights, so both libraries see identical constants."""
    n = t.numel()
    p = (torch.arange(n, dtype=D) * 0.37 + 0.3 + shift).sin().reshape(t.shape)
    return torch.complex(p, p.cos()).to(t.dtype) if t.dtype.is_complex else p.to(t.dtype)


def _bshape(s, t):
    try:
        return tuple(torch.broadcast_shapes(s, t))
    except RuntimeError:
        return None


# -- the ops: name -> apply(h, x, y, *params) --------------------------------------------------
UNARY = {
    "sin": torch.sin,
    "cos": torch.cos,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "exp_tanh": lambda h: torch.exp(torch.tanh(h)),
    "log1p_sq": lambda h: torch.log1p(h * h),
    "sqrt": lambda h: torch.sqrt(h * h + 1),
    "rsqrt": lambda h: torch.rsqrt(h * h + 1),
    "square": lambda h: h.pow(2),
    "recip": lambda h: (h * h + 1).reciprocal(),
    "erf": torch.erf,
    "softplus": F.softplus,
    "atan": torch.atan,
    "gelu": F.gelu,
    "clamp": lambda h: h.clamp(-1.0, 1.0),
    "abs_mul": lambda h: h.abs() * h,
}

BINARY = {
    "add": torch.add,
    "sub": torch.sub,
    "mul": torch.mul,
    "div": lambda a, b: a / (b * b + 1),
    "atan2": torch.atan2,
    "maximum": torch.maximum,
    "hypot": lambda a, b: torch.hypot(a, b + 2),
    "pow": lambda a, b: (a * a + 0.5).pow(b.tanh()),
}


def _operand(h, x, y, which, const):
    if which == "x":
        return x
    if which == "y":
        return y
    if which == "xsum":
        return x.sum()
    if which == "const":
        return const
    return h.flip(-1) if h.dim() else h  # "self"


def _binary(h, x, y, name, which, const, swap):
    o = _operand(h, x, y, which, const)
    a, b = (o, h) if swap else (h, o)
    return BINARY[name](a, b)


def _where(h, x, y, which, const):
    o = _operand(h, x, y, which, const)
    return torch.where(o > 0, h, (h * o).sin())


def _reduce(h, x, y, name, dim, keepdim):
    if name == "sum":
        return h.sum(dim, keepdim=keepdim)
    if name == "mean":
        return h.mean(dim, keepdim=keepdim)
    if name == "prod":
        return h.prod(dim, keepdim=keepdim)
    if name == "amax":
        return h.amax(dim, keepdim=keepdim)
    if name == "max":
        return h.max(dim, keepdim=keepdim).values
    if name == "std":
        return h.std(dim, keepdim=keepdim)
    if name == "var":
        return h.var(dim, keepdim=keepdim, correction=0)
    if name == "norm":
        return torch.linalg.vector_norm(h, dim=dim, keepdim=keepdim)
    if name == "logsumexp":
        return torch.logsumexp(h, dim, keepdim=keepdim)
    raise AssertionError(name)


def _full_reduce(h, x, y, name):
    return {"sum": h.sum, "mean": h.mean, "norm": h.norm, "amax": h.amax}[name]()


def _along(h, x, y, name, dim, k):
    if name == "softmax":
        return h.softmax(dim)
    if name == "log_softmax":
        return h.log_softmax(dim)
    if name == "cumsum":
        return h.cumsum(dim)
    if name == "cumprod":
        return h.cumprod(dim)
    if name == "sort":
        return h.sort(dim, descending=k % 2 == 1).values
    if name == "topk":
        return h.topk(k, dim).values
    if name == "flip":
        return h.flip(dim)
    if name == "unbind_sum":
        return sum(h.unbind(dim))
    if name == "split_rev":
        return torch.cat(list(reversed(h.split(k, dim))), dim)
    if name == "cat":
        return torch.cat([h, h.cos()], dim)
    if name == "stack":
        return torch.stack([h, h * 2], dim)
    if name == "unsqueeze":
        return h.unsqueeze(dim)
    if name == "squeeze":
        return h.squeeze(dim)
    if name == "expand":
        u = h.unsqueeze(dim)
        shape = list(u.shape)
        shape[dim] = k
        return u.expand(shape) * 1.0
    if name == "narrow":
        return h.narrow(dim, k, 1 if h.shape[dim] - k < 2 else 2)
    if name == "select":
        return h.select(dim, k)
    raise AssertionError(name)


def _matmul(h, x, y, name, const):
    if name == "const":
        return h @ const
    if name == "self":
        return h @ h.mT
    if name == "einsum":
        return torch.einsum("...ij,...kj->...ik", h, h.cos())
    if name == "bmm":
        return torch.bmm(h, h.transpose(1, 2).sin())
    if name == "x":
        return h @ x.mT
    if name == "dot":
        return h @ h.cos()
    raise AssertionError(name)


def _view(h, x, y, name, arg):
    if name == "flatten":
        return h.reshape(-1)
    if name == "view":
        return h.view(arg)
    if name == "reshape":
        return h.mT.reshape(arg)
    if name == "transpose":
        return h.transpose(*arg)
    if name == "permute":
        return h.permute(arg)
    if name == "diagonal":
        return h.diagonal(0, *arg)
    if name == "squeeze_all":
        return h.squeeze()
    raise AssertionError(name)


def _index(h, x, y, name, dim, idx):
    if name == "index":  # advanced indexing with a tensor in dim
        return h[(slice(None),) * dim + (idx,)]
    if name == "index_select":
        return h.index_select(dim, idx)
    if name == "gather":
        return h.gather(dim, idx)
    if name == "scatter_add":
        return torch.zeros_like(h).scatter_add(dim, idx, h.sin())
    if name == "index_add":
        return h.index_add(dim, idx, h.index_select(dim, idx).cos())
    raise AssertionError(name)


def _inplace(h, x, y, name, dim, k, idx, which, const):
    if name == "add_":
        h2 = h.clone()
        return h2.add_(_operand(h, x, y, which, const))
    if name == "mul_":  # in place on an intermediate, no clone
        h2 = h.sin()
        return h2.mul_(_operand(h, x, y, which, const))
    if name == "index_put_":
        h2 = h.clone()
        h2[idx] = h[idx].cos()
        return h2
    if name == "index_put_acc":
        h2 = h * 1.0
        return h2.index_put_((idx,), h[idx].sin(), accumulate=True)
    if name == "copy_slice":
        h2 = h.clone()
        h2.narrow(dim, 0, k).copy_(h.narrow(dim, h.shape[dim] - k, k).tanh())
        return h2
    if name == "select_mul_":
        h2 = h * 1.0
        h2.select(dim, k).mul_(3.0)
        return h2
    if name == "view_add_":
        h2 = h.clone()
        h2.view(-1).add_(1.5)
        return h2
    raise AssertionError(name)


def _complex(h, x, y, name):
    c = torch.view_as_complex(torch.stack([h, h.cos()], -1))
    if name == "abs":
        return c.abs()
    if name == "angle":
        return c.angle()
    if name == "mul_real":
        return (c * c.exp()).real
    if name == "conj_imag":
        return (c.conj() * c.sin()).imag
    if name == "polar":
        return torch.polar(h.abs() + 1, h).real
    raise AssertionError(name)


def _extra(h, x, y, name, dim, k, const):
    """Ops research code reaches for beyond the basic families."""
    if name == "linear":
        return F.linear(h, const.mT, const[0])
    if name == "layer_norm":
        return F.layer_norm(h, h.shape[-1:])
    if name == "normalize":
        return F.normalize(h, dim=dim)
    if name == "tril":
        return h.tril(k - 1)
    if name == "roll":
        return h.roll(k, dim)
    if name == "repeat":
        return h.repeat(*([1] * (h.dim() - 1)), 2) if h.dim() else h.repeat(2)
    if name == "masked_fill":
        return h.masked_fill(h < 0, 0.5)
    if name == "lerp":
        return torch.lerp(h, h.cos(), 0.3)
    if name == "addcmul":
        return torch.addcmul(h, h.sin(), h.cos(), value=0.5)
    if name == "logcumsumexp":
        return torch.logcumsumexp(h, dim)
    if name == "cummax":
        return h.cummax(dim).values
    if name == "kthvalue":
        return h.kthvalue(k + 1, dim).values
    if name == "median":
        return h.median(dim).values
    if name == "var_mean":
        v, m = torch.var_mean(h, dim, keepdim=True)
        return v + m
    if name == "diag_embed":
        return torch.diag_embed(h)
    if name == "trace":
        return torch.trace(h)
    if name == "outer":
        return torch.outer(h, h.cos())
    if name == "cdist":
        return torch.cdist(h, h.cos() + 0.5)
    if name == "cross_entropy":
        return F.cross_entropy(h, torch.arange(h.shape[0]) % h.shape[-1])
    if name == "index_fill":
        return h.index_fill(dim, torch.tensor([k]), -1.0)
    if name == "masked_fill_":
        h2 = h.exp()
        return h2.masked_fill_(h > 0.5, 2.0)
    if name == "clamp_":
        return (h * 2).clamp_(min=-1.0)
    if name == "index_copy_":
        h2 = h.clone()
        return h2.index_copy_(dim, torch.tensor([k]), h.narrow(dim, 0, 1).sin())
    if name == "scatter_":
        h2 = h.clone()
        return h2.scatter_(dim, torch.zeros_like(h, dtype=torch.long)[..., :1], h[..., :1].cos())
    if name == "mask_setitem":
        h2 = h.clone()
        h2[h > 0] = 0.0
        return h2 * h
    if name == "slice_iadd":
        h2 = h.clone()
        h2[..., 1:] += h[..., :-1].sin()
        return h2
    if name == "unsqueeze_":
        h2 = h.clone()
        return h2.unsqueeze_(dim)
    if name == "t_":
        h2 = h * 1.0
        return h2.t_()
    if name == "as_strided":
        return h.contiguous().as_strided((h.numel() - 1,), (1,))
    if name == "unfold":
        return h.unfold(dim, 2, 1)
    if name == "movedim":
        return h.movedim(dim, 0)
    if name == "einsum_outer":
        return torch.einsum("i,j->ij", h.reshape(-1), const[:, 0])
    raise AssertionError(name)


# not drawn: "layer_norm" (torch's own second derivatives of it are wrong, in functorch and
# plain autograd alike, so neither oracle can judge a stack holding it; ours match finite
# differences: tests/testing/test_fuzz_stacks.py)
EXTRA = (
    "linear normalize tril roll repeat masked_fill lerp addcmul logcumsumexp cummax "
    "kthvalue median var_mean diag_embed trace outer cdist cross_entropy index_fill masked_fill_ "
    "clamp_ index_copy_ scatter_ mask_setitem slice_iadd unsqueeze_ t_ as_strided unfold movedim "
    "einsum_outer"
).split()


APPLY = {
    "extra": _extra,
    "unary": lambda h, x, y, name: UNARY[name](h),
    "binary": _binary,
    "where": _where,
    "reduce": _reduce,
    "full_reduce": _full_reduce,
    "along": _along,
    "matmul": _matmul,
    "view": _view,
    "index": _index,
    "inplace": _inplace,
    "complex": _complex,
}


@dataclasses.dataclass
class Step:
    family: str
    params: tuple

    def __call__(self, h, x, y):
        return APPLY[self.family](h, x, y, *self.params)

    def __repr__(self):
        shown = [
            f"<{tuple(p.shape)}>" if isinstance(p, torch.Tensor) and p.dtype == D else repr(p)
            for p in self.params
        ]
        return f"{self.family}({', '.join(shown)})"


@dataclasses.dataclass
class Program:
    """``h = x; for step in steps: h = step(h, x, y); return h`` (``y`` a second input or a
    module parameter)."""

    steps: list

    def __call__(self, x, y):
        h = x
        for step in self.steps:
            h = step(h, x, y)
        return h

    def __repr__(self):
        return " -> ".join(map(repr, self.steps))


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _rand(shape, seed, dtype=D):
    return torch.randn(shape, generator=_gen(seed), dtype=dtype)


@st.composite
def _step(draw, h, x, y):
    """One step valid for the current value ``h`` (shape ``h.shape``)."""
    r, s = h.dim(), tuple(h.shape)
    dims = list(range(-r, r)) if r else [0, -1]
    fam = draw(
        st.sampled_from(
            ["unary", "binary", "binary", "where", "reduce", "full_reduce", "along", "along"]
            + ["matmul", "view", "index", "inplace", "inplace", "complex", "extra", "extra"]
        )
    )
    seed = draw(st.integers(0, 2**16))
    if fam == "extra":
        dim = draw(st.sampled_from(dims))
        size = s[dim] if r else 1
        k = draw(st.integers(0, max(size - 1, 0)))
        const = _rand((s[-1] if r else 1, draw(st.integers(1, 3))), seed, h.dtype)
        return Step(fam, (draw(st.sampled_from(EXTRA)), dim, k, const))
    if fam == "unary":
        return Step(fam, (draw(st.sampled_from(sorted(UNARY))),))
    if fam in ("binary", "where", "inplace"):
        which = draw(st.sampled_from(["x", "y", "xsum", "const", "self"]))
        cshape = tuple(draw(st.sampled_from([1, n])) for n in s[draw(st.integers(0, r)) :])
        const = _rand(cshape, seed)
        if fam == "binary":
            name = draw(st.sampled_from(sorted(BINARY)))
            return Step(fam, (name, which, const, draw(st.booleans())))
        if fam == "where":
            return Step(fam, (which, const))
        name = draw(
            st.sampled_from(
                ["add_", "mul_", "index_put_", "index_put_acc", "copy_slice", "select_mul_"]
                + ["view_add_"]
            )
        )
        dim = draw(st.sampled_from(dims))
        size = s[dim] if r else 1
        k = draw(st.integers(0, max(size - 1, 0)))
        if name == "copy_slice":
            k = max(k, 1)
        top = s[0] - 1 if r else 0
        idx = torch.tensor(draw(st.lists(st.integers(0, top), min_size=1, max_size=3)))
        if name == "index_put_":  # distinct indices: a plain write with duplicates is racy
            idx = idx.unique()
        return Step(fam, (name, dim, k, idx, which, const))
    if fam == "reduce":
        name = draw(
            st.sampled_from(
                ["sum", "mean", "prod", "amax", "max", "std", "var", "norm", "logsumexp"]
            )
        )
        if r >= 2 and name in ("sum", "mean", "norm", "logsumexp", "var") and draw(st.booleans()):
            dim = tuple(draw(st.permutations(dims[r:]))[:2])
        else:
            dim = draw(st.sampled_from(dims))
        return Step(fam, (name, dim, draw(st.booleans())))
    if fam == "full_reduce":
        return Step(fam, (draw(st.sampled_from(["sum", "mean", "norm", "amax"])),))
    if fam == "along":
        name = draw(
            st.sampled_from(
                ["softmax", "log_softmax", "cumsum", "cumprod", "sort", "topk", "flip"]
                + ["unbind_sum", "split_rev", "cat", "stack", "unsqueeze", "squeeze", "expand"]
                + ["narrow", "select"]
            )
        )
        if name in ("stack", "unsqueeze", "expand"):
            dim = draw(st.integers(-r - 1, r))
        else:
            dim = draw(st.sampled_from(dims))
        size = s[dim] if -r <= dim < r else 1
        k = draw(st.integers(1, 3)) if name in ("expand", "split_rev") else 0
        if name in ("topk",):
            k = draw(st.integers(1, max(size, 1)))
        elif name in ("narrow", "select", "sort"):
            k = draw(st.integers(0, max(size - 1, 0)))
        return Step(fam, (name, dim, k))
    if fam == "matmul":
        name = draw(st.sampled_from(["const", "self", "einsum", "bmm", "x", "dot"]))
        const = _rand((s[-1] if r else 1, draw(st.integers(1, 3))), seed, h.dtype)
        return Step(fam, (name, const))
    if fam == "view":
        name = draw(
            st.sampled_from(
                ["flatten", "view", "reshape", "transpose", "permute", "diagonal", "squeeze_all"]
            )
        )
        arg = None
        if name in ("view", "reshape"):
            n = h.numel()
            a = draw(st.sampled_from([d for d in range(1, n + 1) if n % d == 0]))
            arg = draw(st.sampled_from([(a, n // a), (n // a, 1, a), (-1, a), (n,)]))
        elif name in ("transpose", "diagonal"):
            arg = (draw(st.sampled_from(dims)), draw(st.sampled_from(dims)))
        elif name == "permute":
            arg = tuple(draw(st.permutations(range(r))))
            if draw(st.booleans()):
                arg = tuple(a - r for a in arg)
        return Step(fam, (name, arg))
    if fam == "index":
        name = draw(st.sampled_from(["index", "index_select", "gather", "scatter_add"]))
        name = draw(st.sampled_from([name, "index_add"]))
        dim = draw(st.integers(0, max(r - 1, 0)))
        size = s[dim] if r else 1
        if name in ("gather", "scatter_add"):
            shape = list(s)
            if name == "gather" and r:
                shape[dim] = draw(st.integers(1, 3))
            idx = torch.randint(0, size, tuple(shape), generator=_gen(seed))
        else:
            idx = torch.tensor(
                draw(st.lists(st.integers(0, max(size - 1, 0)), min_size=1, max_size=3))
            )
        return Step(fam, (name, dim, idx))
    return Step(fam, (draw(st.sampled_from(["abs", "angle", "mul_real", "conj_imag", "polar"])),))


@st.composite
def programs(draw, x, y, min_steps=3, max_steps=8, max_numel=24):
    """A :class:`Program` of ``min_steps..max_steps`` steps valid for inputs shaped like the
    sample tensors ``x`` and ``y``; every intermediate has at most ``max_numel`` elements."""
    n = draw(st.integers(min_steps, max_steps))
    steps, h = [], x
    while len(steps) < n:
        for _ in range(20):
            step = draw(_step(h, x, y))
            try:
                out = step(h, x, y)
            except (RuntimeError, IndexError, ValueError, TypeError):
                continue
            fits = out.dtype in (D, x.dtype) and 0 < out.numel() <= max_numel
            if fits and bool(out.isfinite().all()):
                if out.abs().max() < 1e4 if out.numel() else True:
                    break
        else:
            break
        steps.append(step)
        h = out
    return Program(steps)


# -- stacks of transforms ----------------------------------------------------------------------
def _leaves(tree):
    return _compat.torch_pytree.tree_leaves(tree)


def _tree_map(fn, tree):
    return _compat.torch_pytree.tree_map(fn, tree)


def scalarize(out):
    """A real scalar of every leaf of ``out``, weighted by :func:`probe`."""
    total = sum((leaf * probe(leaf, 0.5)).sum() for leaf in _leaves(out))
    return total.real - 0.7 * total.imag if total.is_complex() else total


@dataclasses.dataclass
class Layer:
    kind: str  # vmap grad vjp jvp jacrev jacfwd hessian linearize
    opts: dict

    def wrap(self, lib, f):
        k, o = self.kind, self.opts
        if k == "vmap":
            return lib.vmap(f, in_dims=o["in_dims"], out_dims=o["out_dims"], chunk_size=o["chunk"])
        if k == "grad":
            if o["has_aux"]:
                return lib.grad(
                    lambda *a: (lambda out: (scalarize(out), out))(f(*a)),
                    argnums=o["argnums"],
                    has_aux=True,
                )
            return lib.grad(lambda *a: scalarize(f(*a)), argnums=o["argnums"])
        if k == "jacrev" and o.get("chunk"):
            return lib.jacrev(f, argnums=o["argnums"], chunk_size=o["chunk"])
        if k in ("jacrev", "jacfwd"):
            return getattr(lib, k)(f, argnums=o["argnums"])
        if k == "hessian":
            return lib.hessian(lambda *a: scalarize(f(*a)), argnums=o["argnums"])
        derived = o["derived"]

        def tangents(args):
            return _tree_map(lambda a: a.cos() if derived else probe(a, 0.2), args)

        if k == "vjp":

            def g(*args):
                out, fn = lib.vjp(f, *args)
                ct = _tree_map(lambda t: t.sin() if derived else probe(t, 0.1), out)
                return (out, fn(ct)) if o["with_out"] else fn(ct)

            return g
        if k == "jvp":
            return lambda *args: lib.jvp(f, args, tangents(args))
        if k == "linearize":

            def g(*args):
                out, fn = lib.linearize(f, *args)
                return fn(*tangents(args))

            return g
        raise AssertionError(k)

    def __repr__(self):
        return f"{self.kind}({', '.join(f'{k}={v!r}' for k, v in self.opts.items())})"


class _Tiny(torch.nn.Module):
    def __init__(self, program, w):
        super().__init__()
        self.program = program
        self.w = torch.nn.Parameter(w.clone())

    def forward(self, x):
        return self.program(x, self.w)


@dataclasses.dataclass
class Stack:
    """``layers[0](layers[1](...(program)))`` on ``args``; ``module``: the program is the
    forward of a tiny module whose parameter ``w`` is ``y``, called as
    ``functional_call(module, {"w": w}, (x,))`` with arguments ``(params, x)``."""

    program: Program
    layers: list
    base_args: tuple
    module: bool

    def base(self, lib):
        if self.module:
            mod = _Tiny(self.program, self.base_args[0]["w"].detach())
            return lambda p, x: lib.functional_call(mod, p, (x,))
        return self.program

    def build(self, lib):
        f = self.base(lib)
        for layer in reversed(self.layers):
            f = layer.wrap(lib, f)
        return f

    def args(self):
        """Fresh copies of the arguments (a program cannot leak a write into the next run)."""
        return _tree_map(lambda t: t.clone(), self.base_args)

    def __repr__(self):
        stack = "(".join(map(repr, self.layers))
        shapes = _tree_map(lambda t: tuple(t.shape), self.base_args)
        closing = ")" * (len(self.layers) - 1)
        mod = "module " if self.module else ""
        return f"{stack}({mod}[{self.program!r}]){closing} on {shapes}"


KINDS = ("vmap", "vmap", "grad", "vjp", "jvp", "jacrev", "jacfwd", "hessian", "linearize")


@st.composite
def stacks(draw, min_depth=2, max_depth=4, kinds=KINDS, dtypes=(D, D, D, torch.complex128)):
    """A :class:`Stack`: a drawn program under ``min_depth..max_depth`` drawn transforms, on
    arguments of one of ``dtypes``."""
    xs = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=3)))
    suffix = xs[draw(st.integers(0, len(xs))) :]
    ys = tuple(draw(st.sampled_from([1, n])) for n in suffix)
    if draw(st.integers(0, 4)) == 0:
        ys = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)))
    seed = draw(st.integers(0, 2**16))
    dtype = draw(st.sampled_from(dtypes))
    x, y = _rand(xs, seed, dtype), _rand(ys, seed + 1, dtype)
    program = draw(programs(x, y))
    module = draw(st.integers(0, 3)) == 0
    depth = draw(st.integers(min_depth, max_depth))
    layers, n_jac = [], 0
    for _ in range(depth):
        # at most two Jacobians in a stack (a Hessian is two): each multiplies the work
        kind = draw(st.sampled_from([k for k in kinds if n_jac + _JACS.get(k, 0) <= 2]))
        n_jac += _JACS.get(kind, 0)
        layers.append(kind)
    # arguments: the per-example ones, then a batch dim per vmap from the inside out
    args = ({"w": y}, x) if module else (x, y)
    built = [None] * depth
    for i in reversed(range(depth)):
        kind = layers[i]
        if kind == "vmap":
            size = draw(st.integers(2, 3))
            in_dims, new = [], []
            for j, a in enumerate(args):
                t = a["w"] if isinstance(a, dict) else a
                d = draw(st.sampled_from([None, *range(-t.dim() - 1, t.dim() + 1)]))
                if j == len(args) - 1 and all(v is None for v in in_dims) and d is None:
                    d = 0
                if d is None:
                    in_dims.append(None)
                    new.append(a)
                    continue
                shape = list(t.shape)
                shape.insert(d if d >= 0 else t.dim() + 1 + d, size)
                bt = _rand(tuple(shape), seed + 7 * i + j + 2, dtype)
                if isinstance(a, dict):
                    new.append({"w": bt})
                    in_dims.append({"w": d} if draw(st.booleans()) else d)
                else:
                    new.append(bt)
                    in_dims.append(d)
            args = tuple(new)
            opts = dict(
                in_dims=tuple(in_dims),
                out_dims=draw(st.sampled_from([0, 0, -1, -1, 1])),
                chunk=draw(st.sampled_from([None, None, 1, 2])),
            )
        elif kind in ("grad", "jacrev", "jacfwd", "hessian"):
            opts = dict(argnums=draw(st.sampled_from([0, 1, (0, 1), (1,), -1])))
            if kind == "grad":
                opts["has_aux"] = draw(st.booleans())
            if kind == "jacrev":
                opts["chunk"] = draw(st.sampled_from([None, None, 1, 2]))
        else:
            opts = dict(derived=draw(st.booleans()))
            if kind == "vjp":
                opts["with_out"] = draw(st.booleans())
        built[i] = Layer(kind, opts)
    return Stack(program, built, args, module)


_JACS = {"jacrev": 1, "jacfwd": 1, "hessian": 2}

__all__ = ["Layer", "Program", "Stack", "Step", "probe", "programs", "scalarize", "stacks"]
