"""vmap with other in_dims / out_dims than 0, and vmap of vmap, in the conformance suite.

Note [Conformance of in_dims, out_dims and nested vmap]
    The vmap test (conformance_harness.run_vmap) batches every argument at dim 0 and returns
    the batch at dim 0, the one layout where a rule that ignores ``bdim`` still looks right.
    ``vmap_dims`` runs sample 0 of each OpInfo (float64, complex128; ops without floating
    dtypes in int64 / bool) in three layouts, as functorch's test_vmap_exhaustive does:

    * ``in_dims=-1, out_dims=-1``: every tensor argument with its batch dim last;
    * ``in_dims=1``, the first tensor argument unbatched (``None``, when there are several),
      outputs at ``out_dims=1`` (0 for a 0-d output);
    * nested: ``vmap(vmap(f, in_dims=-1), in_dims=0, out_dims=-1)`` with batch sizes 2 (outer)
      and 3 (inner); the last tensor argument (when there are several) varies over the outer
      batch only (``None`` in the inner in_dims), so a level mix-up between the two batches
      shows.

    The oracle is the per-example loop (stacked at the out_dims); torch.func.vmap runs too, as
    in run_vmap: where it raises and ours raises as well the sample is skipped (a limit of
    vmap), where it differs from the loop and ours does not, that is counted (``torch.func.vmap
    disagrees with the loop``), and Note [No loop where torch.func batches] applies. Examples
    differ: ``B`` independent draws of the sample (a generator that does not repeat its layout
    gives example 0 scaled elementwise by ``1 + 0.01 N(0, 1)``), the second outer row of the
    nested case is the first one scaled that way; non-floating tensors are shared copies.
"""

from __future__ import annotations

import warnings

import torch
import torch.utils._pytree as tpt
from conformance_harness import (
    ALLOWED_LOOPS,
    LOOP,
    B,
    Result,
    _call,
    _CatchFallbacks,
    _clone,
    _is_diff,
    _is_tensor,
    _leaves,
    _same_layout,
    _seed_of,
    _short,
    _strided,
    classify_exception,
    compare,
    describe,
    dims_dtypes,
    flat_outputs,
    full_name,
    take_samples,
    transform_key,
)

OUTER = 2  # the outer batch size of the nested case (the inner one is B)


def _scaled(leaves, gen):
    """Floating tensors scaled elementwise by 1 + 0.01 N(0, 1); the rest copied."""
    return [
        x * (1 + 0.01 * torch.randn(x.shape, dtype=x.dtype, generator=gen))
        if _is_diff(x)
        else (x.clone() if _is_tensor(x) else x)
        for x in leaves
    ]


def _draws(op, dtype, name, gen):
    """B examples of sample 0 that differ (Note [Conformance of in_dims, out_dims and nested
    vmap]), or None when the op has no sample."""
    gens = [take_samples(op, dtype, (name, "vmap_dims", str(dtype), g), n=1) for g in range(B)]
    if not gens[0]:
        return None, None, None
    s0 = gens[0][0]
    leaves0, spec = _leaves(s0)
    draws = [leaves0]
    for other in gens[1:]:
        ol = _leaves(other[0]) if other else None
        if ol is not None and _same_layout((leaves0, spec), ol):
            draws.append(ol[0])
        else:
            draws.append(_scaled(leaves0, gen))
    return s0, spec, draws


def _loop(op, spec, per_example, result):
    """The op on each example (flat outputs), or None after counting why it cannot be the
    oracle."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            outs = [flat_outputs(_call(op, spec, _clone(ex))) for ex in per_example]
    except Exception:
        result.skip_sample("the op raises on an example")
        return None
    structs = [tpt.tree_flatten(o) for o in outs]
    if any(not all(_is_tensor(x) for x in leaves) for leaves, _ in structs) or not structs[0][0]:
        result.skip_sample("non-tensor output")
        return None
    if any(not all(_strided(x) for x in leaves) for leaves, _ in structs):
        result.skip_sample("sparse output")
        return None
    if not all(_same_layout(structs[0], s) for s in structs[1:]):
        result.skip_sample("per-example outputs do not stack")
        return None
    return outs


def _stack(outs, dims):
    """Stack per-example flat outputs, output i at dims[i]."""
    if _is_tensor(outs[0]):
        return torch.stack(outs, dims[0])
    return tuple(torch.stack(xs, d) for xs, d in zip(zip(*outs), dims))


def _out_dims(out, want):
    """``want`` per output where it is a valid dim of the stacked output, else 0 (0-d)."""
    leaves = [out] if _is_tensor(out) else list(out)
    return [want if x.dim() >= want else 0 for x in leaves]


def _as_out_dims(out, dims):
    return dims[0] if _is_tensor(out) else tuple(dims)


def run_vmap_dims(op, kind) -> Result:
    """Note [Conformance of in_dims, out_dims and nested vmap]."""
    name = full_name(op)
    result = Result(name, transform_key("vmap_dims", kind))
    for dtype in dims_dtypes(op, kind):
        gen = torch.Generator().manual_seed(_seed_of(name, "vmap_dims", str(dtype)))
        s0, spec, draws = _draws(op, dtype, name, gen)
        if s0 is None:
            continue
        leaves0 = draws[0]
        tpos = [k for k, x in enumerate(leaves0) if _is_tensor(x)]
        if not tpos:
            result.skip_sample("no tensor argument")
            continue
        if not all(_strided(x) for x in leaves0):
            result.skip_sample("sparse input")
            continue
        what = f"sample 0 {describe(s0)}"
        _last(op, spec, tpos, draws, result, what)
        _middle(op, spec, tpos, draws, result, what)
        _nested(op, spec, tpos, [draws, [_scaled(d, gen) for d in draws]], result, what)
    return result


def _last(op, spec, tpos, draws, result, what):
    outs = _loop(op, spec, draws, result)
    if outs is None:
        return
    dims = [-1] * (1 if _is_tensor(outs[0]) else len(outs[0]))
    args = [torch.stack([ex[k] for ex in draws], -1) for k in tpos]
    slices = [[lambda a, b=b: a.select(-1, b)] * len(tpos) for b in range(B)]
    _case(
        op, spec, tpos, draws[0], _stack(outs, dims), args,
        {"in_dims": (-1,) * len(tpos), "out_dims": -1},
        result, f"{what}, in_dims=-1, out_dims=-1",
        (slices, lambda outs: _stack(outs, dims)),
    )  # fmt: skip


def _middle(op, spec, tpos, draws, result, what):
    base = draws[0]
    batched = tpos[1:] if len(tpos) > 1 else tpos
    per_example = [[ex[k] if k in batched else base[k] for k in range(len(base))] for ex in draws]
    outs = _loop(op, spec, per_example, result)
    if outs is None:
        return
    in_dims = tuple((1 if base[k].dim() >= 1 else 0) if k in batched else None for k in tpos)
    args = [
        base[k].clone() if d is None else torch.stack([ex[k] for ex in draws], d)
        for k, d in zip(tpos, in_dims)
    ]
    slices = [
        [(lambda a: a) if d is None else (lambda a, b=b, d=d: a.select(d, b)) for d in in_dims]
        for b in range(B)
    ]
    dims = _out_dims(outs[0], 1)
    _case(
        op, spec, tpos, base, _stack(outs, dims), args,
        {"in_dims": in_dims, "out_dims": _as_out_dims(outs[0], dims)},
        result, f"{what}, in_dims={in_dims}, out_dims={_as_out_dims(outs[0], dims)}",
        (slices, lambda outs: _stack(outs, dims)),
    )  # fmt: skip


def _nested(op, spec, tpos, grid, result, what):
    """grid[i][j]: the example of outer index i < OUTER, inner index j < B."""
    base = grid[0][0]
    inner = tpos[:-1] if len(tpos) > 1 else tpos
    per_example = [
        [row[0][k] if k in tpos and k not in inner else row[j][k] for k in range(len(base))]
        for row in grid
        for j in range(B)
    ]
    outs = _loop(op, spec, per_example, result)
    if outs is None:
        return
    n_out = 1 if _is_tensor(outs[0]) else len(outs[0])

    def expected(outs):
        rows = [outs[i * B : (i + 1) * B] for i in range(OUTER)]
        return _stack([_stack(r, [0] * n_out) for r in rows], [-1] * n_out)

    args = [
        torch.stack(
            [torch.stack([row[j][k] for j in range(B)], -1) if k in inner else row[0][k]
             for row in grid]
        )
        for k in tpos
    ]  # fmt: skip
    slices = [
        [
            (lambda a, i=i, j=j: a[i].select(-1, j)) if k in inner else (lambda a, i=i: a[i])
            for k in tpos
        ]
        for i in range(OUTER)
        for j in range(B)
    ]
    inner_dims = tuple(-1 if k in inner else None for k in tpos)
    _case(
        op, spec, tpos, base, expected(outs), args, None, result,
        f"{what}, vmap(vmap(in_dims={inner_dims}), out_dims=-1)",
        (slices, expected),
        nest=lambda vmap, f: vmap(vmap(f, in_dims=inner_dims), out_dims=-1),
    )  # fmt: skip


def _slice_loop(op, spec, base, tpos, args, slices, stack):
    """The loop over the slices of (a copy of) the batched arguments themselves, not over
    contiguous examples: vmap's definition, which is another value for an op that reads memory
    through strides (as_strided: with the batch dim last, an example's elements are ``B``
    apart). None when it does not run or stack."""
    copy = [a.clone() for a in args]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            outs = []
            for picks in slices:
                leaves = list(base)
                for k, a, pick in zip(tpos, copy, picks):
                    leaves[k] = pick(a)
                outs.append(flat_outputs(_call(op, spec, leaves)))
        return stack(outs)
    except Exception:
        return None


def _case(op, spec, tpos, base, expected, args, dims, result, what, slices, nest=None):
    """Ours and torch.func.vmap against the loop's ``expected`` (as conformance_harness's
    _vmap_case, for any in_dims / out_dims: ``dims``, the vmap keywords, or ``nest``), then
    against the loop over ``slices`` = (per example, a function per tensor argument that takes
    its example's slice of the batched argument; how to stack their outputs), see
    _slice_loop."""
    import functransforms as ft

    def f(*tensors):
        leaves = list(base)
        for k, t in zip(tpos, tensors):
            leaves[k] = t
        return flat_outputs(_call(op, spec, leaves))

    def transformed(vmap):
        return nest(vmap, f) if nest is not None else vmap(f, **dims)

    def fresh():
        return [a.clone() for a in args]

    tf_out = tf_err = None
    torch._C._functorch._set_vmap_fallback_warning_enabled(True)
    try:
        with warnings.catch_warnings(record=True) as tf_warned:
            warnings.simplefilter("always")
            tf_out = transformed(torch.func.vmap)(*fresh())
    except Exception as e:
        tf_err = e
    finally:
        torch._C._functorch._set_vmap_fallback_warning_enabled(False)
    tf_loops = any("performance drop" in str(w.message) for w in tf_warned)
    with _CatchFallbacks() as fb:
        try:
            ours, err = transformed(ft.vmap)(*fresh()), None
        except Exception as e:
            ours, err = None, e
    result.fallback_ops |= fb.ops()
    if err is not None:
        if tf_err is not None:
            result.skip_sample("torch.func.vmap raises too")
        else:
            result.fail(classify_exception(err), f"{what}: {_short(err)}")
        return
    bad = compare(ours, expected, f"{what}: vmap vs loop")
    if bad:
        expected = _slice_loop(op, spec, base, tpos, args, *slices)
        if expected is None or compare(ours, expected, "") is not None:
            result.fail(*bad)
            return
        result.skip_sample("equals the loop over slices of the batched arguments (reads strides)")
    loops = sorted(o for o in fb.ops() if o not in ALLOWED_LOOPS)
    if loops and tf_err is None and not tf_loops:  # Note [No loop where torch.func batches]
        result.fail(LOOP, f"{what}: {', '.join(loops)}")
        return
    result.compared += 1
    if tf_err is not None:
        result.skip_sample("torch.func.vmap raises (compared with the loop only)")
    elif compare(tf_out, expected, "") is not None:
        result.skip_sample("torch.func.vmap disagrees with the loop (ours agrees)")
