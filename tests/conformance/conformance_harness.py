"""The OpInfo conformance harness: our transforms against a Python loop and torch.func.

Note [Conformance suite]
    For every OpInfo of ``op_db`` (PyTorch's operator test database) and each transform, one
    test runs the op's first ``N_SAMPLES`` sample inputs through our transform and through the
    oracle, and classifies the result:

    * ``pass``      every compared sample agrees (values, shapes, dtypes);
    * ``fallback``  (vmap, vmap(vjp), vmap(jvp), vmap_dims) agrees, but vmap ran at least one op
                    through its per-example loop (a ``FallbackWarning``): allowed, counted,
                    listed in docs/conformance.md;
    * ``fail``      with one category: ``wrong value`` / ``wrong shape`` / ``wrong dtype`` /
                    ``wrong structure`` (silent wrong results, the worst class), ``no vmap rule``
                    / ``no jvp rule`` / ``no vjp rule`` (a NotImplementedError naming the
                    missing rule), ``crash: <ExceptionType>`` (anything else raised);
    * ``skip``      nothing could be compared (random op, no sample the oracle accepts, ...).

    A sample the oracle itself cannot handle (torch.func raises, the loop's results do not
    stack, the op returns Python values) is skipped and counted, never failed. When several
    samples fail differently the category with the highest priority wins (``_PRIORITY``: wrong
    results first), so the table shows the worst thing an op does.

    Oracles. vmap: a Python loop over the examples, stacked (always), and torch.func.vmap where
    it runs (an op where both torch.func and we raise is skipped, as a limit of vmap itself,
    e.g. data-dependent output shapes). vjp / jvp: torch.func.vjp / torch.func.jvp with the
    same random cotangents / tangents.

    Each test looks up ``(op full name, transform)`` in expected_failures.EXPECTED: a listed
    failure with the same category is an xfail; a different category or an unexpected pass
    fails the test (the pass as XPASS(strict)), so the table must follow every fix. With
    ``FT_CONFORMANCE_RECORD=<dir>`` set, every test also writes its raw result (a JSON line) to
    that directory; update_expected.py reads them to rewrite the table and docs/conformance.md.

Note [Conformance determinism]
    Every sample generation, example and cotangent draws from seeds derived from the op's
    name (crc32), not from test order, so one op gives the same result on every run, in any
    xdist worker, whatever ran before. Ops whose outputs are random or uninitialized are in
    ``SKIP``. ``update_expected.py --check-flaky`` runs the suite twice and reports any test
    whose result changed; such an op goes in ``SKIP`` with the reason "flaky".
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import random
import re
import time
import traceback
import warnings
import zlib
from dataclasses import dataclass, field

import pytest
import torch
import torch.utils._pytree as tpt
from conformance_references import oracle_op

B = 3  # the batch size of every vmap case
N_SAMPLES = 2  # sample inputs per op, dtype and transform
DEVICE = "cpu"

# Ops skipped entirely, with the reason (shown by pytest and in docs/conformance.md).
_RANDOM = "random output"
_UNINIT = "uninitialized output (nondeterministic values)"
SKIP: dict[str, str] = {
    **{
        name: _RANDOM
        for name in (
            "bernoulli cauchy exponential geometric log_normal multinomial normal "
            "normal.in_place normal.number_mean uniform rand_like randint randint_like randn "
            "randn_like nn.functional.dropout nn.functional.dropout2d nn.functional.dropout3d "
            "nn.functional.alpha_dropout nn.functional.feature_alpha_dropout.with_train "
            "nn.functional.rrelu nn.functional.fractional_max_pool2d "
            "nn.functional.fractional_max_pool3d svd_lowrank pca_lowrank"
        ).split()
    },
    **{
        name: _UNINIT
        for name in (
            "empty empty_like empty_strided empty_permuted new_empty new_empty_strided "
            "resize_ resize_as_"
        ).split()
    },
    # docs/torch_func_differences.md section 11: torch.func loops argwhere (a value only when
    # every example has as many non-zeros) but refuses nonzero; ours refuses both
    "argwhere": "deliberate: raises like nonzero under vmap (torch_func_differences.md 11)",
    **{
        name: "CUDA only (jiterator)"
        for name in (
            "jiterator_unary jiterator_binary jiterator_4inputs_with_extra_args "
            "jiterator_binary_return_by_ref jiterator_2inputs_2outputs"
        ).split()
    },
}

# Transform keys of the expected-failure table: (op full name, transform).
REAL, COMPLEX = "real", "complex"


def transform_key(transform: str, kind: str) -> str:
    """``vjp`` for real dtypes, ``vjp[complex]`` for complex ones."""
    return transform if kind == REAL else f"{transform}[{kind}]"


def full_name(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


_OP_DB = None


def op_db():
    global _OP_DB
    if _OP_DB is None:
        from torch.testing._internal.common_methods_invocations import op_db as db

        _OP_DB = {full_name(op): op for op in db}
    return _OP_DB


def _seed_of(*parts) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode()) & 0x7FFFFFFF


def seed_all(*parts) -> int:
    s = _seed_of(*parts)
    torch.default_generator.manual_seed(s)  # torch.manual_seed also seeds every backend: slow
    random.seed(s)
    try:
        import numpy as np

        np.random.seed(s)
    except ImportError:  # pragma: no cover
        pass
    return s


# -- dtypes ---------------------------------------------------------------------------------


def vmap_dtypes(op, kind):
    ok = op.supported_dtypes(DEVICE)
    if kind == COMPLEX:
        return [d for d in (torch.complex64,) if d in ok]
    real = [d for d in (torch.float32, torch.float64) if d in ok]
    if not real:  # integer / bool only ops (bitwise, gcd, ...): batch them all the same
        real = [d for d in (torch.int64, torch.bool) if d in ok][:1]
    return real


def grad_dtypes(op, transform, kind):
    if transform == "vjp":
        if not op.supports_autograd:
            return []
        ok = op.supported_backward_dtypes(DEVICE)
    else:
        if not op.supports_forward_ad:
            return []
        ok = op.supported_dtypes(DEVICE)
    want = torch.complex128 if kind == COMPLEX else torch.float64
    return [want] if want in ok else []


def dims_dtypes(op, kind):
    """vmap_dims: float64 / complex128 (the cheap float32 check is vmap's), else vmap's."""
    ok = op.supported_dtypes(DEVICE)
    want = torch.complex128 if kind == COMPLEX else torch.float64
    return [want] if want in ok else [d for d in vmap_dtypes(op, kind) if not d.is_complex]


# Compositions (Note [Conformance compositions]) -> the transform whose dtypes and OpInfo
# flags they take: the derivative inside (vjp needs supports_autograd, jvp supports_forward_ad)
# or, for vmap_dims (vmap with other in_dims / out_dims, and nested), vmap.
COMPOSITIONS = {
    "vmap(vjp)": "vjp",
    "jvp(vjp)": "vjp",
    "vmap(jvp)": "jvp",
    "vjp(vjp)": "vjp",
    "vjp(jvp)": "jvp",
    "vmap_dims": "vmap",
    # torch.autograd over ours (Note [Conformance of torch autograd over our transforms])
    "autograd(vjp)": "vjp",
    "autograd(vmap)": "vjp",
    "autograd(jvp)": "jvp",
}


def cases(transform):
    """(op full name, kind) pairs that have at least one dtype for ``transform``."""
    out = []
    for name, op in op_db().items():
        for kind in (REAL, COMPLEX):
            if transform == "vmap":
                dts = vmap_dtypes(op, kind)
            elif transform == "vmap_dims":
                dts = dims_dtypes(op, kind)
            elif transform in COMPOSITIONS:
                dts = grad_dtypes(op, COMPOSITIONS[transform], kind)
            else:
                dts = grad_dtypes(op, transform, kind)
            if dts:
                out.append((name, kind))
    return out


# -- results --------------------------------------------------------------------------------

_PRIORITY = [
    "wrong value",
    "wrong shape",
    "wrong dtype",
    "wrong structure",
    "no vmap rule",
    "no jvp rule",
    "no vjp rule",
]
# Note [No loop where torch.func batches]
#     vmap's per-example loop is correct but slow. Where torch.func.vmap batches a sample without
#     its own fallback (its "performance drop" warning, switched on for the call), a FallbackWarning
#     of ours fails the case as LOOP, unless every looping op is allowed below (with the reason; an
#     entry goes when the op's batching rule lands). Where torch.func loops too, ours may loop: the
#     outcome stays ``fallback``.
LOOP = "loop where torch.func batches"
ALLOWED_LOOPS: dict[str, str] = {}


def _rank(category):
    return _PRIORITY.index(category) if category in _PRIORITY else len(_PRIORITY)


class ConformanceFailure(AssertionError):
    """An op failed in the way expected_failures.EXPECTED says it does (an xfail)."""


@dataclass
class Result:
    op: str
    transform: str
    compared: int = 0
    skipped: dict = field(default_factory=dict)  # why -> number of samples
    fallback_ops: set = field(default_factory=set)
    category: str | None = None
    detail: str = ""
    skip_reason: str | None = None

    def skip_sample(self, why):
        self.skipped[why] = self.skipped.get(why, 0) + 1

    def fail(self, category, detail):
        if self.category is None or _rank(category) < _rank(self.category):
            self.category, self.detail = category, detail

    @property
    def outcome(self):
        if self.category is not None:
            return "fail"
        if self.skip_reason is not None or self.compared == 0:
            return "skip"
        return "fallback" if self.fallback_ops else "pass"

    def record(self, seconds):
        folder = os.environ.get("FT_CONFORMANCE_RECORD")
        if not folder:
            return
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        row = {
            "op": self.op,
            "transform": self.transform,
            "outcome": self.outcome,
            "category": self.category,
            "detail": self.detail[:300],
            "skip_reason": self.skip_reason
            or (None if self.compared else "no comparable sample: " + _why(self.skipped)),
            "compared": self.compared,
            "skipped": self.skipped,
            "fallback_ops": sorted(self.fallback_ops),
            "seconds": round(seconds, 3),
        }
        with open(os.path.join(folder, f"{worker}.jsonl"), "a") as fh:
            fh.write(json.dumps(row, sort_keys=True) + "\n")


def _why(skipped):
    return ", ".join(f"{k} ({v})" for k, v in sorted(skipped.items())) or "no samples"


def conclude(result: Result, expected: str | None, started: float):
    """Record the result, then pass / xfail / fail / skip the test (Note [Conformance suite])."""
    result.record(time.perf_counter() - started)
    where = f"{result.op} [{result.transform}]"
    if result.outcome == "fail":
        msg = f"{where}: {result.category}: {result.detail}"
        if expected == result.category:
            raise ConformanceFailure(msg)
        if expected is not None:
            msg += (
                f"\n(expected_failures.py says {expected!r}: the failure changed; "
                "refresh the table with python tests/conformance/update_expected.py)"
            )
        raise AssertionError(msg)
    if result.outcome == "skip":
        # An expected failure that now skips is a change too: keep the table honest.
        if expected is not None:
            raise AssertionError(
                f"{where}: expected {expected!r} but no sample could be compared "
                f"({result.skip_reason or _why(result.skipped)}); refresh the table with "
                "python tests/conformance/update_expected.py"
            )
        pytest.skip(result.skip_reason or "no comparable sample: " + _why(result.skipped))
    # pass / fallback: an expected failure that passes is an XPASS(strict) (marks, in the tests).


def classify_exception(e: BaseException) -> str:
    msg = str(e)
    if isinstance(e, NotImplementedError):
        m = re.search(r"there is no (vmap|jvp|vjp|batching) rule", msg)
        if m:
            return "no vmap rule" if m.group(1) in ("vmap", "batching") else f"no {m.group(1)} rule"
    return f"crash: {type(e).__name__}"


def _short(e: BaseException) -> str:
    """The exception's first line, and where it was raised (the innermost frame: a crash seen
    once in a full run can then be traced)."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    frames = traceback.extract_tb(e.__traceback__)
    where = f" [{os.path.basename(frames[-1].filename)}:{frames[-1].lineno}]" if frames else ""
    return f"{type(e).__name__}: {first[:200]}{where}"


# -- comparing ------------------------------------------------------------------------------


def _tol(dtype):
    if dtype in (torch.float64, torch.complex128):
        return 1e-6, 1e-6
    if dtype in (torch.float32, torch.complex64):
        return 1e-4, 1e-4
    if dtype in (torch.float16, torch.bfloat16, torch.complex32):
        return 1e-2, 1e-2
    return 0.0, 0.0


def compare(ours, ref, what):
    """None when equal, else (category, detail).

    Reading our outputs can raise (e.g. a wrapper that escaped its transform): that is ours to
    fix, so it is classified like any exception of the transform.
    """
    try:
        return _compare(ours, ref, what)
    except Exception as e:
        return classify_exception(e), f"{what}: reading the output raised {_short(e)}"


def _compare(ours, ref, what):
    ol, os_ = tpt.tree_flatten(ours)
    rl, rs = tpt.tree_flatten(ref)
    if len(ol) != len(rl):
        return "wrong structure", f"{what}: {len(ol)} outputs, expected {len(rl)}"
    for i, (a, b) in enumerate(zip(ol, rl)):
        if isinstance(b, torch.Tensor):
            if not isinstance(a, torch.Tensor):
                return "wrong structure", f"{what}: output {i} is {type(a).__name__}, not a tensor"
            if a.shape != b.shape:
                return (
                    "wrong shape",
                    f"{what}: output {i} has shape {tuple(a.shape)}, expected {tuple(b.shape)}",
                )
            if a.dtype != b.dtype:
                return "wrong dtype", f"{what}: output {i} has dtype {a.dtype}, expected {b.dtype}"
            rtol, atol = _tol(b.dtype)
            a_, b_ = a.detach(), b.detach()
            if a_.is_sparse or b_.is_sparse:
                a_, b_ = a_.to_dense(), b_.to_dense()
            if a_.is_complex():
                a_, b_ = (
                    torch.view_as_real(a_.resolve_conj()),
                    torch.view_as_real(b_.resolve_conj()),
                )
            if a_.dtype == torch.bool:
                equal = torch.equal(a_, b_)
            elif a_.dtype.is_floating_point:
                a_, b_ = a_.double(), b_.double()
                equal = torch.allclose(a_, b_, rtol=rtol, atol=atol, equal_nan=True)
            else:
                equal = torch.equal(a_, b_)
            if not equal:
                with torch.no_grad():
                    diff = (a_.double() - b_.double()).abs().nan_to_num(nan=float("inf"))
                    err = diff.max().item() if diff.numel() else 0.0
                return "wrong value", f"{what}: output {i} differs (max abs error {err:.3g})"
        elif a != b and not (isinstance(a, float) and isinstance(b, float) and a != a and b != b):
            return "wrong value", f"{what}: output {i} is {a!r}, expected {b!r}"
    return None


# -- samples --------------------------------------------------------------------------------


def _leaves(sample):
    """Flat leaves and spec of (input, args, kwargs) of a SampleInput."""
    return tpt.tree_flatten((sample.input, tuple(sample.args), dict(sample.kwargs)))


def _call(op, spec, leaves):
    inp, args, kwargs = tpt.tree_unflatten(leaves, spec)
    return op(inp, *args, **kwargs)


def _is_tensor(x):
    return isinstance(x, torch.Tensor)


def _is_diff(x):
    return _is_tensor(x) and (x.dtype.is_floating_point or x.dtype.is_complex)


def take_samples(op, dtype, seed_parts, requires_grad=False, n=N_SAMPLES):
    """The op's first ``n`` samples. ``op.sample_inputs`` would reseed with a fixed seed before
    each sample and crawl the stack (inspect.stack, ~50 ms under pytest): call the generator."""
    seed_all(*seed_parts)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gen = op.sample_inputs_func(op, DEVICE, dtype, requires_grad)
        return list(itertools.islice(gen, n))


def _same_layout(a, b):
    (la, sa), (lb, sb) = a, b
    if sa != sb or len(la) != len(lb):
        return False
    for x, y in zip(la, lb):
        if _is_tensor(x) != _is_tensor(y):
            return False
        if _is_tensor(x):
            if x.shape != y.shape or x.dtype != y.dtype or x.layout != y.layout:
                return False
        elif type(x) is not type(y) or (x != y and not (x != x and y != y)):
            return False
    return True


def describe(sample) -> str:
    """A short description of a sample for failure messages: ``op([5, 5] f32, 0, dim=1)``."""

    def one(x):
        if _is_tensor(x):
            dt = str(x.dtype).replace("torch.", "")
            return f"{list(x.shape)} {dt}"
        if isinstance(x, (list, tuple)):
            inner = ", ".join(one(y) for y in x)
            return f"[{inner}]" if isinstance(x, list) else f"({inner})"
        return repr(x)

    parts = [one(sample.input), *(one(a) for a in sample.args)]
    parts += [f"{k}={one(v)}" for k, v in sample.kwargs.items()]
    text = ", ".join(parts)
    return f"({text[:120]}{'...' if len(text) > 120 else ''})"


def flat_outputs(out):
    """The op's outputs as a flat tuple of leaves (namedtuples, lists of tensors, ...)."""
    if _is_tensor(out):
        return out
    return tuple(tpt.tree_leaves(out))


def _clone(leaves):
    return [x.clone() if _is_tensor(x) else x for x in leaves]


def _strided(x):
    return not _is_tensor(x) or x.layout == torch.strided


class _CatchFallbacks:
    """Collects the ops our vmap ran through its per-example loop (FallbackWarning).

    vmap warns once per op per process; a fresh 'already warned' set for the duration makes
    the count independent of which tests ran before in this worker.
    """

    def __enter__(self):
        from functransforms.batching import _tensor

        self._mod = _tensor
        self._saved = getattr(_tensor, "_WARNED", None)
        if self._saved is not None:
            _tensor._WARNED = set()
        self._cm = warnings.catch_warnings(record=True)
        self.caught = self._cm.__enter__()
        warnings.simplefilter("ignore")
        from functransforms.errors import FallbackWarning

        warnings.simplefilter("always", FallbackWarning)
        return self

    def __exit__(self, *exc):
        self._cm.__exit__(*exc)
        if self._saved is not None:
            self._mod._WARNED = self._saved
        return False

    def ops(self):
        from functransforms.errors import FallbackWarning

        out = set()
        for w in self.caught:
            if issubclass(w.category, FallbackWarning):
                m = re.search(r"no batching rule for (\S+?),", str(w.message))
                out.add(m.group(1) if m else str(w.message)[:80])
        return out


# -- vmap -----------------------------------------------------------------------------------


def run_vmap(op, kind) -> Result:
    """Note [Conformance suite], vmap: stacked examples, in_dims=0 (and first-only once)."""
    name = full_name(op)
    result = Result(name, transform_key("vmap", kind))
    for dtype in vmap_dtypes(op, kind):
        gens = [take_samples(op, dtype, (name, "vmap", str(dtype), g)) for g in range(B)]
        for j, s0 in enumerate(gens[0]):
            leaves0, spec = _leaves(s0)
            tpos = [k for k, x in enumerate(leaves0) if _is_tensor(x)]
            if not tpos:
                result.skip_sample("no tensor argument")
                continue
            if not all(_strided(x) for x in leaves0):
                result.skip_sample("sparse input")
                continue
            examples = [leaves0]
            for g in range(1, B):
                other = _leaves(gens[g][j]) if j < len(gens[g]) else None
                if other is not None and _same_layout((leaves0, spec), other):
                    examples.append(other[0])
                else:  # the generator does not repeat its layout: batch copies of example 0
                    examples.append(_clone(leaves0))
            what = f"sample {j} {describe(s0)}"
            _vmap_case(op, spec, examples, tpos, set(tpos), result, f"{what}, in_dims=0")
            if j == 0 and len(tpos) > 1:
                _vmap_case(
                    op, spec, examples, tpos, {tpos[0]}, result, f"{what}, only the first batched"
                )
    return result


def _vmap_case(op, spec, examples, tpos, batched, result, what):
    import functransforms as ft

    base = examples[0]
    per_example = [
        [ex[k] if k in batched else base[k] for k in range(len(base))] for ex in examples
    ]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            outs = [flat_outputs(_call(op, spec, _clone(ex))) for ex in per_example]
    except Exception:
        result.skip_sample("the op raises on an example")
        return
    structs = [tpt.tree_flatten(o) for o in outs]
    if any(not all(_is_tensor(x) for x in leaves) for leaves, _ in structs) or not structs[0][0]:
        result.skip_sample("non-tensor output")
        return
    if any(not all(_strided(x) for x in leaves) for leaves, _ in structs):
        result.skip_sample("sparse output")
        return
    if not all(_same_layout(structs[0], s) for s in structs[1:]):
        result.skip_sample("per-example outputs do not stack")
        return
    expected = tpt.tree_map(lambda *xs: torch.stack(xs), *outs)

    def f(*tensors):
        leaves = list(base)
        for k, t in zip(tpos, tensors):
            leaves[k] = t
        return flat_outputs(_call(op, spec, leaves))

    in_dims = tuple(0 if k in batched else None for k in tpos)

    def args():
        return [
            torch.stack([ex[k] for ex in examples]) if k in batched else base[k].clone()
            for k in tpos
        ]

    tf_out = tf_err = None
    torch._C._functorch._set_vmap_fallback_warning_enabled(True)
    try:
        with warnings.catch_warnings(record=True) as tf_warned:
            warnings.simplefilter("always")
            tf_out = torch.func.vmap(f, in_dims=in_dims)(*args())
    except Exception as e:
        tf_err = e
    finally:
        torch._C._functorch._set_vmap_fallback_warning_enabled(False)
    tf_loops = any("performance drop" in str(w.message) for w in tf_warned)
    with _CatchFallbacks() as fb:
        try:
            ours = ft.vmap(f, in_dims=in_dims)(*args())
            err = None
        except Exception as e:
            err = e
    result.fallback_ops |= fb.ops()
    if err is not None:
        if tf_err is not None:
            result.skip_sample("torch.func.vmap raises too")
        else:
            result.fail(classify_exception(err), f"{what}: {_short(err)}")
        return
    bad = compare(ours, expected, f"{what}: vmap vs loop")
    if bad:
        result.fail(*bad)
        return
    loops = sorted(op for op in fb.ops() if op not in ALLOWED_LOOPS)
    if loops and tf_err is None and not tf_loops:  # Note [No loop where torch.func batches]
        result.fail(LOOP, f"{what}: {', '.join(loops)}")
        return
    result.compared += 1
    if tf_err is not None:
        result.skip_sample("torch.func.vmap raises (compared with the loop only)")
    elif compare(tf_out, expected, "") is not None:
        result.skip_sample("torch.func.vmap disagrees with the loop (ours agrees)")


# -- vjp / jvp ------------------------------------------------------------------------------


def _randn_like(x, gen):
    return torch.randn(x.shape, dtype=x.dtype, generator=gen)


def _differentiable_outputs(op, spec, leaves, process):
    """Which floating outputs torch differentiates (others, like native_layer_norm's mean and
    rstd, are marked non-differentiable: torch.func gives them zero derivatives). Asked of
    torch's autograd, the oracle; None (all of them) if that fails."""
    try:
        with torch.enable_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = process(_call(op, spec, _clone(leaves)))
        return [o.requires_grad for o in tpt.tree_leaves(out) if _is_diff(o)]
    except Exception:
        return None


def run_ad(op, transform, kind) -> Result:
    """Note [Conformance suite], vjp / jvp against torch.func with the same random directions."""
    import functransforms as ft

    name = full_name(op)
    result = Result(name, transform_key(transform, kind))
    for dtype in grad_dtypes(op, transform, kind):
        samples = take_samples(op, dtype, (name, transform, str(dtype)), requires_grad=True)
        for j, sample in enumerate(samples):
            what = f"sample {j} {describe(sample)}"
            leaves, spec = _leaves(sample)
            if not all(_strided(x) for x in leaves):
                result.skip_sample("sparse input")
                continue
            diff = [k for k, x in enumerate(leaves) if _is_diff(x) and x.requires_grad]
            if not diff:
                result.skip_sample("no differentiable input")
                continue
            consts = [x.detach() if _is_tensor(x) else x for x in leaves]
            process = sample.output_process_fn_grad
            keep = _differentiable_outputs(op, spec, leaves, process)

            def f(*primals, consts=consts, diff=diff, spec=spec, process=process, keep=keep,
                  op=op):  # fmt: skip
                ls = _clone(consts)
                for k, p in zip(diff, primals):
                    ls[k] = p
                out = process(_call(op, spec, ls))
                floats = [o for o in tpt.tree_leaves(out) if _is_diff(o)]
                return tuple(o for o, k in zip(floats, keep or [True] * len(floats)) if k)

            # Note [Conformance references]: the oracle may differentiate a reference of op
            ref_f = functools.partial(f, op=oracle_op(op, name, kind))

            def primals(consts=consts, diff=diff):
                return tuple(consts[k].clone() for k in diff)

            gen = torch.Generator().manual_seed(_seed_of(name, transform, str(dtype), j))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    if transform == "vjp":
                        ref_out, ref_fn = torch.func.vjp(ref_f, *primals())
                        if not ref_out:
                            result.skip_sample("no floating output")
                            continue
                        cts = tuple(_randn_like(o, gen) for o in ref_out)
                        ref = (ref_out, ref_fn(cts))
                    else:
                        p = primals()
                        tangents = tuple(_randn_like(x, gen) for x in p)
                        ref = torch.func.jvp(ref_f, p, tangents)
                        if not ref[0]:
                            result.skip_sample("no floating output")
                            continue
                except Exception:
                    result.skip_sample(f"torch.func.{transform} raises")
                    continue
                try:
                    if transform == "vjp":
                        out, fn = ft.vjp(f, *primals())
                        ours = (out, fn(cts))
                    else:
                        ours = ft.jvp(f, primals(), tangents)
                except Exception as e:
                    result.fail(classify_exception(e), f"{what}: {_short(e)}")
                    continue
            parts = ("output", "cotangents" if transform == "vjp" else "tangents")
            for part, a, b in zip(parts, ours, ref):
                bad = compare(tuple(a), tuple(b), f"{what}: {transform} {part}")
                if bad:
                    result.fail(*bad)
                    break
            else:
                result.compared += 1
    return result


# -- the test body --------------------------------------------------------------------------


def params(transform, expected_table):
    """pytest params (op full name, kind, expected category), expected failures as strict xfails."""
    out = []
    for name, kind in cases(transform):
        expected = expected_table.get((name, transform_key(transform, kind)))
        marks = []
        if expected is not None and name not in SKIP:
            marks.append(pytest.mark.xfail(strict=True, raises=ConformanceFailure, reason=expected))
        out.append(pytest.param(name, kind, expected, marks=marks, id=f"{name}-{kind}"))
    return out


def run_case(transform, name, kind, expected):
    started = time.perf_counter()
    op = op_db()[name]
    if name in SKIP:
        result = Result(name, transform_key(transform, kind), skip_reason=SKIP[name])
        result.record(0.0)
        pytest.skip(SKIP[name])
    seed_all(name, transform, kind)
    if transform == "vmap":
        result = run_vmap(op, kind)
    elif transform in COMPOSITIONS:
        from conformance_compositions import run_composition

        result = run_composition(op, transform, kind)
    else:
        result = run_ad(op, transform, kind)
    conclude(result, expected, started)
