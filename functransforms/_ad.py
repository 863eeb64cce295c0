"""Public autodiff API: vjp, grad, grad_and_value, value_and_grad, jvp, linearize (jacrev,
jacfwd and hessian: _jacobians.py). Rules live in functransforms.autodiff."""

from __future__ import annotations

import functools
from typing import Any

import torch

from . import _pytree as pt
from ._core.batched_like import batched_like, vmap_levels
from ._core.compiling import eager_under_compile
from ._core.levels import TransformTensor
from ._core.metadata import dtype_of, is_floating, metadata
from ._typing import ArgNums, Func, PyTree
from .errors import describe


def _name(func):
    return getattr(func, "__name__", type(func).__name__)


def _check_callable(func, call):
    """TypeError as functorch's ("'int' object is not callable"), naming the call."""
    if not callable(func):
        raise TypeError(f"{call}: expected func to be a callable; got {type(func).__name__}.")


# -- reverse mode -----------------------------------------------------------------------------
def vjp(func: Func, *primals: PyTree, has_aux: bool = False) -> tuple[Any, ...]:
    """Run ``func(*primals)`` and return its output and a function computing vector-Jacobian
    products.

    Args:
        func: a function of pytrees of tensors returning a pytree of tensors (with ``has_aux``,
            a pair ``(output, aux)``).
        *primals: the inputs.
        has_aux: whether ``func`` returns ``(output, aux)``; aux is returned, not differentiated.

    Returns:
        ``(output, vjp_fn)`` or ``(output, vjp_fn, aux)``; ``vjp_fn(cotangents)`` takes a pytree
        shaped like ``output`` and returns a tuple with one cotangent per primal. It can be
        called many times (and under vmap).

    Example:
        >>> import torch, functransforms as ft
        >>> x = torch.tensor([1.0, 2.0])                 # [2]
        >>> out, vjp_fn = ft.vjp(torch.sin, x)           # out: [2]
        >>> torch.allclose(vjp_fn(torch.ones(2))[0], torch.cos(x))
        True
    """
    _check_callable(func, f"vjp({_name(func)}, ...)")
    return _vjp(func, primals, has_aux, f"vjp({_name(func)}, ...)")


def _resolved(x):
    """The user's value without lazy conj/neg bits (Note [No lazy conjugate inside wrappers])."""
    return x.resolve_conj().resolve_neg() if x.is_conj() or x.is_neg() else x


def _as_primal(x, call, forward, i=0):
    """Differentiated input ``i`` (flattened) as a tensor: Python floats (and complex numbers)
    become 0-d tensors of the default dtype, as in JAX (docs/torch_func_differences.md); integer
    and boolean tensors and other Python values raise, with PyTorch's exception classes."""
    if isinstance(x, torch.Tensor):
        if not isinstance(x, TransformTensor) and x.is_nested:
            _raise_nested(call)
        if is_floating(x):
            return x
        err = ValueError if forward else RuntimeError
        raise err(
            f"{call}: differentiated input {i} (flattened) is {describe(x)}; expected a "
            "floating-point or complex tensor: only floating-point and complex tensors carry "
            "derivatives. Convert it "
            "(`x.double()`) or move it out of the differentiated arguments (argnums)."
        )
    if isinstance(x, (float, complex)) and not isinstance(x, bool):
        return torch.tensor(x, dtype=_default_dtype(x))
    if isinstance(x, int) and not isinstance(x, bool):
        do = (
            f"Pass a float ({float(x)!r}) or a floating-point tensor "
            f"(torch.tensor({float(x)!r})): an integer has no derivative (torch.func refuses "
            "it too)."
        )
    else:
        do = "Pass non-differentiated values through a closure or another argument."
    # functorch's classes: jvp raises RuntimeError ("Expected primals to only contain
    # Tensors"), grad/vjp/jacrev ValueError
    raise (RuntimeError if forward == "jvp" else ValueError)(
        f"{call}: expected the differentiated inputs to be tensors (or Python floats); "
        f"differentiated input {i} (flattened) is {describe(x)}. {do}"
    )


def _raise_nested(call):
    """PyTorch raises for a nested tensor differentiated directly (with an internal
    message); so do we, clearly (Note [Nested tensors under vmap], batching/_nested.py)."""
    raise NotImplementedError(
        f"{call}: a differentiated input is a nested tensor; grad, vjp and jvp "
        "differentiate strided tensors only (PyTorch raises too). Do: differentiate "
        "per component (`[ft.grad(f)(c) for c in x.unbind()]`), or pad it "
        "(`torch.nested.to_padded_tensor(x, 0.0)`)."
    )


def _default_dtype(x):
    dtype = torch.get_default_dtype()
    if isinstance(x, complex):
        return torch.complex128 if dtype == torch.float64 else torch.complex64
    return dtype


def _check_aux(aux, call):
    """PyTorch's contract: aux is a pytree of tensors (it raises for anything else)."""
    for leaf in pt.tree_leaves(aux):
        if not isinstance(leaf, torch.Tensor):
            raise RuntimeError(
                f"{call} with has_aux=True: the aux output contains {describe(leaf)}; "
                "expected a tensor or a pytree of tensors. Return it from the "
                "function some other way (a closure, or a tensor: torch.tensor(value))."
            )


def _split_aux(result, call):
    if not (isinstance(result, tuple) and len(result) == 2):
        raise RuntimeError(
            f"{call} with has_aux=True: expected the function to return a pair (output, aux); "
            f"got {describe(result)}. Do: `return output, aux`, or drop has_aux=True."
        )
    _check_aux(result[1], call)
    return result


def _as_tensor(x):
    """``x`` itself if it is a tensor, else ``torch.as_tensor(x)``: under
    ``torch.set_default_device(d)`` ``as_tensor`` of a tensor copies it to ``d`` (a meta primal
    raised "Cannot copy out of meta tensor", a CPU one moved to the default device)."""
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(x)


@eager_under_compile
def _vjp(func, primals, has_aux, call):
    """vjp, with ``call`` (the public call: grad, jacrev, ...) named in errors."""
    flat_out, out_spec, spec, pull, aux = _vjp_flat(func, primals, has_aux, call)
    name = _name(func)  # the pullback keeps the name, not func (Note [What a pullback keeps])

    def vjp_fn(*cotangents, retain_graph=True, create_graph=None):
        # functorch's keywords: retain_graph is moot (our pullback can always run again);
        # create_graph=False makes the cotangents constants for the enclosing transforms, as
        # functorch's (its outer gradients through them are zero)
        cts = cotangents[0] if len(cotangents) == 1 else cotangents
        flat_ct, ct_spec = pt.tree_flatten(cts)
        if not pt.same_structure(ct_spec, out_spec):
            raise RuntimeError(
                f"vjp_fn(cotangents) of {name}: expected cotangents with the structure of "
                f"the output, {out_spec}; got {ct_spec}."
            )
        flat_in = pull(flat_ct)
        if create_graph is False:
            flat_in = [t.detach() if isinstance(t, torch.Tensor) else t for t in flat_in]
        return tuple(pt.tree_unflatten(spec, flat_in))

    output = pt.tree_unflatten(out_spec, flat_out)
    if has_aux:
        return output, vjp_fn, aux
    return output, vjp_fn


@eager_under_compile
def _vjp_flat(func, primals, has_aux, call, jacobian=None):
    """The body of vjp on flat values: ``(outputs, their structure, the primals' structure,
    pull, aux)``, where ``pull(flat cotangents)`` returns the flat input cotangents (one per
    primal leaf). jacrev calls it directly, which saves a flatten/unflatten per side;
    ``jacobian`` (its ``holomorphic``) checks the input dtypes as jacrev must."""
    from functransforms.autodiff.reverse import (
        GradInterpreter,
        GradTensor,
        Leaf,
        backward,
        wrap_grad,
    )

    flat, spec = pt.tree_flatten(primals)
    if jacobian is not None:
        _check_jacobian_dtypes(flat, call, jacobian, "input")
    flat = [_as_primal(x, call, False, i) for i, x in enumerate(flat)]
    interp = GradInterpreter(call)
    leaves = []
    given = []  # (user's tensor, the primal we wrapped, its wrapper): Note [Writes to primals]
    with interp:  # outputs are read inside: promoted buffers are restored on exit
        wrapped = []
        for x in flat:  # _as_primal: floating tensors only
            leaf = Leaf()
            leaves.append(leaf)
            p = _resolved(x)
            wrapped.append(wrap_grad(p, leaf, 0, interp))
            given.append((x, p, wrapped[-1]))
        result = func(*pt.tree_unflatten(spec, wrapped))
        aux = None
        if has_aux:
            result, aux = _split_aux(result, call)
            aux = _unwrap_level(aux, interp)
        flat_out, out_spec = pt.tree_flatten(result)
        if not flat_out:
            raise RuntimeError(
                f"{call}: expected the function's output to contain at least one tensor; got "
                f"{describe(result)}."
            )
        roots = []
        primals_out = []
        for i, o in enumerate(flat_out):
            if not isinstance(o, torch.Tensor):
                raise RuntimeError(
                    f"{call}: output {i} (flattened) is {describe(o)}; "
                    "expected the function to return tensors (or pytrees of tensors)."
                )
            if isinstance(o, GradTensor) and o._interp is interp:
                roots.append((o._node, o._idx))
                primals_out.append(o._primal)
            else:
                roots.append(None)
                primals_out.append(o)
    _write_back(given, call)
    # (shape, dtype, floating) per output, read once (Note [Reading a wrapper's metadata])
    out_meta = []
    for o in primals_out:
        shape, _, dtype, _ = metadata(o)
        out_meta.append((shape, dtype, dtype.is_floating_point or dtype.is_complex))
    name = _name(func)

    # Note [What a pullback keeps]
    #     ``vjp_fn`` (and linearize's ``jvp_fn``) close over the tape's roots and leaves, the
    #     outputs' metadata and the primals, never over ``func``, the interpreter or the wrappers:
    #     a module or closure passed as ``func`` is freed with its last user reference, and
    #     dropping the results frees every saved tensor by reference counting alone, with no
    #     cycle for the collector to find (tests/core/test_memory_release.py).
    def pull(flat_ct, release=False):
        root_cts = []
        for r, c, (shape, dtype, floating) in zip(roots, flat_ct, out_meta):
            if not isinstance(c, torch.Tensor):
                raise TypeError(
                    f"vjp_fn(cotangents) of {name}: expected tensor cotangents; got "
                    f"{describe(c)}. Pass torch.tensor(...) shaped like the output."
                )
            c_shape, _, c_dtype, _ = metadata(c)
            if c_dtype != dtype and floating:
                if c_dtype.is_complex != dtype.is_complex:
                    raise RuntimeError(
                        f"vjp_fn(cotangents) of {name}: a cotangent has dtype {c_dtype} "
                        f"but the matching output has dtype {dtype}; a complex output needs a "
                        "complex cotangent and a real output a real one (as torch.autograd)."
                    )
                c = c.to(dtype)
            if c_shape != shape:
                raise RuntimeError(
                    f"vjp_fn(cotangents) of {name}: a cotangent has shape "
                    f"{tuple(c_shape)} but the matching output has shape {tuple(shape)}; "
                    "expected equal shapes."
                )
            if r is not None:
                root_cts.append((r[0], r[1], c))
        grads = backward(root_cts, leaves, release)
        # a rule may end in a lazy conjugate (`_mm(b, ct.mH).mH` keeps a column-major input's
        # layout): right values, but torch.view_as_real (Adam on complex parameters) and
        # .numpy() refuse a conj tensor, and functorch's gradients carry no such bit
        return [torch.zeros_like(x) if g is None else _resolved(g) for x, g in zip(flat, grads)]

    return primals_out, out_spec, spec, pull, aux


def _write_back(given, call):
    """Note [Writes to primals]: jvp and grad/vjp are functional inside (an in-place op rebinds
    the wrapper, autodiff/_util.py), so a write into an input would stay inside the transform;
    PyTorch writes through to the caller's tensor, and so do we, once the function has
    returned: each input whose wrapper was rebound gets its final value copied in (an ordinary
    ``copy_``, which outer transforms and torch's autograd see like any other write)."""
    for x, p, w in given:
        new = w._primal
        if new is p:
            continue
        if new.shape != x.shape:
            raise NotImplementedError(
                f"{call}: the function changed the shape of input tensor {tuple(x.shape)} in "
                f"place (to {tuple(new.shape)}, e.g. with `t_()` or `unsqueeze_()`); writing "
                "that back to your tensor is not supported. Do: use the out-of-place op "
                "(`t()`, `unsqueeze()`) and return the result."
            )
        x.copy_(new)


def _unwrap_level(tree, interp):
    from functransforms._core.levels import TransformTensor

    def un(x):
        while isinstance(x, TransformTensor) and x._interp is interp:
            x = getattr(x, "_primal", x)
        return x

    return pt.tree_map(un, tree)


def _check_argnums(func, argnums, n, call):
    nums = argnums if isinstance(argnums, tuple) else (argnums,)
    if not nums:
        raise RuntimeError(
            f"{call}: argnums={argnums!r} is empty; expected an int or a non-empty tuple of ints."
        )
    for a in nums:
        if not isinstance(a, int) or isinstance(a, bool):
            raise RuntimeError(
                f"{call}: expected argnums to be an int or a tuple of ints; got {argnums!r}."
            )
        if not -n <= a < n:
            raise RuntimeError(
                f"{call}: argnums={argnums!r} is out of range: the function was called with {n} "
                f"positional arguments, so expected argnums in [{-n}, {n - 1}]."
            )
    normalized = tuple(a % n for a in nums)
    if len(set(normalized)) != len(normalized):
        raise RuntimeError(
            f"{call}: argnums={argnums!r} names the same input twice (after wrapping negative "
            f"indices: {normalized}); expected distinct inputs."
        )
    return normalized


def _partial(func, args, nums):
    def f(*diff):
        a = list(args)
        for i, d in zip(nums, diff):
            a[i] = d
        return func(*a)

    return f


def _bind_inputs(func, argnums, args, kwargs, call, holomorphic):
    """``(f, diff)``: ``func`` as a function of the inputs ``argnums`` names (the others and
    ``kwargs`` bound), and those inputs; argnums and holomorphic inputs checked."""
    _check_callable(func, call)
    nums = _check_argnums(func, argnums, len(args), call)
    diff = tuple(args[i] for i in nums)
    if holomorphic:
        _check_holomorphic_inputs(diff, call)
    return _partial(lambda *a: func(*a, **kwargs), args, nums), diff


def grad_and_value(
    func: Func, argnums: ArgNums = 0, has_aux: bool = False, *, holomorphic: bool = False
) -> Func:
    """Like :func:`grad`, but returns ``(grad, value)`` (``(grad, (value, aux))`` with aux).

    Example:
        >>> import torch, functransforms as ft
        >>> g, v = ft.grad_and_value(lambda x: (x ** 2).sum())(torch.tensor([1.0, 2.0]))
        >>> g, v
        (tensor([2., 4.]), tensor(5.))
    """
    return _grad_and_value(func, argnums, has_aux, holomorphic, "grad_and_value")


def _grad_and_value(func, argnums, has_aux, holomorphic, transform):
    """grad_and_value, with ``transform`` (the entry point the user called) named in errors."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        call = f"{transform}({_name(func)}, argnums={argnums!r})"
        f, diff = _bind_inputs(func, argnums, args, kwargs, call, holomorphic)
        # flat values (as jacrev): no pytree round trip for the output and the seed
        flat_out, out_spec, spec, pull, aux = _vjp_flat(f, diff, has_aux, call)
        out = flat_out[0] if out_spec.is_leaf() else pt.tree_unflatten(out_spec, flat_out)
        if not isinstance(out, torch.Tensor) or out.dim() != 0:
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else describe(out)
            raise RuntimeError(
                f"{call}(...): expected the function to return a scalar tensor (0-d); got "
                f"{shape}. Use vjp or jacrev for non-scalar outputs (or .sum() / .squeeze())."
            )
        if out.dtype.is_complex and not holomorphic:
            raise RuntimeError(
                f"{call}(...): expected a real scalar output; got {out.dtype}. The gradient of a "
                "complex output is not defined; for the complex derivative of a holomorphic "
                "function pass holomorphic=True, or use vjp / jacrev."
            )
        if holomorphic and not out.dtype.is_complex:
            raise TypeError(
                f"{call} with holomorphic=True: expected a complex output; got {out.dtype}."
            )
        if is_floating(out):
            # a plain seed, not ones_like(out): out may be an outer level's wrapper, and a
            # *_like buffer of one is a constant of that level (Note [Buffers held by
            # kernels]), whose every later op would pass through that level for nothing
            # batched as functorch's ones_like(out) is (Note [Seeds batched like the output])
            seed = torch.ones((), dtype=dtype_of(out), device=out.device)
            seed = batched_like(vmap_levels(out), seed)
            # the only sweep of this graph: it may release what it saved as it goes
            g = tuple(pt.tree_unflatten(spec, pull([seed], release=True)))
            if holomorphic:  # vjp gives conj(f'(z)) for holomorphic f (docs/complex.md)
                g = pt.tree_map(torch.conj_physical, g)
        else:  # an integer output does not depend differentiably on anything (as PyTorch)
            g = pt.tree_map(lambda x: torch.zeros_like(_as_tensor(x)), diff)
        g = g if isinstance(argnums, tuple) else g[0]
        if has_aux:
            return g, (out, aux)
        return g, out

    return wrapper


def _check_holomorphic_inputs(diff, call):
    for leaf in pt.tree_leaves(diff):
        if not (isinstance(leaf, complex) or (torch.is_tensor(leaf) and leaf.dtype.is_complex)):
            got = leaf.dtype if torch.is_tensor(leaf) else type(leaf).__name__
            raise TypeError(
                f"{call} with holomorphic=True: expected complex inputs; got {got}. The complex "
                "derivative needs complex inputs (x.to(torch.complex128)); for real inputs drop "
                "holomorphic=True."
            )


def _check_jacobian_dtypes(leaves, call, holomorphic, what):
    """jacrev/jacfwd as PyTorch: real inputs and outputs only (the Jacobian of a complex map
    is not one complex matrix unless the map is holomorphic); with ``holomorphic=True`` (JAX),
    complex ones only."""
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            continue
        dtype = dtype_of(leaf)  # Note [Reading a wrapper's metadata]
        if dtype.is_complex == holomorphic:
            continue
        if holomorphic:
            raise TypeError(
                f"{call} with holomorphic=True: expected complex {what}s; got {dtype} at "
                f"flattened {what} index {i}. The complex derivative f'(z) needs a complex "
                f"{what}; drop holomorphic=True for real functions."
            )
        raise RuntimeError(
            f"{call}: Expected all {what}s to be real but received a complex tensor at "
            f"flattened {what} idx: {i} (as PyTorch). The Jacobian of a complex function "
            "is not one complex matrix: pass holomorphic=True for the complex derivative of a "
            "holomorphic function, or use vjp / jvp, which follow PyTorch's complex convention "
            "(docs/complex.md)."
        )


def grad(
    func: Func, argnums: ArgNums = 0, has_aux: bool = False, *, holomorphic: bool = False
) -> Func:
    """The gradient of a scalar-valued ``func`` with respect to the inputs at ``argnums``.

    Complex inputs follow PyTorch's convention (docs/complex.md): dL/dx + i dL/dy. With
    ``holomorphic=True`` (JAX's flag), ``func`` maps complex inputs to a complex scalar and the
    result is its complex derivative f'(z).

    Args:
        func: returns a scalar tensor (or ``(scalar, aux)`` with ``has_aux``).
        argnums: an int or a tuple of ints: which positional inputs to differentiate.
        has_aux: whether ``func`` returns ``(output, aux)``.
        holomorphic: differentiate a holomorphic function of complex inputs (as JAX).

    Returns:
        A function returning the gradient (a tuple of them for tuple ``argnums``; with
        ``has_aux``, ``(grad, aux)``), shaped like the inputs.

    Example:
        >>> import torch, functransforms as ft
        >>> x = torch.tensor([0.0, 1.0])                 # [2]
        >>> ft.grad(lambda x: torch.sin(x).sum())(x)     # [2] = cos(x)
        tensor([1.0000, 0.5403])
        >>> z = torch.tensor(1.0 + 2.0j)                 # [] complex
        >>> ft.grad(lambda z: z * z, holomorphic=True)(z)   # f'(z) = 2z
        tensor(2.+4.j)
    """

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        g, v = _grad_and_value(func, argnums, has_aux, holomorphic, "grad")(*args, **kwargs)
        return (g, v[1]) if has_aux else g

    return wrapper


def value_and_grad(
    func: Func, argnums: ArgNums = 0, has_aux: bool = False, *, holomorphic: bool = False
) -> Func:
    """JAX's order: ``(value, grad)``, or ``((value, aux), grad)`` with ``has_aux``.

    Example:
        >>> import torch, functransforms as ft
        >>> ft.value_and_grad(lambda x: (x ** 3).sum())(torch.tensor([2.0]))
        (tensor(8.), tensor([12.]))
    """

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        g, v = _grad_and_value(func, argnums, has_aux, holomorphic, "value_and_grad")(
            *args, **kwargs
        )
        return v, g

    return wrapper


# -- forward mode -----------------------------------------------------------------------------
def jvp(
    func: Func,
    primals: tuple[PyTree, ...],
    tangents: tuple[PyTree, ...],
    *,
    strict: bool = False,
    has_aux: bool = False,
) -> tuple[Any, ...]:
    """Jacobian-vector product: ``(func(*primals), J @ tangents)``.

    Args:
        func: a function of pytrees of tensors.
        primals: a tuple of inputs.
        tangents: a tuple with the structure, shapes and dtypes of ``primals``.
        strict: as PyTorch's: with ``strict=True``, an output that does not depend on the
            primals raises (instead of getting a zero tangent).
        has_aux: whether ``func`` returns ``(output, aux)``.

    Returns:
        ``(output, tangent_out)`` (``(output, tangent_out, aux)`` with aux).

    Example:
        >>> import torch, functransforms as ft
        >>> x, v = torch.tensor([0.0, 1.0]), torch.ones(2)
        >>> ft.jvp(torch.sin, (x,), (v,))[1]             # [2] = cos(x) * v
        tensor([1.0000, 0.5403])
    """
    call = f"jvp({_name(func)}, primals, tangents)"
    _check_callable(func, call)
    if not isinstance(primals, tuple) or not isinstance(tangents, tuple):
        raise RuntimeError(
            f"{call}: expected primals and tangents to be tuples; got {type(primals).__name__} "
            f"and {type(tangents).__name__}."
        )
    flat_p, spec = pt.tree_flatten(primals)
    flat_t, tspec = pt.tree_flatten(tangents)
    if not pt.same_structure(spec, tspec):
        raise RuntimeError(
            f"{call}: expected tangents with the structure of primals, {spec}; got {tspec}."
        )
    flat_p = [_as_primal(p, call, "jvp", i) for i, p in enumerate(flat_p)]
    flat_t = [_number_tangent(t, p) for p, t in zip(flat_p, flat_t)]
    for p, t in zip(flat_p, flat_t):
        if isinstance(p, torch.Tensor) and not isinstance(t, torch.Tensor):
            raise RuntimeError(
                f"{call}: a tangent is {describe(t)}; expected a tensor shaped like its primal "
                f"(shape {tuple(p.shape)})."
            )
        if isinstance(p, torch.Tensor) and t.shape != p.shape:
            raise RuntimeError(
                f"{call}: a tangent has shape {tuple(t.shape)} but its primal has shape "
                f"{tuple(p.shape)}; expected a tangent shaped like its primal."
            )
        if isinstance(p, torch.Tensor) and not (t.is_floating_point() or t.is_complex()):
            # functorch's ValueError: an integer tangent is a mistake (torch.ones(n, dtype=long)),
            # which the cast to the primal's dtype would hide
            raise ValueError(
                f"{call}: a tangent is a {t.dtype} tensor; expected a floating-point or complex "
                "tensor (the primal's dtype)."
            )
        if isinstance(p, torch.Tensor) and t.is_complex() and not p.is_complex():
            # the cast to the real primal's dtype would drop the imaginary part (functorch
            # keeps it and returns a complex output tangent): refuse rather than guess
            raise ValueError(
                f"{call}: a tangent is a {t.dtype} tensor but its primal is real ({p.dtype}); "
                "expected a real tangent (pass the real and imaginary parts as two jvp calls)."
            )
    return _jvp(func, flat_p, flat_t, spec, has_aux, call, strict)


def _number_tangent(t, p):
    """A Python number is the tangent of a 0-d primal (as a Python float is a primal), of the
    primal's dtype; a complex number for a real primal stays complex (refused below rather
    than cut to its real part). Anything else is left for the checks to report as it is."""
    if type(t) not in (float, complex, int) or not isinstance(p, torch.Tensor) or p.dim() != 0:
        return t
    if type(t) is complex and not p.is_complex():
        return torch.tensor(t)
    return torch.tensor(t, dtype=p.dtype)


@eager_under_compile
def _jvp(func, flat_p, flat_t, spec, has_aux, call, strict=False):
    """jvp on flattened, validated inputs, with ``call`` (jvp, jacfwd, hessian) named in errors."""
    from functransforms.autodiff.forward import DualTensor, JvpInterpreter, wrap_dual

    interp = JvpInterpreter(call)
    given = []  # Note [Writes to primals]
    with interp:  # outputs are read inside: promoted buffers are restored on exit
        wrapped = []
        for p, t in zip(flat_p, flat_t):
            if isinstance(p, torch.Tensor) and is_floating(p):
                r = _resolved(p)
                wrapped.append(
                    wrap_dual(r, _resolved(t.to(p.dtype) if t.dtype != p.dtype else t), interp)
                )
                given.append((p, r, wrapped[-1]))
            else:
                wrapped.append(p)
        result = func(*pt.tree_unflatten(spec, wrapped))
        aux = None
        if has_aux:
            result, aux = _split_aux(result, call)
            aux = _unwrap_dual(aux, interp)
        flat_out, out_spec = pt.tree_flatten(result)
        if not flat_out:  # as vjp (and functorch's jvp): no tensor to push the tangents to
            raise RuntimeError(
                f"{call}: expected the function's output to contain at least one tensor; got "
                f"{describe(result)}."
            )
        outs, touts = [], []
        for i, o in enumerate(flat_out):
            if isinstance(o, DualTensor) and o._interp is interp:
                outs.append(o._primal)
                touts.append(o._tangent)
            elif not isinstance(o, torch.Tensor):  # RuntimeError, as functorch
                raise RuntimeError(
                    f"{call}: output {i} (flattened) is {describe(o)}; "
                    "expected the function to return tensors (or pytrees of tensors)."
                )
            elif strict:  # PyTorch's strict=True: no zero tangent for an independent output
                raise RuntimeError(
                    f"{call[:-1]}, strict=True): output {i} (flattened) does not depend on the "
                    "primals; expected every output to depend on them with strict=True. Do: "
                    "pass strict=False for a zero tangent."
                )
            else:
                outs.append(o)
                touts.append(torch.zeros_like(o))
    _write_back(given, call)
    res = (pt.tree_unflatten(out_spec, outs), pt.tree_unflatten(out_spec, touts))
    if has_aux:
        return res + (aux,)
    return res


def _unwrap_dual(tree, interp):
    from functransforms.autodiff.forward import DualTensor

    return pt.tree_map(
        lambda x: x._primal if isinstance(x, DualTensor) and x._interp is interp else x, tree
    )


def linearize(func: Func, *primals: PyTree, has_aux: bool = False) -> tuple[Any, ...]:
    """``(func(*primals), jvp_fn)`` where ``jvp_fn(*tangents)`` is the Jacobian-vector product
    at ``primals``. ``func`` runs once; ``jvp_fn`` reuses what that run recorded.

    Note [linearize by transposition]
        ``vjp_fn`` of ``func`` is linear in the cotangent, and the vjp of a linear map is its
        adjoint (under the real inner product of docs/complex.md, so complex maps work too):
        the adjoint of ``c -> J^H c`` is ``t -> J t``. So ``linearize`` records ``func`` once
        under reverse mode, records one backward sweep at a zero cotangent, and each
        ``jvp_fn(t)`` is one backward sweep of that second tape: ``func`` never runs again
        (PyTorch re-traces with make_fx and constant-folds instead; JAX partially evaluates).

    Args:
        func: a function of pytrees of tensors.
        *primals: the point to linearize at.
        has_aux: whether ``func`` returns ``(output, aux)`` (JAX's flag).

    Returns:
        ``(output, jvp_fn)`` (``(output, jvp_fn, aux)`` with ``has_aux``); ``jvp_fn(*tangents)``
        takes tangents shaped like ``primals`` and returns a pytree shaped like ``output``.

    Example:
        >>> import torch, functransforms as ft
        >>> out, jvp_fn = ft.linearize(torch.sin, torch.zeros(2))   # out: [2]
        >>> jvp_fn(torch.ones(2))                                   # [2] = cos(0) * 1
        tensor([1., 1.])
    """
    call = f"linearize({_name(func)}, ...)"
    _check_callable(func, call)
    res = _vjp(func, primals, has_aux, call)
    out, vjp_fn = res[0], res[1]
    # only floating and complex outputs move: an integer output's tangent is a zero (as jvp's,
    # section 20 of docs/torch_func_differences.md), and its cotangent is no input of the
    # transpose
    flat_out, out_spec = pt.tree_flatten(out)
    moving = [o.is_floating_point() or o.is_complex() for o in flat_out]

    def with_fixed(moved, fixed):
        it = iter(moved)
        return pt.tree_unflatten(
            out_spec, [next(it) if m else fixed(o) for o, m in zip(flat_out, moving)]
        )

    zeros = [torch.zeros_like(o) for o, m in zip(flat_out, moving) if m]
    if zeros:
        _, transpose = _vjp(
            lambda cts: vjp_fn(with_fixed(cts, torch.zeros_like)), (zeros,), False, call
        )
    else:
        transpose = lambda _: ([],)  # nothing moves
    primal_spec = pt.tree_structure(primals)
    flat_primals = pt.tree_leaves(primals)

    def jvp_fn(*tangents):
        flat_t, spec = pt.tree_flatten(tangents)
        if not pt.same_structure(spec, primal_spec):
            raise RuntimeError(  # functorch's class, here and below
                f"jvp_fn(*tangents) of {call}: expected tangents with the structure of the "
                f"primals, {primal_spec}; got {spec}."
            )
        cast = []
        for p, t in zip(flat_primals, flat_t):
            p = _as_tensor(p)
            if not isinstance(t, torch.Tensor) or t.shape != p.shape:
                got = (
                    f"has shape {tuple(t.shape)}"
                    if isinstance(t, torch.Tensor)
                    else f"is {describe(t)}"
                )
                raise RuntimeError(
                    f"jvp_fn(*tangents) of {call}: a tangent {got} but its primal has "
                    f"shape {tuple(p.shape)}; expected equal shapes."
                )
            if not (t.is_floating_point() or t.is_complex()) or (
                t.is_complex() and not p.is_complex()
            ):
                # functorch refuses any other dtype; we cast between floating dtypes only (as
                # jvp): an integer tangent is a mistake and a complex one would lose its
                # imaginary part
                raise RuntimeError(
                    f"jvp_fn(*tangents) of {call}: a tangent is a {t.dtype} tensor but its primal "
                    f"is {p.dtype}; expected a tangent of the primal's dtype."
                )
            cast.append(t.to(p.dtype) if t.dtype != p.dtype else t)
        return with_fixed(transpose(pt.tree_unflatten(primal_spec, cast))[0], torch.zeros_like)

    if has_aux:
        return out, jvp_fn, res[2]
    return out, jvp_fn
