"""Composed transforms in the conformance suite: vmap(vjp), jvp(vjp), vmap(jvp) and vjp(vjp)
against torch.func's same composition (and vmap_dims, conformance_vmap_dims.py).

Note [Conformance compositions]
    Users rarely call vjp alone: per-sample gradients and jacrev are ``vmap(vjp)``, Hessian-vector
    products are ``jvp(vjp)`` (forward over reverse), jacfwd and batched directional
    derivatives are ``vmap(jvp)``, and ``jacrev(jacrev)`` / MAML are ``vjp(vjp)``. Each is
    checked on the same OpInfo samples as its inner derivative (float64 and complex128; ops with
    ``supports_autograd`` for a vjp inside, ``supports_forward_ad`` for a jvp inside), against
    torch.func's same composition with the same inputs; classification is Note [Conformance
    suite]'s. ``COMPOSITIONS`` (conformance_harness.py) maps each to its inner transform.

    * ``vmap(vjp)``: ``g(*primals, *cotangents) = vjp(f, *primals)`` then the pullback of the
      cotangents, returning (outputs, input cotangents), vmapped with ``B`` examples. The batch
      elements differ from each other: example ``i`` takes the differentiable inputs of the
      op's ``i``-th draw of the same sample (an independent seed; a generator that does not
      repeat its layout gets example 0 scaled elementwise by ``1 + 0.01 N(0, 1)``), and every
      example has its own random cotangents. Sample 0 runs three cases: primals and cotangents
      batched, primals alone (one cotangent shared: per-sample gradients), cotangents alone
      (one primal: the rows of jacrev); later samples run the first only (run time).
    * ``vmap(jvp)`` (functorch's test_vmapjvpall): ``g(*primals, *tangents) = jvp(f, primals,
      tangents)``, vmapped as vmap(vjp) with tangents in the cotangents' place; sample 0 runs
      primals and tangents batched, then tangents alone (one primal: the columns of jacfwd).
    * ``jvp(vjp)``: ``jvp(g, (*primals, *cotangents), (*tangents, *cotangent_tangents))`` with
      ``g`` returning the input cotangents: the Hessian-vector product when the cotangent
      tangents are zero, plus the derivative of the (linear) pullback in its cotangent.
    * ``vjp(vjp)``: the vjp of the same ``g`` (second-order reverse), pulled back with random
      cotangents shaped like the primals: (input cotangents, their cotangents with respect to
      primals and output cotangents).

    Where torch.func is the one that is wrong, the sample is skipped with the proof, never
    failed: vmap(...) where torch.func.vmap differs from torch.func's own per-example loop and
    ours equals that loop (cdist, p=1); vjp(vjp) where torch.func's result fails the dot-product
    test <c, J t> = <J^T c, t> against torch.func's own jvp of the pullback (J t) and ours passes
    it (linalg.norm at 0: NaN against 0).

    Non-differentiable inputs (indices, masks, ...) are shared by every example: they are
    constants of ``f``.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.utils._pytree as tpt
from conformance_harness import (
    ALLOWED_LOOPS,
    COMPOSITIONS,
    LOOP,
    B,
    Result,
    _call,
    _CatchFallbacks,
    _clone,
    _differentiable_outputs,
    _is_diff,
    _leaves,
    _randn_like,
    _same_layout,
    _seed_of,
    _short,
    _strided,
    classify_exception,
    compare,
    describe,
    full_name,
    grad_dtypes,
    take_samples,
    transform_key,
)
from conformance_references import oracle_op


def _function(op, spec, leaves, sample):
    """(f, diff): the op as a function of its differentiable inputs (positions ``diff``) that
    returns the floating outputs torch differentiates (as run_ad in conformance_harness).
    ``f(*primals, op=...)`` calls another op instead (Note [Conformance references])."""
    diff = [k for k, x in enumerate(leaves) if _is_diff(x) and x.requires_grad]
    consts = [x.detach() if isinstance(x, torch.Tensor) else x for x in leaves]
    process = sample.output_process_fn_grad
    keep = _differentiable_outputs(op, spec, leaves, process)

    def f(*primals, op=op):
        ls = _clone(consts)
        for k, p in zip(diff, primals):
            ls[k] = p
        out = process(_call(op, spec, ls))
        floats = [o for o in tpt.tree_leaves(out) if _is_diff(o)]
        return tuple(o for o, k in zip(floats, keep or [True] * len(floats)) if k)

    return f, diff


def _composed(vjp, f, n):
    """g(*primals, *cotangents) -> (outputs, input cotangents), through the given vjp."""

    def g(*args):
        out, pullback = vjp(f, *args[:n])
        return out, pullback(args[n:])

    return g


def _composed_jvp(jvp, f, n):
    """g(*primals, *tangents) -> (outputs, output tangents), through the given jvp."""

    def g(*args):
        return jvp(f, tuple(args[:n]), tuple(args[n:]))

    return g


def _pullback_only(vjp, f, n):
    def g(*args):
        return vjp(f, *args[:n])[1](args[n:])

    return g


def run_composition(op, transform, kind) -> Result:
    """Note [Conformance compositions]."""
    if transform == "vmap_dims":
        from conformance_vmap_dims import run_vmap_dims

        return run_vmap_dims(op, kind)
    name = full_name(op)
    result = Result(name, transform_key(transform, kind))
    for dtype in grad_dtypes(op, COMPOSITIONS[transform], kind):
        draws = B if transform.startswith("vmap") or transform == "autograd(vmap)" else 1
        gens = [
            take_samples(op, dtype, (name, transform, str(dtype), g), requires_grad=True)
            for g in range(draws)
        ]
        for j, sample in enumerate(gens[0]):
            what = f"sample {j} {describe(sample)}"
            leaves, spec = _leaves(sample)
            if not all(_strided(x) for x in leaves):
                result.skip_sample("sparse input")
                continue
            f, diff = _function(op, spec, leaves, sample)
            ref_f = functools.partial(f, op=oracle_op(op, name, kind))
            if not diff:
                result.skip_sample("no differentiable input")
                continue
            primals = [leaves[k].detach() for k in diff]
            gen = torch.Generator().manual_seed(_seed_of(name, transform, str(dtype), j))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    if COMPOSITIONS[transform] == "vjp":
                        out0 = torch.func.vjp(ref_f, *[p.clone() for p in primals])[0]
                    else:
                        out0 = torch.func.jvp(ref_f, tuple(primals), tuple(primals))[0]
                except Exception:
                    result.skip_sample(f"torch.func.{COMPOSITIONS[transform]} raises")
                    continue
                if not out0:
                    result.skip_sample("no floating output")
                    continue
                if transform in ("vmap(vjp)", "vmap(jvp)"):
                    others = [gens[g][j] if j < len(gens[g]) else None for g in range(1, draws)]
                    _vmap_composed(
                        transform,
                        (f, ref_f),
                        primals,
                        out0,
                        diff,
                        (leaves, spec),
                        others,
                        gen,
                        j,
                        result,
                        what,
                    )
                elif transform == "jvp(vjp)":
                    _jvp_vjp((f, ref_f), primals, out0, gen, result, what)
                elif transform.startswith("autograd("):
                    _autograd_over(transform, (f, ref_f), (name, kind), primals, out0, gen, j,
                                   result, what, (diff, (leaves, spec), gens))  # fmt: skip
                elif transform == "vjp(jvp)":
                    from conformance_vjp_jvp import run_vjp_jvp

                    run_vjp_jvp((f, ref_f), (name, kind), primals, out0, gen, result, what)
                else:
                    _vjp_vjp((f, ref_f), primals, out0, gen, result, what)
    return result


def _autograd_over(transform, fs, key, primals, out0, gen, j, result, what, layout):
    """Note [Conformance of torch autograd over our transforms] (conformance_autograd.py)."""
    import conformance_autograd as ag

    if transform == "autograd(vjp)":
        ag.autograd_vjp(fs, key, primals, out0, gen, result, what)
    elif transform == "autograd(jvp)":
        ag.autograd_jvp(fs, key, primals, out0, gen, result, what)
    else:
        diff, (leaves, spec), gens = layout
        others = [gens[g][j] if j < len(gens[g]) else None for g in range(1, B)]
        examples = _examples(primals, diff, (leaves, spec), others, gen)
        ag.autograd_vmap(fs, primals, out0, examples, gen, j, result, what)


def _examples(primals, diff, layout, others, gen):
    """B lists of differentiable inputs that differ from each other (Note [Conformance
    compositions])."""
    examples = [primals]
    for other in others:
        ol = _leaves(other) if other is not None else None
        if ol is not None and _same_layout(layout, ol):
            examples.append([ol[0][k].detach() for k in diff])
        else:
            examples.append(
                [
                    p * (1 + 0.01 * torch.randn(p.shape, dtype=p.dtype, generator=gen))
                    for p in primals
                ]
            )
    return examples


def _oracle_disagrees_with_its_loop(g, in_dims, args, ours, ref):
    """Whether torch.func.vmap(g) differs from stacking torch.func's g per example while ours
    equals that loop."""
    try:
        rows = [g(*[x if d is None else x[b] for x, d in zip(args(), in_dims)]) for b in range(B)]
    except Exception:
        return False
    loop = tpt.tree_map(lambda *xs: torch.stack(xs), *rows)
    return compare(ours, loop, "loop") is None and compare(ref, loop, "loop") is not None


def _vmap_composed(transform, fs, primals, out0, diff, layout, others, gen, j, result, what):
    """vmap(vjp) (directions: cotangents of the outputs) or vmap(jvp) (tangents of the
    primals), Note [Conformance compositions]."""
    import functransforms as ft

    f, ref_f = fs  # ours differentiate f, the oracle ref_f (Note [Conformance references])
    n = len(primals)
    inner = COMPOSITIONS[transform]
    compose = _composed if inner == "vjp" else _composed_jvp
    ours_g = compose(getattr(ft, inner), f, n)
    ref_g = compose(getattr(torch.func, inner), ref_f, n)
    examples = _examples(primals, diff, layout, others, gen)
    batched_p = [torch.stack([ex[i] for ex in examples]) for i in range(n)]
    like = out0 if inner == "vjp" else primals
    batched_c = [torch.stack([_randn_like(o, gen) for _ in range(B)]) for o in like]
    shared_c = [_randn_like(o, gen) for o in like]
    directions = "cotangents" if inner == "vjp" else "tangents"
    cases = [(f"primals and {directions} batched", 0, 0)]
    if j == 0:
        cases += [] if inner == "jvp" else [("primals batched", 0, None)]
        cases += [(f"{directions} batched", None, 0)]
    for label, pdim, cdim in cases:
        in_dims = (pdim,) * n + (cdim,) * len(like)

        def args(pdim=pdim, cdim=cdim):
            ps = batched_p if pdim == 0 else primals
            cs = batched_c if cdim == 0 else shared_c
            return [x.clone() for x in (*ps, *cs)]

        torch._C._functorch._set_vmap_fallback_warning_enabled(True)
        try:
            with warnings.catch_warnings(record=True) as tf_warned:
                warnings.simplefilter("always")
                ref = torch.func.vmap(ref_g, in_dims=in_dims)(*args())
        except Exception:
            result.skip_sample(f"torch.func.{transform} raises")
            continue
        finally:
            torch._C._functorch._set_vmap_fallback_warning_enabled(False)
        with _CatchFallbacks() as fb:
            try:
                ours = ft.vmap(ours_g, in_dims=in_dims)(*args())
            except Exception as e:
                ours = e
        if isinstance(ours, Exception):
            result.fail(classify_exception(ours), f"{what}, {label}: {_short(ours)}")
            continue
        bad = compare(ours, ref, f"{what}, {label}: {transform}")
        if bad and _oracle_disagrees_with_its_loop(ref_g, in_dims, args, ours, ref):
            # torch.func.vmap(vjp) of cdist with p=1 (torch 2.13 and 2.15) is not its own
            # per-example loop; ours is: the oracle is wrong, nothing to compare
            result.skip_sample(f"torch.func.{transform} differs from its own per-example loop")
            continue
        if bad:
            result.fail(*bad)
            continue
        # Note [No loop where torch.func batches] (conformance_harness.py)
        loops = sorted(op for op in fb.ops() if op not in ALLOWED_LOOPS)
        result.fallback_ops |= set(loops)
        if loops and not any("performance drop" in str(w.message) for w in tf_warned):
            result.fail(LOOP, f"{what}, {label}: {', '.join(loops)}")
            continue
        result.compared += 1


def _jvp_vjp(fs, primals, out0, gen, result, what):
    import functransforms as ft

    f, ref_f = fs  # ours differentiate f, the oracle ref_f (Note [Conformance references])
    n = len(primals)
    cts = [_randn_like(o, gen) for o in out0]
    tangents = [_randn_like(x, gen) for x in (*primals, *cts)]

    def args():
        return tuple(x.clone() for x in (*primals, *cts))

    try:
        ref = torch.func.jvp(_pullback_only(torch.func.vjp, ref_f, n), args(), tuple(tangents))
    except Exception:
        result.skip_sample("torch.func.jvp(vjp) raises")
        return
    try:
        ours = ft.jvp(_pullback_only(ft.vjp, f, n), args(), tuple(tangents))
    except Exception as e:
        result.fail(classify_exception(e), f"{what}: {_short(e)}")
        return
    for part, a, b in zip(("cotangents", "their tangents"), ours, ref):
        bad = compare(tuple(a), tuple(b), f"{what}: jvp(vjp) {part}")
        if bad:
            result.fail(*bad)
            return
    result.compared += 1


def _vjp_vjp(fs, primals, out0, gen, result, what):
    """vjp of the pullback ``(primals, cotangents) -> input cotangents``: second-order reverse
    (jacrev(jacrev), MAML), with random cotangents for the input cotangents."""
    import functransforms as ft

    f, ref_f = fs  # ours differentiate f, the oracle ref_f (Note [Conformance references])
    n = len(primals)
    cts = [_randn_like(o, gen) for o in out0]
    cts2 = tuple(_randn_like(x, gen) for x in primals)

    def args():
        return tuple(x.clone() for x in (*primals, *cts))

    ref_g = _pullback_only(torch.func.vjp, ref_f, n)
    try:
        ref_out, ref_fn = torch.func.vjp(ref_g, *args())
        ref = (ref_out, ref_fn(cts2))
    except Exception:
        result.skip_sample("torch.func.vjp(vjp) raises")
        return
    try:
        out, fn = ft.vjp(_pullback_only(ft.vjp, f, n), *args())
        ours = (out, fn(cts2))
    except Exception as e:
        result.fail(classify_exception(e), f"{what}: {_short(e)}")
        return
    for part, a, b in zip(("cotangents", "their cotangents"), ours, ref):
        bad = compare(tuple(a), tuple(b), f"{what}: vjp(vjp) {part}")
        if bad and _oracle_not_its_transpose(ref_g, args(), cts2, ours[1], ref[1], gen):
            # torch.func.vjp(vjp) of linalg.norm at 0 is NaN where its own jvp(vjp) is 0
            # (torch 2.13 and 2.15); ours is the transpose of that jvp(vjp)
            result.skip_sample("torch.func.vjp(vjp) is not the transpose of its jvp(vjp)")
            return
        if bad:
            result.fail(*bad)
            return
    result.compared += 1


def _inner(u, v):
    """The real inner product of two lists of tensors, Re sum(conj(u) v)."""
    return sum(float((a.conj() * b).real.sum()) for a, b in zip(u, v))


def _oracle_not_its_transpose(ref_g, args, cts2, ours, ref, gen):
    """Whether ours passes the dot-product test <c, J t> = <J^T c, t> against torch.func's jvp
    of the same pullback ``ref_g`` (J t) and torch.func.vjp(vjp) (``ref``, J^T c) does not."""
    tangents = tuple(_randn_like(x, gen) for x in args)
    try:
        jt = torch.func.jvp(ref_g, args, tangents)[1]
    except Exception:
        return False
    lhs = _inner(cts2, jt)

    def ok(cot):
        rhs = _inner(cot, tangents)
        return abs(lhs - rhs) <= 1e-6 * (1 + abs(lhs))  # NaN: not ok

    return ok(ours) and not ok(ref)
