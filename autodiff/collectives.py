"""Derivative rules of the collectives (Note [Collectives are ops], in
functransforms/distributed/_collective_ops.py).

The collectives are linear in their operand except pmax/pmin, so their jvp applies the same
collective to the tangent and their vjp applies the transpose to the cotangent, as in JAX:
psum <-> psum, pmean <-> pmean, all_gather <-> psum_scatter, all_to_all with the split and concat
dims swapped, ppermute with the inverse permutation. Each is rebound through ``bind``, so the
tangent or cotangent is lifted to the binding vmap's level when it does not vary along the axis.
"""

from __future__ import annotations

from functransforms.distributed import _collective_ops as ops
from functransforms.distributed._collectives import bind, by_level, lift

from ._registry import register_jvp_rule, register_vjp_rule


def _inverse(src):
    dst = [-1] * len(src)
    for d, s in enumerate(src):
        if s >= 0:
            dst[s] = d
    return dst


def _call(op, x, axis, *params):  # the cross-process ops take per-process values as they are
    return op(x, axis, *params)


def def_linear_collective(op, transpose, apply=bind):
    """jvp: the op on the tangent; vjp: ``transpose(*params) -> (op, params)`` on the
    cotangent; both through ``apply`` (``bind`` lifts to the binding vmap's level)."""

    @register_jvp_rule(op)
    def jvp(primals, tangents, kwargs):
        x, axis, *params = primals
        t = tangents[0]
        if op is ops.dist_replicate:  # the identity: its tangent is the input's
            return op(x, axis), t
        return op(x, axis, *params), (None if t is None else apply(op, t, axis, *params))

    @register_vjp_rule(op)
    def vjp(cts, primals, kwargs, out, needs):
        _, axis, *params = primals
        t_op, t_params = transpose(*params)
        x_bar = None if cts is None else apply(t_op, cts, axis, *t_params)
        return (x_bar,) + (None,) * (len(primals) - 1)

    return jvp, vjp


def_linear_collective(ops.psum, lambda: (ops.psum, ()))
def_linear_collective(ops.pmean, lambda: (ops.pmean, ()))
def_linear_collective(ops.all_gather, lambda dim: (ops.psum_scatter, (dim,)))
def_linear_collective(ops.psum_scatter, lambda dim: (ops.all_gather, (dim,)))
def_linear_collective(ops.all_to_all, lambda split, concat: (ops.all_to_all, (concat, split)))
def_linear_collective(ops.ppermute, lambda src: (ops.ppermute, (_inverse(src),)))


def def_extremum(op, psum=ops.psum, apply=bind):
    """pmax/pmin: d out = sum over the examples at the extremum of their tangents, shared
    equally among ties (torch's amax convention)."""

    def share(x, out, axis):
        mask = (x == out).to(x.dtype)
        return mask / apply(psum, mask, axis)

    @register_jvp_rule(op)
    def jvp(primals, tangents, kwargs):
        x, axis = primals
        out = op(x, axis)
        t = tangents[0]
        return out, (None if t is None else apply(psum, t * share(x, out, axis), axis))

    @register_vjp_rule(op)
    def vjp(cts, primals, kwargs, out, needs):
        x, axis = primals
        return (None if cts is None else apply(psum, cts, axis) * share(x, out, axis)), None

    return jvp, vjp


def_extremum(ops.pmax)
def_extremum(ops.pmin)

# the cross-process halves of pmap's collectives (Note [pmap's collectives])
def_linear_collective(ops.dist_psum, lambda: (ops.dist_psum, ()), _call)
def_linear_collective(ops.dist_all_gather, lambda d: (ops.dist_psum_scatter, (d,)), _call)
def_linear_collective(ops.dist_psum_scatter, lambda d: (ops.dist_all_gather, (d,)), _call)
def_linear_collective(ops.dist_exchange, lambda d: (ops.dist_exchange, (d,)), _call)
def_linear_collective(
    ops.dist_ppermute, lambda d, src: (ops.dist_ppermute, (d, _inverse(src))), _call
)
def_linear_collective(ops.dist_replicate, lambda: (ops.dist_psum, ()), _call)
def_extremum(ops.dist_pmax, ops.dist_psum, _call)
def_extremum(ops.dist_pmin, ops.dist_psum, _call)


def _psum_many(ts, axis):
    """psum_many of the leaves that are not symbolic zeros (None stays None)."""
    live = [i for i, t in enumerate(ts) if t is not None]
    out = [None] * len(ts)
    if live:
        interp = by_level(axis)
        summed = ops.psum_many([lift(ts[i], interp) for i in live], axis)
        for i, t in zip(live, summed):
            out[i] = t
    return out


@register_jvp_rule(ops.psum_many)
def psum_many_jvp_rule(primals, tangents, kwargs):
    xs, axis = primals
    return ops.psum_many(xs, axis), tuple(_psum_many(list(tangents[0]), axis))


@register_vjp_rule(ops.psum_many)
def psum_many_vjp_rule(cts, primals, kwargs, out, needs):  # psum's transpose is psum
    return _psum_many(list(cts), primals[1]), None
