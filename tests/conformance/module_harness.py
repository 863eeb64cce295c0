"""The module conformance harness: our transforms against torch.func on PyTorch's module_db.

Note [Module conformance]
    ``torch.testing._internal.common_modules.module_db`` lists ~114 ``nn.Module`` classes with
    constructors and forward inputs (``ModuleInput``). For each module (in training and in eval
    mode where ``train_and_eval_differ``), each check below runs one function written once
    against an *api* (a namespace with ``grad``, ``vmap``, ``jvp``, ``jacrev``, ``jacfwd``,
    ``functional_call``, ``stack_module_state``) three times:

    * ``OURS``  functransforms;
    * ``FUNC``  torch.func, the oracle;
    * ``LOOP``  plain autograd and Python loops (``torch.autograd.grad``, a double-backward jvp,
                ``torch.autograd.functional.jacobian``, a loop over examples that stacks), the
                oracle of last resort, run only where torch.func raises.

    Verdicts (``compare``): both compute -> the values (and the buffers the call wrote, e.g.
    BatchNorm's running statistics) must agree to float64 tolerance; torch.func computes and
    we raise -> a crash (fails); torch.func raises -> we must raise too, or compute what
    LOOP computes (a value torch.func cannot give must be proven by the loop; when the loop
    raises as well, ours must raise).

    Each api call runs on its own deep copy of the module (calls write buffers), from the same
    seed, so a module that draws random numbers sees the same stream wherever the draw is the
    same op (module_db's dropouts have p=0; test_random_module_* switch them on and check
    grad, jvp and vmap's randomness modes against torch.func's draws).

    Inputs: at most ``MAX_INPUTS`` per module, spread evenly over the list (the list of
    CrossEntropyLoss has 105, LinearCrossEntropyLoss 857), generated from a seed derived from
    the module's name, so each test is the same in any order or xdist worker.
"""

from __future__ import annotations

import copy
import types
import zlib

import torch
import torch.func as tf
import torch.utils._pytree as tpt

import functransforms as ft

B = 3  # examples in every batch
MAX_INPUTS = 3  # ModuleInputs per module and check
SMALL = 256  # jacrev / jacfwd: the tensor differentiated has at most this many elements
PROJECT = 32  # and they see at most this many outputs (random projections of larger ones)
TOL = {"atol": 1e-7, "rtol": 1e-7, "equal_nan": True}  # float64; NaN where torch has NaN


def seed_of(*parts) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode()) & 0x7FFFFFFF


_DB = None


def module_db():
    global _DB
    if _DB is None:
        from torch.testing._internal.common_modules import module_db as db

        _DB = {mi.name: mi for mi in db}
    return _DB


def case_ids():
    """``nn.Conv2d`` or, where training and eval differ, ``nn.BatchNorm1d-train`` / ``-eval``."""
    out = []
    for name, mi in module_db().items():
        if mi.train_and_eval_differ:
            out += [f"{name}-train", f"{name}-eval"]
        else:
            out.append(name)
    return out


def _split_id(case_id):
    for mode, training in (("-train", True), ("-eval", False)):
        if case_id.endswith(mode):
            return case_id[: -len(mode)], training
    return case_id, True  # modes do not differ: the module's default


def _spread(n, k):
    if n <= k:
        return list(range(n))
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


class Case:
    """One module (built, lazy modules materialized) and one forward input."""

    def __init__(self, case_id, module, args, kwargs, desc):
        self.id, self.module, self.desc = case_id, module, desc
        self.leaves, self.spec = tpt.tree_flatten((args, kwargs))
        # tensor leaves take part in vmap; float ones are also differentiated
        self.tensor_at = [i for i, x in enumerate(self.leaves) if isinstance(x, torch.Tensor)]
        self.float_at = [i for i in self.tensor_at if self.leaves[i].dtype.is_floating_point]
        self.params = {k: v.detach() for k, v in module.named_parameters()}

    def __repr__(self):
        return f"{self.id}[{self.desc}]"

    def rebuild(self, tensors, at):
        leaves = list(self.leaves)
        for i, t in zip(at, tensors):
            leaves[i] = t
        return tpt.tree_unflatten(leaves, self.spec)

    @property
    def floats(self):
        return [self.leaves[i] for i in self.float_at]

    @property
    def tensors(self):
        return [self.leaves[i] for i in self.tensor_at]


def cases(case_id):
    """The ``Case``s of one case id (at most ``MAX_INPUTS``)."""
    name, training = _split_id(case_id)
    mi = module_db()[name]
    torch.manual_seed(seed_of(case_id))
    inputs = mi.module_inputs_func(
        mi, device="cpu", dtype=torch.float64, requires_grad=False, training=training
    )
    inputs = [x for x in inputs if x.forward_input is not None]
    out = []
    for i in _spread(len(inputs), MAX_INPUTS):
        mod_input = inputs[i]
        c = mod_input.constructor_input
        torch.manual_seed(seed_of(case_id, i))
        m = mi.module_cls(*c.args, **c.kwargs).to(dtype=torch.float64)
        m.train(training)
        f = mod_input.forward_input
        if any(isinstance(x, torch.nn.parameter.UninitializedParameter) for x in m.parameters()):
            with torch.no_grad():  # lazy modules: the first call materializes the parameters
                m(*f.args, **f.kwargs)
            m = copy.deepcopy(m)  # a fresh module without the buffers the call wrote
        out.append(Case(case_id, m, f.args, f.kwargs, getattr(mod_input, "desc", "") or str(i)))
    return out


# -- the three apis ---------------------------------------------------------------------------


def _is_float(x):
    return isinstance(x, torch.Tensor) and x.dtype.is_floating_point


def _loop_grad(f, argnums=0, has_aux=False):
    """grad by ``torch.autograd.grad`` (the oracle of last resort)."""

    def wrapper(*args):
        nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
        args = list(args)
        diff = {}
        for n in nums:
            args[n] = tpt.tree_map(
                lambda x: x.detach().requires_grad_() if _is_float(x) else x, args[n]
            )
            diff[n] = args[n]
        with torch.enable_grad():
            out = f(*args)
            leaves = [x for n in nums for x in tpt.tree_leaves(diff[n]) if _is_float(x)]
            gs = torch.autograd.grad(out, leaves, allow_unused=True)
        gs = iter([torch.zeros_like(x) if g is None else g for x, g in zip(leaves, gs)])
        res = tuple(tpt.tree_map(lambda x: next(gs) if _is_float(x) else x, diff[n]) for n in nums)
        return res[0] if isinstance(argnums, int) else res

    return wrapper


def _loop_vmap(f, in_dims=0, out_dims=0, randomness="error"):
    """vmap as a Python loop over the examples, stacked."""

    def wrapper(*args):
        dims = in_dims if isinstance(in_dims, tuple) else (in_dims,) * len(args)
        flat_args, spec = tpt.tree_flatten(list(args))
        flat_dims = []
        for a, d in zip(args, dims):
            n = len(tpt.tree_leaves(a))
            flat_dims += [d] * n if d is None or isinstance(d, int) else tpt.tree_leaves(d)
        size = {x.shape[d] for x, d in zip(flat_args, flat_dims) if d is not None}
        (size,) = size
        outs = []
        for b in range(size):
            # contiguous examples, as a user's separate tensors (Note [Module conformance])
            ex = [
                x if d is None else x.select(d, b).contiguous()
                for x, d in zip(flat_args, flat_dims)
            ]
            outs.append(f(*tpt.tree_unflatten(ex, spec)))
        leaves = [tpt.tree_leaves(o) for o in outs]
        stacked = [torch.stack(col, out_dims) for col in zip(*leaves)]
        return tpt.tree_unflatten(stacked, tpt.tree_structure(outs[0]))

    return wrapper


def _loop_jvp(f, primals, tangents):
    """jvp from one forward (a training-mode forward writes buffers) by the double-backward
    trick; where a kernel has no double backward (flash attention on CPU), by the rows of the
    reverse-mode Jacobian (one backward per output element) contracted with the tangents."""
    ps = [p.detach().requires_grad_() for p in primals]
    with torch.enable_grad():
        out = f(*ps)
        try:
            us = [torch.zeros_like(o, requires_grad=True) for o in out]
            gs = torch.autograd.grad(out, ps, us, create_graph=True, allow_unused=True)
            pairs = [(g, t) for g, t in zip(gs, tangents) if g is not None]
            tangents_out = torch.autograd.grad(
                [g for g, _ in pairs], us, [t for _, t in pairs], allow_unused=True
            )
            tangents_out = tuple(
                torch.zeros_like(o) if t is None else t for o, t in zip(out, tangents_out)
            )
        except (RuntimeError, NotImplementedError):
            tangents_out = tuple(_jvp_by_rows(o, ps, tangents) for o in out)
    return tuple(o.detach() for o in out), tangents_out


def _jvp_by_rows(o, ps, tangents):
    flat = o.reshape(-1)
    rows = []
    for i in range(flat.numel()):
        gs = torch.autograd.grad(flat[i], ps, retain_graph=True, allow_unused=True)
        rows.append(sum((g * t).sum() for g, t in zip(gs, tangents) if g is not None))
    return torch.stack(rows).reshape(o.shape) if rows else torch.zeros_like(o)


def _loop_jac(f, argnums=0):
    def wrapper(*args):
        return torch.autograd.functional.jacobian(lambda x: f(*args[:argnums], x), args[argnums])

    return wrapper


OURS = types.SimpleNamespace(
    name="functransforms",
    grad=ft.grad,
    vmap=ft.vmap,
    jvp=ft.jvp,
    jacrev=ft.jacrev,
    jacfwd=ft.jacfwd,
    functional_call=ft.functional_call,
    stack_module_state=ft.stack_module_state,
)
FUNC = types.SimpleNamespace(
    name="torch.func",
    grad=tf.grad,
    vmap=tf.vmap,
    jvp=tf.jvp,
    jacrev=tf.jacrev,
    jacfwd=tf.jacfwd,
    functional_call=tf.functional_call,
    stack_module_state=tf.stack_module_state,
)


def _soft_margin_loss(module, x, y):
    """torch's kernel refuses a gradient for the target (derivatives.yaml: not_implemented);
    the formula has one: log(1 + exp(-y x)), reduced."""
    loss = torch.log1p(torch.exp(-y * x))
    return {"none": loss, "mean": loss.mean(), "sum": loss.sum()}[module.reduction]


# The loop of plain autograd computes these modules by their formula, where torch's kernel
# has no derivative that ours computes (torch_func_differences.md 37).
FORMULAS = {torch.nn.SoftMarginLoss: _soft_margin_loss}


def _loop_functional_call(module, params, args, kwargs):
    formula = FORMULAS.get(type(module))
    if formula is not None:
        return formula(module, *args, **kwargs)
    return tf.functional_call(module, params, args, kwargs)


LOOP = types.SimpleNamespace(
    name="loop",
    grad=_loop_grad,
    vmap=_loop_vmap,
    jvp=_loop_jvp,
    jacrev=_loop_jac,
    jacfwd=_loop_jac,
    functional_call=_loop_functional_call,  # no transform: swaps tensors into the module
    stack_module_state=tf.stack_module_state,
)


# -- the checks -------------------------------------------------------------------------------
# Each check is ``check(api, case, module)`` -> a pytree of tensors; ``module`` is the api's own
# copy of ``case.module`` (its buffers are compared afterwards).


def floats_out(out):
    """The float tensors among a module's outputs (RNN: (output, h); LSTM: (output, (h, c)))."""
    return tuple(x for x in tpt.tree_leaves(out) if _is_float(x))


def loss_of(out):
    return sum(x.sum() for x in floats_out(out))


def _call(api, case, module, params, tensors, at):
    args, kwargs = case.rebuild(tensors, at)
    return api.functional_call(module, params, tuple(args), kwargs)


def check_grad(api, case, module):
    """grad of sum(outputs) w.r.t. the parameters and the float inputs."""

    def f(params, xs):
        return loss_of(_call(api, case, module, params, xs, case.float_at))

    return api.grad(f, argnums=(0, 1))(case.params, case.floats)


def batch_of(case, seed, batch_dim=0):
    """``B`` perturbed copies of the tensor inputs, stacked at ``batch_dim`` (at 0 where a
    leaf is 0-d); returns (tensors, in_dims) in ``case.tensor_at`` order. Example k's floats
    move by ~1e-3 k; its integers (targets, indices, lengths) are rolled by k places, so a
    rule that mixes up examples shows in them too, while every value stays one the module
    accepts (the same multiset)."""
    gen = torch.Generator().manual_seed(seed)
    out, dims = [], []
    for x in case.tensors:
        copies = [
            x + 1e-3 * k * torch.randn(x.shape, generator=gen, dtype=x.dtype)
            if x.dtype.is_floating_point
            else x.reshape(-1).roll(k).reshape(x.shape)
            for k in range(B)
        ]
        d = batch_dim if x.dim() >= batch_dim else 0
        out.append(torch.stack(copies, d))
        dims.append(d)
    return out, dims


def check_per_sample_grad(api, case, module, batch_dim=0):
    """vmap(grad(loss, argnums=(0, 1)), in_dims=(None, dims, dims)): per-example gradients of
    the parameters and the float inputs."""
    xs, dims = batch_of(case, seed_of(case.id, "batch"), batch_dim)
    is_float = [i in case.float_at for i in case.tensor_at]
    fl = [x for x, f in zip(xs, is_float) if f]
    other = [x for x, f in zip(xs, is_float) if not f]

    def loss(params, fl, other):
        fl, other = iter(fl), iter(other)
        ts = [next(fl) if f else next(other) for f in is_float]
        return loss_of(_call(api, case, module, params, ts, case.tensor_at))

    in_dims = (
        None,
        [d for d, f in zip(dims, is_float) if f],
        [d for d, f in zip(dims, is_float) if not f],
    )
    return api.vmap(api.grad(loss, argnums=(0, 1)), in_dims=in_dims)(case.params, fl, other)


def _tangents(tree, seed):
    gen = torch.Generator().manual_seed(seed)
    return tpt.tree_map(lambda x: torch.randn(x.shape, generator=gen, dtype=x.dtype), tree)


def check_jvp(api, case, module):
    """jvp of the forward w.r.t. the parameters and the float inputs, random tangents."""
    names, n = list(case.params), len(case.params)

    def f(*ps):
        params = dict(zip(names, ps[:n]))
        return floats_out(_call(api, case, module, params, ps[n:], case.float_at))

    primals = (*case.params.values(), *case.floats)
    return api.jvp(f, primals, _tangents(primals, seed_of(case.id, "jvp")))


def small_input(case):
    """What jacrev / jacfwd differentiate: ``("input", k)``, the smallest float input (k in
    ``case.float_at`` order) if small enough, else ``("param", name)``, the smallest parameter
    if small enough, else None."""
    sizes = [(x.numel(), k) for k, x in enumerate(case.floats) if x.numel() <= SMALL]
    if sizes:
        return "input", min(sizes)[1]
    sizes = [(p.numel(), n) for n, p in case.params.items() if p.numel() <= SMALL]
    return ("param", min(sizes)[1]) if sizes else None


def check_jac(api, case, module, which):
    """jacrev / jacfwd of the forward w.r.t. one small float input (or parameter)."""
    kind, k = small_input(case)
    start = case.floats[k] if kind == "input" else case.params[k]

    def f(v):
        xs, params = list(case.floats), dict(case.params)
        if kind == "input":
            xs[k] = v
        else:
            params[k] = v
        outs = floats_out(_call(api, case, module, params, xs, case.float_at))
        flat = torch.cat([o.reshape(-1) for o in outs])
        if flat.numel() <= PROJECT:
            return outs
        # a large output is seen through PROJECT fixed random directions: jacrev's cost
        # follows the number of outputs (ConvTranspose3d: thousands)
        gen = torch.Generator().manual_seed(flat.numel())
        P = torch.randn(PROJECT, flat.numel(), generator=gen, dtype=flat.dtype)
        return P @ flat

    return getattr(api, which)(f)(start)


def check_vmap(api, case, module, batch_dim=0):
    """vmap of the forward over stacked (perturbed) inputs."""
    xs, dims = batch_of(case, seed_of(case.id, "batch"), batch_dim)

    def f(ts):
        return floats_out(_call(api, case, module, case.params, ts, case.tensor_at))

    return api.vmap(f, in_dims=(dims,))(xs)


def check_ensemble(api, case, module):
    """vmap(functional_call) over stack_module_state of B perturbed copies of the module;
    returns the outputs and the stacked buffers after the call (training writes them)."""
    gen = torch.Generator().manual_seed(seed_of(case.id, "ensemble"))
    copies = []
    for k in range(B):
        m = copy.deepcopy(module)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.1 * k * torch.randn(p.shape, generator=gen, dtype=p.dtype))
        copies.append(m)
    params, buffers = api.stack_module_state(copies)

    def f(p, b, ts):
        return floats_out(_call(api, case, module, (p, b), ts, case.tensor_at))

    out = api.vmap(f, in_dims=(0, 0, None))(params, buffers, case.tensors)
    return out, buffers


CHECKS = {
    "grad": check_grad,
    "per_sample_grad": check_per_sample_grad,
    "per_sample_grad_dim1": lambda api, case, m: check_per_sample_grad(api, case, m, 1),
    "jvp": check_jvp,
    "jacrev": lambda api, case, m: check_jac(api, case, m, "jacrev"),
    "jacfwd": lambda api, case, m: check_jac(api, case, m, "jacfwd"),
    "vmap": check_vmap,
    "vmap_dim1": lambda api, case, m: check_vmap(api, case, m, 1),
    "ensemble": check_ensemble,
}


def applicable(check, case):
    """Why ``check`` cannot apply to ``case`` (None when it can)."""
    if check == "ensemble" and not case.params:
        return "no parameters"
    if check != "ensemble" and not case.params and not case.float_at:
        return "no parameters or float inputs"
    if check.startswith(("vmap", "per_sample")) and not case.tensor_at:
        return "no tensor input"
    if check == "vmap_dim1" or check == "per_sample_grad_dim1":
        if all(x.dim() == 0 for x in case.tensors):
            return "only 0-d inputs (dim 1 is dim 0)"
    if check in ("jacrev", "jacfwd") and small_input(case) is None:
        return f"no float input or parameter of at most {SMALL} elements"
    return None


# -- running and comparing ----------------------------------------------------------------------


class Outcome:
    def __init__(self, value=None, error=None, buffers=None):
        self.value, self.error, self.buffers = value, error, buffers

    def __repr__(self):
        return f"raised {type(self.error).__name__}: {self.error}" if self.error else "computed"


def run(api, check, case):
    module = copy.deepcopy(case.module)
    torch.manual_seed(seed_of(case.id, check, "run"))
    try:
        value = CHECKS[check](api, case, module)
    except Exception as e:  # noqa: BLE001 (the verdict compares who raises)
        return Outcome(error=e)
    buffers = {k: v.clone() for k, v in module.named_buffers()}
    return Outcome(value=value, buffers=buffers)


def _assert_same(ours, ref, what):
    a, sa = tpt.tree_flatten(ours)
    b, sb = tpt.tree_flatten(ref)
    assert sa == sb, f"{what}: output structure differs:\nours {sa}\nref  {sb}"
    for i, (x, y) in enumerate(zip(a, b)):
        if isinstance(y, torch.Tensor):
            assert isinstance(x, torch.Tensor), f"{what}: leaf {i} is {type(x).__name__}"
            assert x.shape == y.shape, f"{what}: leaf {i} shape {x.shape} != {y.shape}"
            assert x.dtype == y.dtype, f"{what}: leaf {i} dtype {x.dtype} != {y.dtype}"
            torch.testing.assert_close(x, y, **TOL, msg=lambda m, i=i: f"{what}: leaf {i}: {m}")
        else:
            assert x == y, f"{what}: leaf {i}: {x!r} != {y!r}"


# (case id, check) -> why torch.func's value is wrong: there ours is compared with LOOP, and
# torch.func must still differ from LOOP (the entry goes when torch is fixed).
TORCH_FUNC_WRONG: dict[tuple[str, str], str] = {}


def _lce_zero_tangent(check):
    return {
        ("nn.LinearCrossEntropyLoss", check): (
            "torch.func's forward mode returns a zero tangent through the chunked "
            "torch_nn::_linear_cross_entropy_batch_chunked op (no forward formula), "
            "torch_func_differences.md 37"
        )
    }


TORCH_FUNC_WRONG.update(_lce_zero_tangent("jvp"))
TORCH_FUNC_WRONG.update(_lce_zero_tangent("jacfwd"))
TORCH_FUNC_WRONG[("nn.CTCLoss", "vmap_dim1")] = TORCH_FUNC_WRONG[
    ("nn.CTCLoss", "per_sample_grad_dim1")
] = (
    "torch's ctc_loss kernel misreads non-contiguous 1-d targets (torch 2.13 and 2.15), and "
    "torch.func's per-example fallback passes it the strided slices: torch_func_differences.md 37"
)


def _all_empty(value) -> bool:
    leaves = torch.utils._pytree.tree_leaves(value)
    return bool(leaves) and all(isinstance(t, torch.Tensor) and t.numel() == 0 for t in leaves)


def compare(check, case):
    """Run ``check`` on ``case`` with ours and the oracles; raise AssertionError on a
    disagreement. Returns "both compute" / "both raise" / "loop proves ours" / "torch.func
    wrong" (a TORCH_FUNC_WRONG entry, proven: ours agrees with the loop, torch.func does not)."""
    ours = run(OURS, check, case)
    func = run(FUNC, check, case)
    what = f"{check} on {case!r}"
    wrong = TORCH_FUNC_WRONG.get((case.id, check))
    if func.error is None and wrong is None:
        if ours.error is not None:
            raise AssertionError(
                f"{what}: torch.func computes, ours raised "
                f"{type(ours.error).__name__}: {ours.error}"
            ) from ours.error
        _assert_same(ours.value, func.value, what + " (vs torch.func)")
        _assert_same(ours.buffers, func.buffers, what + " (buffers written, vs torch.func)")
        return "both compute"
    if func.error is not None and ours.error is not None:
        return "both raise"
    loop = run(LOOP, check, case)
    verdict = "loop proves ours"
    if wrong is not None and func.error is None and loop.error is None:
        try:  # the test checks that the entry is true for one input at least
            _assert_same(func.value, loop.value, "torch.func vs loop")
        except AssertionError:
            verdict = "torch.func wrong"
    if ours.error is not None:
        raise AssertionError(
            f"{what}: the loop of autograd computes, ours raised "
            f"{type(ours.error).__name__}: {ours.error}"
        ) from ours.error
    if loop.error is not None and _all_empty(ours.value):
        # an empty input (module_db's *_empty cases): functorch and the loop stumble over the
        # zero-size batch (`reshape(0, -1)`, `stack([])`); ours returns results with no
        # elements, so no number can be wrong
        return "ours computes an empty result"
    if loop.error is not None:
        raise AssertionError(
            f"{what}: torch.func raised ({func}) and so does a loop of plain autograd "
            f"({loop}), but ours computed a value"
        )
    _assert_same(ours.value, loop.value, what + " (torch.func raised; vs a loop of autograd)")
    _assert_same(ours.buffers, loop.buffers, what + " (buffers written, vs a loop of autograd)")
    return verdict
