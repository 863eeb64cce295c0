"""Misuse, generated: each transform is called with wrong in_dims / out_dims / argnums / has_aux
structures, non-tensor and integer inputs and None outputs (functransforms.testing.strategies'
misuse strategies), and the same call is made with torch.func. Each call must either compute
what torch.func computes (values compared) or raise, at our API edge (functransforms/_ad.py,
_jacobians.py, _vmap.py, errors.py: never from deep inside torch), one of the exception classes
torch.func raises for it, with a message that names the transform, the argument and the
received value.

The only calls that may return where torch.func raises, or raise where it computes, are the
documented differences (docs/torch_func_differences.md), each checked by its own reason below.
"""

import math
import os
import traceback

import pytest
import torch
import torch.func as tf
from hypothesis import given
from hypothesis import strategies as st

import functransforms as ft
from functransforms import _pytree as pt
from functransforms.testing import strategies as fts

_EDGE = tuple(
    os.path.join(os.path.dirname(ft.__file__), name)
    for name in ("_ad.py", "_jacobians.py", "_vmap.py", "errors.py")
)
_CLASSES = (TypeError, ValueError, RuntimeError, IndexError)  # torch.func's, for these misuses
_ARGUMENT_WORDS = (
    "in_dim",
    "out_dim",
    "argnums",
    "has_aux",
    "input",
    "output",
    "tangent",
    "primal",
)
f64 = torch.float64


def _run(fn):
    try:
        return "ok", fn()
    except Exception as e:  # noqa: BLE001 (the property classifies every exception)
        return "raised", e


def _leaves(tree):
    """Leaves with None kept (None is an empty node for our pytrees)."""
    if isinstance(tree, (tuple, list)):
        return [leaf for t in tree for leaf in _leaves(t)]
    if isinstance(tree, dict):
        return [leaf for k in sorted(tree) for leaf in _leaves(tree[k])]
    return [tree]


def _same(ours, ref):
    """Equal structure (tuple/list/dict/None) and equal values (close for floating tensors)."""
    if isinstance(ref, torch.Tensor):
        assert isinstance(ours, torch.Tensor), (type(ours), ref)
        assert ours.shape == ref.shape and ours.dtype == ref.dtype, (ours, ref)
        torch.testing.assert_close(ours, ref, equal_nan=True)
    elif isinstance(ref, (tuple, list)):
        assert isinstance(ours, (tuple, list)) and len(ours) == len(ref), (ours, ref)
        for o, r in zip(ours, ref):
            _same(o, r)
    elif isinstance(ref, dict):
        assert isinstance(ours, dict) and set(ours) == set(ref), (ours, ref)
        for k in ref:
            _same(ours[k], ref[k])
    elif isinstance(ref, float) and math.isnan(ref):
        assert isinstance(ours, float) and math.isnan(ours)
    else:
        assert ours == ref, (ours, ref)


def check(transform, ours, ref, *, extension=None, stricter=None):
    """``ours`` / ``ref``: the call, made with functransforms / torch.func (zero-argument
    callables returning plain values). ``extension(ref_error)``: whether ours may return where
    torch.func raises (a documented difference); ``stricter(our_error)``: whether ours may raise
    where torch.func computes. Returns our outcome."""
    ref_kind, ref_val = _run(ref)
    kind, val = _run(ours)
    if kind == "raised":
        e = val
        assert isinstance(e, _CLASSES), f"{type(e).__name__}: {e}"
        where = traceback.extract_tb(e.__traceback__)[-1].filename
        assert where in _EDGE, f"raised from {where}, not the API edge: {type(e).__name__}: {e}"
        msg = str(e)
        assert f"{transform}(" in msg[:120], msg
        assert any(w in msg for w in _ARGUMENT_WORDS), msg
        assert "expected" in msg.lower(), msg
        assert any(w in msg for w in ("got", " is ", " has ", "contains", " names ")), msg
        if ref_kind == "ok":
            assert stricter is not None and stricter(e), (
                f"ours raised where torch.func computes: {type(e).__name__}: {e}"
            )
        return kind, val
    if ref_kind == "raised":
        assert extension is not None and extension(ref_val), (
            f"ours returned a value where torch.func raises {type(ref_val).__name__}: {ref_val}"
        )
        return kind, val
    _same(val, ref_val)
    return kind, val


# -- vmap -------------------------------------------------------------------------------------
def _sin(x):
    return x.sin() if isinstance(x, torch.Tensor) else x


_VMAP_OUTPUTS = {
    "each": lambda a: tuple(_sin(x) for x in a),
    "first": lambda a: _sin(a[0]),
    "none": lambda a: None,
    "first_and_none": lambda a: (_sin(a[0]), None),
    "float": lambda a: 1.5,
    "nested": lambda a: {"a": _sin(a[0]), "b": (_sin(a[-1]),)},
}


def _has_list(spec):
    if isinstance(spec, list):
        return True
    return isinstance(spec, tuple) and any(_has_list(s) for s in spec)


def _has_bool(spec):
    if isinstance(spec, bool):
        return True
    return isinstance(spec, (tuple, list)) and any(_has_bool(s) for s in spec)


@st.composite
def _vmap_inputs(draw):
    batch = draw(st.integers(1, 3))
    args = []
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.integers(0, 3)):
            shape = list(draw(fts.shapes(0, 3, 1, 3)))
            if shape and draw(st.booleans()):  # mostly one size along the mapped dims
                shape[draw(st.integers(0, len(shape) - 1))] = batch
            args.append(torch.randn(shape, dtype=f64))
        else:
            args.append(draw(fts.non_tensors()))
    return tuple(args)


@given(
    args=_vmap_inputs(),
    in_dims=st.one_of(fts.dim_specs(), st.just(0)),
    out_dims=st.one_of(fts.dim_specs(), st.just(0)),
    output=st.sampled_from(sorted(_VMAP_OUTPUTS)),
    tuple_in_dims=st.booleans(),
)
def test_vmap_misuse(args, in_dims, out_dims, output, tuple_in_dims):
    if tuple_in_dims and not isinstance(in_dims, tuple):
        in_dims = (in_dims,) * len(args)  # the right length, so the entries get checked

    def f(*a):
        return _VMAP_OUTPUTS[output](a)

    def extension(ref_error):
        msg = str(ref_error)
        if "must only return Tensors, got type <class 'NoneType'>" in msg:
            return True  # section 6: None outputs come back as None (as JAX)
        # section 25: a list matches a tuple by position
        return "is not compatible with the structure" in msg and (
            _has_list(in_dims) or _has_list(out_dims)
        )

    def stricter(e):
        if isinstance(e, TypeError) and _has_bool(out_dims):
            return True  # section 25: out_dims=True raises (torch.func reads it as 1)
        # section 39: out_dims past the rank of an output that does not depend on the mapped
        # inputs (torch.func returns a garbage shape)
        return isinstance(e, IndexError) and "out of range" in str(e)

    check(
        "vmap",
        lambda: ft.vmap(f, in_dims, out_dims)(*args),
        lambda: tf.vmap(f, in_dims, out_dims)(*args),
        extension=extension,
        stricter=stricter,
    )


# -- grad, vjp, jvp, jacrev, jacfwd, hessian, linearize ---------------------------------------
def _floating(a):
    return [x for x in _leaves(a) if isinstance(x, torch.Tensor) and is_floating(x)]


def is_floating(x):
    return x.is_floating_point() or x.is_complex()


_AD_OUTPUTS = {
    "scalar": lambda a: (
        sum((t.sin() * 1.5).sum() for t in _floating(a)) + torch.zeros((), dtype=f64)
    ),
    "vector": lambda a: torch.cat(
        [t.sin().reshape(-1) for t in _floating(a)] + [torch.zeros(1, dtype=f64)]
    ),
    "none": lambda a: None,
    "float": lambda a: 1.5,
    "integer": lambda a: torch.tensor(3),
}
_AUX = {
    "tensor": lambda out, a: (out, torch.ones(2)),
    "none": lambda out, a: (out, None),
    "int": lambda out, a: (out, 3),
    "missing": lambda out, a: out,
    "triple": lambda out, a: (out, out, out),
}


@st.composite
def _ad_inputs(draw):
    args = []
    for _ in range(draw(st.integers(1, 2))):
        kind = draw(st.sampled_from(["float64", "float64", "int64", "python"]))
        if kind == "python":
            args.append(draw(fts.non_tensors()))
            continue
        shape = draw(fts.shapes(0, 2, 1, 3))
        x = torch.randn(shape, dtype=f64)
        args.append(x if kind == "float64" else (x * 3).long())
    return tuple(args)


def _diff_leaves(args, argnums):
    """The differentiated inputs' leaves (None kept), or None when argnums is malformed."""
    nums = argnums if isinstance(argnums, tuple) else (argnums,)
    if not nums or any(type(i) is not int or not -len(args) <= i < len(args) for i in nums):
        return None
    return _leaves([args[i] for i in nums])


def _ad_extension(diff, aux, output=None):
    """Ours may compute where torch.func raises for: Python floats as primals (section 1),
    None inside the differentiated inputs and as aux (section 6), integer outputs of vjp and
    jacrev (section 20), no tensor primals in jvp (section 25)."""

    def extension(ref_error):
        if diff is None:
            return False
        if output == "integer" and "must be floating-point or complex" in str(ref_error):
            return True
        if any(type(x) in (float, complex) or x is None for x in diff):
            return True
        if "Expected primals to contain at least one Tensor" in str(ref_error):
            return True
        return aux == "none" and "got unsupported type <class 'NoneType'>" in str(ref_error)

    return extension


def _nonnegative(argnums, n):
    """argnums without negative indices, for torch.func's jacfwd, which differentiates nothing
    (zeros) at a negative argnum (section 40); malformed ones as they are."""
    if type(argnums) is int and -n <= argnums < 0:
        return argnums + n
    if isinstance(argnums, tuple) and all(type(i) is int and -n <= i < n for i in argnums):
        return tuple(i % n for i in argnums)
    return argnums


def _stricter_argnums(argnums):
    # section 25: True/False as argnums raise (torch.func reads them as 1/0)
    return lambda e: isinstance(argnums, bool) and "argnums" in str(e)


def _ad_function(output, has_aux, aux):
    def f(*a):
        out = _AD_OUTPUTS[output](a)
        return _AUX[aux](out, a) if has_aux else out

    return f


_ad_cases = dict(
    args=_ad_inputs(),
    output=st.sampled_from(sorted(_AD_OUTPUTS)),
    has_aux=st.booleans(),
    aux=st.sampled_from(sorted(_AUX)),
)


@pytest.mark.parametrize("transform", ["grad", "grad_and_value", "jacrev", "jacfwd"])
@given(data=st.data(), **_ad_cases)
def test_grad_and_jacobians_misuse(transform, data, args, output, has_aux, aux):
    argnums = data.draw(st.one_of(st.just(0), fts.argnums_specs(len(args))), label="argnums")
    f = _ad_function(output, has_aux, aux)
    check(
        transform,
        lambda: getattr(ft, transform)(f, argnums, has_aux=has_aux)(*args),
        lambda: getattr(tf, transform)(f, _nonnegative(argnums, len(args)), has_aux=has_aux)(*args),
        extension=_ad_extension(_diff_leaves(args, argnums), aux if has_aux else None, output),
        stricter=_stricter_argnums(argnums),
    )


@given(data=st.data(), args=_ad_inputs(), output=st.sampled_from(sorted(_AD_OUTPUTS)))
def test_hessian_misuse(data, args, output):
    argnums = data.draw(st.one_of(st.just(0), fts.argnums_specs(len(args))), label="argnums")
    f = _ad_function(output, False, None)
    check(
        "hessian",
        lambda: ft.hessian(f, argnums)(*args),
        lambda: tf.hessian(f, _nonnegative(argnums, len(args)))(*args),
        extension=_ad_extension(_diff_leaves(args, argnums), None, output),
        stricter=_stricter_argnums(argnums),
    )


def _cotangent(out):
    return torch.ones_like(out) if isinstance(out, torch.Tensor) else out


@given(**_ad_cases)
def test_vjp_misuse(args, output, has_aux, aux):
    f = _ad_function(output, has_aux, aux)

    def call(lib):
        res = lib.vjp(f, *args, has_aux=has_aux)
        return (res[0], res[1](_cotangent(res[0]))) + tuple(res[2:])

    check(
        "vjp",
        lambda: call(ft),
        lambda: call(tf),
        extension=_ad_extension(_leaves(args), aux if has_aux else None, output),
    )


_TANGENTS = {
    "match": lambda p: torch.ones_like(p) if isinstance(p, torch.Tensor) else p,
    "integer": lambda p: torch.ones_like(p, dtype=torch.long) if isinstance(p, torch.Tensor) else 1,
    "shape": lambda p: torch.ones(7, dtype=f64),
    "python": lambda p: 1.0,
}


@given(tangents=st.sampled_from(sorted(_TANGENTS)), **_ad_cases)
def test_jvp_misuse(args, output, has_aux, aux, tangents):
    f = _ad_function(output, has_aux, aux)
    ts = tuple(_TANGENTS[tangents](p) for p in args)
    base = _ad_extension(_leaves(args), aux if has_aux else None)

    def extension(ref_error):
        # section 1: a Python number is a tangent (of its primal's dtype), as it is a primal
        number = "Expected tangents to only contain Tensors" in str(ref_error)
        return base(ref_error) or (tangents == "python" and number)

    check(
        "jvp",
        lambda: ft.jvp(f, args, ts, has_aux=has_aux),
        lambda: tf.jvp(f, args, ts, has_aux=has_aux),
        extension=extension,
    )


@given(
    tangents=st.sampled_from(sorted(_TANGENTS)),
    args=_ad_inputs(),
    output=st.sampled_from(sorted(_AD_OUTPUTS)),
)
def test_linearize_misuse(args, output, tangents):
    f = _ad_function(output, False, None)
    ts = tuple(_TANGENTS[tangents](p) for p in args)

    def call(lib):
        out, jvp_fn = lib.linearize(f, *args)
        return out, jvp_fn(*ts)

    check(
        "linearize",
        lambda: call(ft),
        lambda: call(tf),
        extension=_ad_extension(_leaves(args), None, output),
        # section 40: linearize of a function without tensor outputs raises, as jvp (torch.func
        # returns the output and a jvp_fn)
        stricter=lambda e: output in ("none", "float") and "output" in str(e),
    )


def test_the_harness_catches_an_error_from_inside_torch():
    """The property would fail on an error raised below the API edge, or a value where
    torch.func raises: both checks can fail."""
    with pytest.raises(AssertionError, match="not the API edge"):
        check("vmap", lambda: torch.ones(2) + torch.ones(3), lambda: None)
    with pytest.raises(AssertionError, match="ours returned a value"):
        check("vmap", lambda: 1, lambda: 1 / 0)
    assert pt.tree_leaves((None, 1)) == [1]  # why _leaves keeps None itself
