"""torch.autograd over our transforms in the conformance suite: autograd(vjp), autograd(vmap),
autograd(jvp).

Note [Conformance of torch autograd over our transforms]
    MAML, learned optimizers, hypernetworks and implicit layers differentiate what a transform
    returns with torch's own autograd: the inputs are plain tensors that require grad, and
    ``torch.autograd.grad`` (or ``backward``) runs over the transform's result (Note [Torch
    autograd through our transforms], functransforms/_core/levels.py). Each of the three
    compositions runs on the samples of its inner derivative (float64 and complex128; ops with
    ``supports_autograd``, or ``supports_forward_ad`` for autograd(jvp)); classification is
    Note [Conformance suite]'s, and the outer ``torch.autograd.grad`` takes random
    grad_outputs (``materialize_grads``: an input the result does not depend on gets zeros).

    * ``autograd(vjp)`` (double backward): primals ``x`` and output cotangents ``c`` require
      grad; ours ``out, pullback = ft.vjp(f, *x); g = pullback(c)``, the reference plain
      autograd ``out = f(*x); g = torch.autograd.grad(out, x, c, create_graph=True)``; then
      ``torch.autograd.grad((out, g), (x, c), (w_out, w_g))`` over both, compared with the
      values ``(out, g)``.
    * ``autograd(vmap)``: ``B`` examples (as vmap(vjp)'s, Note [Conformance compositions])
      stacked into inputs that require grad; ``torch.autograd.grad(ft.vmap(f)(*xs), xs, w)``
      against the same through torch.func.vmap. Sample 0 also runs the first input batched
      and the others shared (``in_dims=None``: their gradient sums over the batch).
    * ``autograd(jvp)``: primals and tangents require grad; ``torch.autograd.grad`` of
      ``ft.jvp(f, x, t)`` (outputs and output tangents) with respect to (x, t), against the
      same over torch.func.jvp.

    Where the reference disagrees with ours, it is not trusted blindly:

    * autograd(vjp) and autograd(jvp) decide with finite differences (Note [vjp(jvp) against
      finite differences], conformance_vjp_jvp.py; ``fd_verdict``). autograd(jvp) is the
      identity of vjp(jvp) as it stands. autograd(vjp) is the same identity read for a
      pullback: with ``t = w_g`` (the outer cotangent of ``g``), ``c_out = w_out`` and
      ``c_tan = c``, Re<w_g, D_u [J(x)^T c]> = Re<c, D_u [J(x) w_g]>, so the primals' part is
      Re<w_out, D_u f> + Re<c, D_u [J(x) w_g]> (no tangent directions), and the cotangent's
      gradient is J w_g, checked as the output tangent is.
    * autograd(vmap): against the per-example loop of plain autograd (``f`` on each example,
      stacked, differentiated by torch).

    A sample where ours agrees with the evidence and the reference does not is counted in
    docs/conformance.md ("... reference wrong (ours equals ...)") and not compared; ours
    disagreeing with the evidence is ``wrong value``, with both sides' numbers.
"""

from __future__ import annotations

import warnings

import torch
from conformance_harness import (
    B,
    Result,
    _CatchFallbacks,
    _randn_like,
    _short,
    classify_exception,
    compare,
)


def _outer_grad(outputs, inputs, grad_outputs):
    """torch.autograd.grad over the outputs that require grad (the others contribute 0); zeros
    for inputs nothing depends on."""
    pairs = [(o, w) for o, w in zip(outputs, grad_outputs) if o.requires_grad]
    if not pairs:
        return tuple(torch.zeros_like(x) for x in inputs)
    outs, ws = zip(*pairs)
    return torch.autograd.grad(outs, inputs, ws, allow_unused=True, materialize_grads=True)


def _leaf(x):
    return x.detach().clone().requires_grad_()


# -- autograd(vjp) --------------------------------------------------------------------------


def _double_backward(vjp_of, f, primals, cts, ws):
    """((out, g), (grad_x, grad_c)) of torch.autograd over ``vjp_of(f, x, c) -> (out, g)``."""
    x = [_leaf(p) for p in primals]
    c = [_leaf(t) for t in cts]
    with torch.enable_grad():
        out, g = vjp_of(f, x, c)
        grads = _outer_grad((*out, *g), (*x, *c), ws)
    n = len(x)
    return (tuple(out), tuple(g)), (tuple(grads[:n]), tuple(grads[n:]))


def _ours_vjp(f, x, c):
    import functransforms as ft

    out, pullback = ft.vjp(f, *x)
    return out, pullback(tuple(c))


def _plain_vjp(f, x, c):
    out = f(*x)
    g = torch.autograd.grad(
        [o for o in out], x, c, create_graph=True, allow_unused=True, materialize_grads=True
    )
    return out, g


def autograd_vjp(fs, key, primals, out0, gen, result: Result, what):
    """Note [Conformance of torch autograd over our transforms], autograd(vjp)."""
    f, ref_f = fs
    cts = [_randn_like(o, gen) for o in out0]
    ws = [_randn_like(o, gen) for o in (*out0, *primals)]
    try:
        ref = _double_backward(_plain_vjp, ref_f, primals, cts, ws)
    except Exception:
        result.skip_sample("torch's double backward raises")
        return
    try:
        ours = _double_backward(_ours_vjp, f, primals, cts, ws)
    except Exception as e:
        result.fail(classify_exception(e), f"{what}: {_short(e)}")
        return
    bad = compare(ours[0], ref[0], f"{what}: autograd(vjp) (outputs, cotangents)")
    if bad:
        result.fail(*bad)
        return
    bad = compare(ours[1], ref[1], f"{what}: autograd(vjp) (gradients of x, of c)")
    if bad is None:
        result.compared += 1
        return
    if bad[0] != "wrong value":
        result.fail(*bad)
        return
    n = len(out0)
    # fd_verdict's reading (Note [...]): t = w_g, cotangents (w_out, c); claims: (grad_x, J t)
    claims = [(x[1][0], x[1][1]) for x in (ours, ref)]
    _decide(fs, key, primals, list(ws[n:]), (ws[:n], cts), claims, gen, bad, result, False)


# -- autograd(jvp) --------------------------------------------------------------------------


def autograd_jvp(fs, key, primals, out0, gen, result: Result, what):
    """Note [Conformance of torch autograd over our transforms], autograd(jvp)."""
    from conformance_vjp_jvp import DIRECTIONS

    import functransforms as ft

    f, ref_f = fs
    shape = [*DIRECTIONS.get(key[0], []), *[lambda d: d] * len(primals)][: len(primals)]
    tangents = [p(_randn_like(x, gen)) for p, x in zip(shape, primals)]
    cts = ([_randn_like(o, gen) for o in out0], [_randn_like(o, gen) for o in out0])

    def run(jvp, fn):
        x = [_leaf(p) for p in primals]
        t = [_leaf(p) for p in tangents]
        with torch.enable_grad():
            out, jout = jvp(fn, tuple(x), tuple(t))
            grads = _outer_grad((*out, *jout), (*x, *t), (*cts[0], *cts[1]))
        return (tuple(out), tuple(jout)), tuple(grads)

    try:
        ref = run(torch.func.jvp, ref_f)
    except Exception:
        result.skip_sample("torch.autograd over torch.func.jvp raises")
        return
    try:
        ours = run(ft.jvp, f)
    except Exception as e:
        result.fail(classify_exception(e), f"{what}: {_short(e)}")
        return
    bad = compare(ours[0][0], ref[0][0], f"{what}: autograd(jvp) outputs")
    if bad:
        result.fail(*bad)
        return
    bad = compare(ours[0][1], ref[0][1], f"{what}: autograd(jvp) output tangents") or compare(
        ours[1], ref[1], f"{what}: autograd(jvp) gradients of (x, t)"
    )
    if bad is None:
        result.compared += 1
        return
    if bad[0] != "wrong value":
        result.fail(*bad)
        return
    claims = [(x[1], x[0][1]) for x in (ours, ref)]  # (gradients, output tangents)
    _decide(fs, key, primals, tangents, cts, claims, gen, bad, result, True)


def _decide(fs, key, primals, tangents, cts, claims, gen, bad, result, vary_tangents):
    """Finite differences decide a disagreement (Note [vjp(jvp) against finite differences])."""
    from conformance_vjp_jvp import DIRECTIONS, fd_verdict

    shape = [*DIRECTIONS.get(key[0], []), *[lambda d: d] * len(primals)][: len(primals)]
    try:
        verdict = fd_verdict(fs, primals, tangents, cts, claims, gen, shape, vary_tangents)
    except Exception as e:
        verdict = f"the finite differences raised {_short(e)}"
    if isinstance(verdict, str):
        result.fail("wrong value", f"{bad[1]}; no finite-difference verdict: {verdict}")
        return
    how, rhs, (l_ours, l_ref), (ours_ok, ref_ok) = verdict
    if ours_ok and not ref_ok:
        result.compared += 1
        result.skip_sample(f"{result.transform.split('[')[0]}: reference wrong (ours equals {how})")
        return
    evidence = f"{how} {rhs:.6g}, ours {l_ours:.6g}, reference {l_ref:.6g}"
    hint = "both within the finite differences' tolerance" if ours_ok else "ours is wrong"
    result.fail("wrong value", f"{bad[1]}; {evidence}: {hint}")


# -- autograd(vmap) -------------------------------------------------------------------------


def autograd_vmap(fs, primals, out0, examples, gen, j, result: Result, what):
    """Note [Conformance of torch autograd over our transforms], autograd(vmap)."""
    import functransforms as ft

    f, ref_f = fs
    n = len(primals)
    batched = [torch.stack([ex[i] for ex in examples]) for i in range(n)]
    ws = [torch.stack([_randn_like(o, gen) for _ in range(B)]) for o in out0]
    cases = [("all batched", (0,) * n)]
    if j == 0 and n > 1:
        cases.append(("the first batched, the others shared", (0,) + (None,) * (n - 1)))
    for label, in_dims in cases:

        def run(vmap, fn, in_dims=in_dims):
            xs = [_leaf(b if d == 0 else p) for b, p, d in zip(batched, primals, in_dims)]
            with torch.enable_grad():
                out = vmap(fn, in_dims=in_dims)(*xs)
                return tuple(out), tuple(_outer_grad(out, xs, ws))

        def loop(fn, in_dims):
            def stacked(*xs):
                rows = [
                    fn(*[x if d is None else x[b] for x, d in zip(xs, in_dims)]) for b in range(B)
                ]
                return tuple(torch.stack(o) for o in zip(*rows))

            return stacked

        def reference(vmap):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    return run(vmap, ref_f)
            except Exception:
                return None

        ref, oracle = reference(torch.func.vmap), "torch.func.vmap"
        with _CatchFallbacks() as fb:
            try:
                ours = run(ft.vmap, f)
            except Exception as e:
                ours = e
        result.fallback_ops |= fb.ops()
        if ref is None and isinstance(ours, Exception):
            # a limit of vmap itself (data-dependent control flow, in-place writes into an
            # unbatched buffer, random ops), as the vmap column counts it
            result.skip_sample("torch.autograd over torch.func.vmap raises too")
            continue
        if isinstance(ours, Exception):
            result.fail(classify_exception(ours), f"{what}, {label}: {_short(ours)}")
            continue
        if ref is None:
            ref, oracle = reference(loop), "the per-example loop"
            if ref is None:
                result.skip_sample("torch.autograd over torch.func.vmap and over the loop raise")
                continue
            result.skip_sample("torch.func.vmap raises (compared with the loop only)")
        bad = compare(ours, ref, f"{what}, {label}: autograd(vmap) against {oracle}")
        if bad and bad[0] == "wrong value" and oracle == "torch.func.vmap":
            looped = reference(loop)
            if looped is not None and compare(ours, looped, "") is None:
                # torch.func.vmap is not its own per-example loop; ours is
                result.compared += 1
                result.skip_sample("autograd(vmap): reference wrong (ours equals the loop)")
                continue
            if looped is not None:
                bad = compare(ours, looped, f"{what}, {label}: autograd(vmap) against the loop")
        if bad:
            result.fail(*bad)
            continue
        result.compared += 1
