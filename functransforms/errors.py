"""The library's own error conditions, and the messages raised with them. Each names the call,
what was expected and what was received, then what to do."""

from __future__ import annotations

from ._core.ops import facts, load_all_families, op_name


class TransformError(RuntimeError):
    """Base class of the errors raised by a transform about how it was used."""


class EscapedTracerError(TransformError):
    """A wrapper tensor was used after the transform that created it returned."""


class DataDependentError(TransformError):
    """A batched value was read as a Python value (``.item()``, ``bool(x)``) under vmap."""


class RandomnessError(TransformError):
    """A random op ran under ``vmap(..., randomness='error')``."""


class InplaceError(TransformError):
    """A transformed value was written in place into a tensor the transform does not see."""


class IllDefinedDerivativeError(TransformError):
    """The function has no derivative at this point because it depends on a quantity the op
    leaves undefined (the phase of complex eigenvectors: Note [Derivatives of eig])."""


class FallbackWarning(UserWarning):
    """vmap ran an op through the per-example loop because it has no batching rule."""


class DenseFallbackWarning(UserWarning):
    """A structured operator had no structured algorithm for a function (solve, logdet,
    cholesky, ...): it was materialized and solved densely, in O(n^3)."""


class JitFallbackWarning(UserWarning):
    """jit runs a call signature eagerly because its trace would not replay faithfully."""


class MissingRuleError(NotImplementedError):
    """An op reached a jvp/vjp level that has no rule for it (nor a decomposition)."""

    def __init__(self, message, path):
        super().__init__(message)
        self.path = path  # the op, then what it decomposed into, down to the one without a rule


# -- the messages, in one place ---------------------------------------------------------------
def describe(value):
    """The user's value as an error message names it: a tensor by its shape and dtype (never by
    the class of a transform's wrapper, which the user did not make: ``GradTensor``,
    ``BatchedTensor``), anything else by its type and a short repr, with the right article
    ("an int (3)", "a str ('s')", "None")."""
    import torch

    if value is None:
        return "None"
    if isinstance(value, torch.Tensor):
        from ._core.metadata import metadata

        if value.is_nested:
            return f"a nested tensor of dtype {value.dtype}"
        shape, _, dtype, _ = metadata(value)
        return f"a tensor of shape {tuple(shape)} and dtype {dtype}"
    name = type(value).__name__
    if isinstance(value, (tuple, list)):  # its items may be wrappers: their repr is internal
        return f"a {name} of length {len(value)}"
    if isinstance(value, dict):
        return f"a {name} with keys {sorted(map(str, value))}"
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    article = "an" if name[:1].lower() in "aeiou" else "a"
    return f"{article} {name} ({text})"


# Each restates the public call (``interp.call``, e.g. ``vmap(f, in_dims=0)(<inputs>)``), then
# expected vs received, then what to do. ``func`` is the ATen op overload.


def missing_rule(func, call, kind, decorator, path=()):
    """The error (returned, to be raised ``from None``) for an op without a ``kind`` ('jvp' /
    'vjp') rule, under ``call``. ``path``: the ops ``func`` decomposed into, down to the one
    without a rule."""
    name = op_name(func)
    if facts(func).written_kwargs:  # an out= variant: torch refuses these under autograd too
        return RuntimeError(
            f"{call}: {name} writes into `out=`, and functions with out= arguments do not "
            "support automatic differentiation (as in torch and PyTorch). Do: drop `out=` "
            "and use the return value."
        )
    # Note [Rule families load on first use] (_core/ops.py): before reporting a missing rule, load
    # every family; a rule found then means the index that names each op's family is stale
    load_all_families()
    if getattr(facts(func), f"{kind}_rule", None) is not None:
        return RuntimeError(
            f"{call}: {name} has a {kind} rule in a family that functransforms/_core/rule_index.py "
            "does not name for it (the index is stale). Do: run `python -m "
            "functransforms._core.rule_index_build --write` (a source checkout) or reinstall."
        )
    via = ""
    if path:
        steps = " -> ".join(op_name(p) for p in path)
        via = f" (it decomposes as {name} -> {steps}, which has none)"
    return MissingRuleError(
        f"{call}: there is no {kind} rule for {name}{via}, so it cannot be differentiated. "
        f"Register one with `@functransforms.autodiff.{decorator}({name})` (signatures in "
        "functransforms/autodiff/_registry.py), or wrap the computation in "
        "`functransforms.custom_vjp` / `custom_jvp`.",
        (func,) + tuple(path),
    )


def raise_random(interp, func):
    raise RandomnessError(
        f"{interp.call}: {op_name(func)} draws random numbers, but vmap was called with "
        "randomness='error' (the default). Expected: no random ops, or an explicit choice. Do: "
        "pass randomness='different' (independent draws per example) or randomness='same' "
        "(one draw shared by the batch)."
    )


def raise_same_with_batched_parameters(interp, func):
    """Note [randomness='same' with batched parameters]: one draw for the whole batch cannot
    follow per-example distribution parameters (a batched mean, probability or rate); PyTorch
    refuses it, and so do we, rather than draw per example and call it 'same'."""
    raise RandomnessError(
        f"{interp.call}: {op_name(func)} draws random numbers from a batched tensor argument "
        "(per-example distribution parameters), but vmap was called with randomness='same' (one "
        "draw shared by the batch). Expected: unbatched parameters under 'same'. Do: pass "
        "randomness='different', or make the parameters the same for every example."
    )


def raise_data_dependent(interp, func):
    raise DataDependentError(
        f"{interp.call}: {op_name(func)} reads a batched tensor as a Python value (`.item()`, "
        "`bool(x)`, `if x > 0:`, `.tolist()`), which has one answer per example. Expected: tensor "
        "code without data-dependent Python control flow. Do: use `torch.where(cond, a, b)` "
        "instead of `if`, or move the check outside vmap."
    )


def raise_dynamic_shape(interp, func, shapes=None):
    """vmap: an op whose output shape depends on the values (``nonzero``, ``unique``)."""
    got = f" (the examples give shapes {sorted(set(shapes))})" if shapes else ""
    raise DataDependentError(
        f"{interp.call}: the output shape of {op_name(func)} depends on the values of each "
        f"example{got}, so the results cannot form one batched tensor. Expected: ops whose "
        "output shape depends only on the input shapes. Do: use a fixed-size form (e.g. "
        "`torch.where(mask, x, 0)` instead of `x[mask]`, `bincount(..., minlength=n)`, "
        "`nonzero` outside vmap), or loop over the examples in Python."
    )


def raise_inplace_out_unbatched(interp, func, key):
    """vmap: an op writes its batched result into an ``out=`` tensor that is not batched."""
    raise InplaceError(
        f"{interp.call}: {op_name(func)} writes its result into `{key}=`, a tensor "
        f"that is not batched, but the result is batched. Expected: an `{key}=` "
        f"tensor that is batched too, or none. Do: drop `{key}=` and use the return "
        "value."
    )


def raise_inplace_unbatched(interp, func):
    """vmap: an in-place op writes a batched value into a tensor that is not batched."""
    raise InplaceError(
        f"{interp.call}: {op_name(func)} writes a batched value in place into a tensor "
        "that is not batched (captured from outside vmap or created inside it). "
        "Expected: the tensor written to is batched too. Do: write out of place "
        "(`y = x + z` instead of `x += z`), or make the target batched, e.g. "
        "`x = x.expand(...).clone()` per example."
    )


def raise_inplace_into_conj(interp, func):
    """vmap: an in-place op writes into the result of ``conj()`` (Note [Lazy conj outputs])."""
    raise InplaceError(
        f"{interp.call}: {op_name(func)} writes in place into the result of `conj()`. torch "
        "writes through a conjugate view into the tensor it came from; under vmap the view is "
        "materialized, so the write could not reach it and the result would differ from "
        "PyTorch. Do: write out of place (`y = x.conj() + 1`), or write into a copy "
        "(`x.conj().clone()`)."
    )


def raise_inplace_into_neg(interp):
    """vmap: something wrote in place into a negative view (``batching/_tensor.py``)."""
    raise InplaceError(
        f"{interp.call}: an in-place op wrote into a negative view (`torch._neg_view(x)`, or "
        "`z.conj().imag`). torch writes through such a view into the tensor it came from; "
        "under vmap the view is materialized, so the write did not reach it and the result "
        "would differ from PyTorch. Do: pass `x.resolve_neg()` (a copy) and return what you "
        "wrote, or write out of place."
    )


def raise_inplace_untracked(interp, func, why):
    """jvp/grad/functionalize: a tracked value is written into a plain tensor that cannot be
    promoted (Note [Writing into a plain tensor]); ``why`` says which condition refused."""
    what = getattr(interp, "tracked_value", "a value that carries derivatives")
    raise InplaceError(
        f"{interp.call}: {op_name(func)} writes {what} in place into a "
        f"tensor that the transform does not track, and {why}. Do: build the result out "
        "of place (torch.stack / torch.cat / torch.where / index_put), or create the "
        "buffer inside the transformed function."
    )


def raise_inplace_view_outside_base(interp, func):
    raise InplaceError(f"{interp.call}: {op_name(func)}: the target view reaches outside its base.")


def raise_batch_norm_stats_unbatched(name):
    """vmap of batch_norm in training mode with running statistics that are not batched."""
    raise InplaceError(
        f"vmap: batch_norm in training mode updates {name} in place, but "
        f"{name} is not batched while the input is, so every example would "
        "write its own statistics into one buffer. Do: pass "
        "running_mean=None and running_var=None (track_running_stats=False; "
        "for a model: functransforms.replace_all_batch_norm_modules_(model)), "
        "or batch the running statistics with the input (in_dims)."
    )


class UnboundAxisError(NameError):
    """A collective (``psum``, ``axis_index``, ...) named an axis that no enclosing ``vmap``/
    ``pmap`` binds (JAX raises ``NameError`` for this too)."""
