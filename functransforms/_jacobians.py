"""Public Jacobian API: jacrev, jacfwd, hessian, built on vjp, jvp and vmap."""

from __future__ import annotations

import functools

import torch

from . import _pytree as pt
from ._ad import (
    _as_primal,
    _bind_inputs,
    _check_jacobian_dtypes,
    _jvp,
    _name,
    _vjp_flat,
)
from ._core.batched_like import batched_like, vmap_levels
from ._typing import ArgNums, Func, Randomness
from .errors import describe


# -- Jacobians --------------------------------------------------------------------------------
def jacrev(
    func: Func,
    argnums: ArgNums = 0,
    *,
    has_aux: bool = False,
    chunk_size: int | None = None,
    _preallocate_and_copy: bool = False,
    holomorphic: bool = False,
    _call: str | None = None,
) -> Func:
    """The Jacobian of ``func`` by reverse mode: one vjp per output element, vmapped.

    Returns, for each output leaf, a tensor of shape ``out.shape + in.shape`` (a tuple over
    ``argnums`` when it is a tuple).

    Example:
        >>> import torch, functransforms as ft
        >>> W = torch.eye(3) * 2
        >>> ft.jacrev(lambda x: W @ x)(torch.ones(3)).shape    # [3, 3]
        torch.Size([3, 3])
    """
    from ._vmap import _vmap_call, check_chunk_size

    check_chunk_size(chunk_size, "jacrev")  # here, as PyTorch, rather than at the call

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        call = _call or f"jacrev({_name(func)}, argnums={argnums!r})"
        f, diff = _bind_inputs(func, argnums, args, kwargs, call, holomorphic)
        flat_out, out_spec, in_spec, pull, aux = _vjp_flat(f, diff, has_aux, call, holomorphic)
        _check_jacobian_dtypes(flat_out, call, holomorphic, "output")
        sizes = [o.numel() for o in flat_out]
        total = sum(sizes)
        o = flat_out[0]
        basis = torch.eye(total, dtype=o.dtype, device=o.device)
        if len(flat_out) == 1:
            cts = [basis if o.dim() == 1 else basis.reshape((total,) + tuple(o.shape))]
        else:
            cts = [
                b.reshape((total,) + tuple(o.shape)).to(o.dtype)
                for b, o in zip(basis.split(sizes, 1), flat_out)
            ]
        # Note [Seeds batched like the output]: functorch's basis is o.new_zeros(...)
        cts = [batched_like(vmap_levels(o), c) for o, c in zip(flat_out, cts)]

        def vjp_fn(*flat_ct):  # flat in, flat out: no pytree round trips per side
            return tuple(pull(flat_ct))

        # jacrev's basis is its own: no outputs to re-register as views of it
        flat_in_jac = _vmap_call(vjp_fn, 0, 0, "error", chunk_size, tuple(cts), {}, views=False)
        per_out = []
        for o, rows in zip(flat_out, _row_splits(sizes)):
            shape = tuple(o.shape)
            leaves = []
            for j in flat_in_jac:
                j = j if len(sizes) == 1 else j[rows]
                jshape = shape + tuple(j.shape[1:])
                leaves.append(j if j.shape == jshape else j.reshape(jshape))
            if holomorphic:
                leaves = [j.conj() for j in leaves]
            tree = pt.tree_unflatten(in_spec, leaves)
            per_out.append(tree if isinstance(argnums, tuple) else tree[0])
        result = pt.tree_unflatten(out_spec, per_out)
        return (result, aux) if has_aux else result

    return wrapper


def _row_splits(sizes):
    start = 0
    for s in sizes:
        yield slice(start, start + s)
        start += s


def jacfwd(
    func: Func,
    argnums: ArgNums = 0,
    has_aux: bool = False,
    *,
    randomness: Randomness = "error",
    holomorphic: bool = False,
    _call: str | None = None,
) -> Func:
    """The Jacobian of ``func`` by forward mode: one jvp per input element, vmapped.

    Example:
        >>> import torch, functransforms as ft
        >>> ft.jacfwd(torch.sin)(torch.zeros(2))         # [2, 2]
        tensor([[1., 0.],
                [0., 1.]])
    """
    from ._vmap import _RANDOMNESS, _vmap_call

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        call = _call or f"jacfwd({_name(func)}, argnums={argnums!r})"
        f, diff = _bind_inputs(func, argnums, args, kwargs, call, holomorphic)
        flat_in, in_spec = pt.tree_flatten(diff)
        flat_in = [_as_primal(x, call, True, i) for i, x in enumerate(flat_in)]
        if not flat_in:  # functorch's class ("Thing passed to transform API must be Tensor")
            raise ValueError(
                f"{call}: expected at least one tensor among the differentiated inputs; got "
                f"{describe(diff if len(diff) > 1 else diff[0])}."
            )
        _check_jacobian_dtypes(flat_in, call, holomorphic, "input")
        sizes = [x.numel() for x in flat_in]
        total = sum(sizes)
        basis = torch.eye(total, dtype=flat_in[0].dtype, device=flat_in[0].device)
        tans = [
            b.reshape((total,) + tuple(x.shape)).to(x.dtype)
            for b, x in zip(basis.split(sizes, 1), flat_in)
        ]
        # Note [Seeds batched like the output]: functorch's basis is x.new_zeros(...)
        tans = [batched_like(vmap_levels(x), t) for x, t in zip(flat_in, tans)]

        def push(*t):
            r = _jvp(f, flat_in, list(t), in_spec, has_aux, call)
            return (r[1], r[2]) if has_aux else r[1]

        if randomness not in _RANDOMNESS:
            raise RuntimeError(
                f"{call}: randomness={randomness!r}: expected one of {_RANDOMNESS}, "
                f"got {randomness!r}."
            )
        # as jacrev: no vmap() wrapper per call, no views-of-inputs pass over its own basis
        pushed = _vmap_call(push, 0, 0, randomness, None, tuple(tans), {}, views=False)
        aux = None
        if has_aux:
            pushed, aux = pushed
            aux = pt.tree_map(lambda a: a[0], aux)
        flat_out, out_spec = pt.tree_flatten(pushed)
        _check_jacobian_dtypes(flat_out, call, holomorphic, "output")
        per_out = []
        for o in flat_out:
            leaves = []
            for x, rows in zip(flat_in, _row_splits(sizes)):
                j = o[rows]  # [n_in, *out]
                j = j.movedim(0, -1).reshape(tuple(o.shape[1:]) + tuple(x.shape))
                leaves.append(j)
            tree = pt.tree_unflatten(in_spec, leaves)
            per_out.append(tree if isinstance(argnums, tuple) else tree[0])
        result = pt.tree_unflatten(out_spec, per_out)
        if has_aux:
            return result, aux
        return result

    return wrapper


def hessian(
    func: Func, argnums: ArgNums = 0, *, has_aux: bool = False, holomorphic: bool = False
) -> Func:
    """The Hessian, as ``jacfwd(jacrev(func, argnums), argnums)``.

    Args:
        func: returns a scalar tensor (or ``(scalar, aux)`` with ``has_aux``).
        argnums: which positional inputs to differentiate (an int or a tuple of ints).
        has_aux: whether ``func`` returns ``(output, aux)``; returns ``(hessian, aux)`` (JAX).
        holomorphic: the complex second derivative of a holomorphic function (JAX).

    Example:
        >>> import torch, functransforms as ft
        >>> ft.hessian(lambda x: (x ** 3).sum())(torch.tensor([1.0, 2.0]))
        tensor([[ 6.,  0.],
                [ 0., 12.]])
    """
    call = f"hessian({_name(func)}, argnums={argnums!r})"
    inner = jacrev(func, argnums, has_aux=has_aux, holomorphic=holomorphic, _call=call)
    return jacfwd(inner, argnums, has_aux=has_aux, holomorphic=holomorphic, _call=call)
