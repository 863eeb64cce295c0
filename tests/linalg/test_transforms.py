"""grad, vjp, jvp and vmap through every operator x operation, against the dense computation.

Parametrized over the transform implementation: torch.func (the oracle, always) and
functransforms (our transforms; each one runs as soon as the core exports it, and is reported
as skipped with that reason until then). Operators are built *inside* the transformed function
from its tensor arguments, as user code does.
"""

import importlib

import functransforms.linalg as L
import pytest
import torch
from linalg_cases import CASES, DT


def _transforms(name):
    if name == "torch.func":
        import torch.func as mod
    else:
        mod = importlib.import_module("functransforms")
    return mod


IMPLS = ["torch.func", "functransforms"]


def _get(impl, transform):
    mod = _transforms(impl)
    fn = getattr(mod, transform, None)
    if fn is None:
        pytest.skip(f"{impl}.{transform} does not exist yet (the transform core is in progress)")
    return fn


# operation name -> (applies to case?, uses b?, fn(op_or_dense, b, is_dense))
def _logdet(A, b, dense):
    return torch.logdet(A) if not dense else torch.logdet(A)


def _slogabs(A, b, dense):
    return torch.linalg.slogdet(A)[1]


def _chol_matmul(A, b, dense):
    Lf = torch.linalg.cholesky(A)
    return Lf @ b


OPS = {
    "matmul": (lambda c: True, True, lambda A, b, d: A @ b[..., : A.shape[-1]]),
    "rmatmul": (lambda c: True, True, lambda A, b, d: b[..., : A.shape[-2]] @ A),
    "solve": (lambda c: c.invertible, True, lambda A, b, d: torch.linalg.solve(A, b)),
    "inv_matmul": (lambda c: c.invertible, True, lambda A, b, d: torch.linalg.inv(A) @ b),
    "logdet": (lambda c: c.pd, False, _logdet),
    "slogdet": (lambda c: c.invertible and not c.pd, False, _slogabs),
    "trace": (
        lambda c: c.name != "lowrank_rect",
        False,
        lambda A, b, d: A.diagonal(dim1=-2, dim2=-1).sum(-1),
    ),
    "diagonal": (lambda c: True, False, lambda A, b, d: A.diagonal(dim1=-2, dim2=-1)),
    "cholesky": (lambda c: c.pd, True, _chol_matmul),
    "eigvalsh": (lambda c: c.sym, False, lambda A, b, d: torch.linalg.eigvalsh(A)),
    "frobenius": (lambda c: True, False, lambda A, b, d: torch.linalg.matrix_norm(A)),
}


def _params():
    out = []
    for case in CASES:
        for name, (applies, uses_b, _) in OPS.items():
            if not applies(case):
                continue
            if not uses_b and case.params(torch.Generator().manual_seed(0)) == ():
                continue  # nothing to differentiate or batch
            out.append(pytest.param(case, name, id=f"{case.name}-{name}"))
    return out


PARAMS = _params()


def _fns(case, opname):
    fn = OPS[opname][2]

    def structured(params, b):
        return fn(case.build(*params), b, False)

    def dense(params, b):
        return fn(case.dense(*params), b, True)

    return structured, dense


def _inputs(case, seed=0):
    g = torch.Generator().manual_seed(seed + 100)
    params = case.params(torch.Generator().manual_seed(seed))
    n = max(case.build(*params).shape[-2:])
    b = torch.randn(n, generator=g, dtype=DT)
    return params, b


def _like(tree, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.utils._pytree.tree_map(
        lambda t: torch.randn(t.shape, generator=g, dtype=t.dtype), tree
    )


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)


# Known limitations of torch.func's forward mode, each with its reason (none so far).
JVP_XFAIL = {}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case,opname", PARAMS)
def test_grad(impl, case, opname):
    grad = _get(impl, "grad")
    structured, dense = _fns(case, opname)
    params, b = _inputs(case)
    w = _like(dense(params, b), 7)

    def loss(f):
        return lambda p, b: (f(p, b) * w).sum()

    g = grad(loss(structured), argnums=(0, 1))(params, b)
    e = torch.func.grad(loss(dense), argnums=(0, 1))(params, b)
    close(g, e)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case,opname", PARAMS)
def test_vjp(impl, case, opname):
    vjp = _get(impl, "vjp")
    structured, dense = _fns(case, opname)
    params, b = _inputs(case)
    out, fn = vjp(structured, params, b)
    eout, efn = torch.func.vjp(dense, params, b)
    close(out, eout)
    ct = _like(eout, 11)
    close(fn(ct), efn(ct))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case,opname", PARAMS)
def test_jvp(impl, case, opname):
    if (case.name, opname) in JVP_XFAIL:
        pytest.xfail(JVP_XFAIL[(case.name, opname)])
    jvp = _get(impl, "jvp")
    structured, dense = _fns(case, opname)
    params, b = _inputs(case)
    tangents = (_like(params, 3), _like(b, 4))
    out, t = jvp(structured, (params, b), tangents)
    eout, et = torch.func.jvp(dense, (params, b), tangents)
    close(out, eout)
    close(t, et)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case,opname", PARAMS)
def test_vmap(impl, case, opname):
    vmap = _get(impl, "vmap")
    structured, dense = _fns(case, opname)
    inputs = [_inputs(case, seed) for seed in range(3)]
    params = tuple(torch.stack([i[0][k] for i in inputs]) for k in range(len(inputs[0][0])))
    b = torch.stack([i[1] for i in inputs])
    out = vmap(structured)(params, b)
    expected = torch.stack([dense(*i) for i in inputs])
    close(out, expected)


@pytest.mark.parametrize("impl", IMPLS)
def test_vmap_in_dims_none_for_operator_params(impl):
    """vmap over right-hand sides only: the operator's tensors are unbatched (in_dims=None)."""
    vmap = _get(impl, "vmap")
    case = next(c for c in CASES if c.name == "kronecker2_pd")
    params, _ = _inputs(case)
    bs = torch.randn(4, 6, dtype=DT)
    out = vmap(lambda p, b: torch.linalg.solve(case.build(*p), b), in_dims=(None, 0))(params, bs)
    close(out, torch.linalg.solve(case.dense(*params), bs.mT).mT)


@pytest.mark.parametrize("impl", IMPLS)
def test_grad_of_grad_logdet_kronecker(impl):
    """Second order through the structured logdet: the Hessian-vector product."""
    grad = _get(impl, "grad")
    jvp = _get(impl, "jvp")
    case = next(c for c in CASES if c.name == "kronecker2_pd")
    params, _ = _inputs(case)

    def f(p):
        return torch.logdet(case.build(*p))

    def fd(p):
        return torch.logdet(case.dense(*p))

    t = _like(params, 5)
    hvp = jvp(grad(f), (params,), (t,))[1]
    ehvp = torch.func.jvp(torch.func.grad(fd), (params,), (t,))[1]
    close(hvp, ehvp)


def test_operators_are_pytrees():
    from functransforms._pytree import tree_flatten, tree_unflatten

    for case in CASES:
        params, op = case.make()
        leaves, spec = tree_flatten(op)
        assert all(isinstance(x, torch.Tensor) for x in leaves), case.name
        assert len(leaves) == len(params) + (1 if case.name == "permutation" else 0), case.name
        doubled = tree_unflatten(spec, [x * 2 if x.is_floating_point() else x for x in leaves])
        assert type(doubled) is type(op) and doubled.properties() == op.properties()
        assert doubled.shape == op.shape


def test_operators_pass_through_our_transforms_as_arguments():
    """Operators are pytrees in our namespace: our transforms take them as arguments directly
    (torch.func does not know our optree namespace, so this is checked with ours only)."""
    ft = importlib.import_module("functransforms")
    vmap, grad, jvp = (getattr(ft, n, None) for n in ("vmap", "grad", "jvp"))
    if vmap is None or grad is None or jvp is None:
        pytest.skip(
            "functransforms.vmap/grad/jvp do not exist yet (the transform core is in progress)"
        )
    g = torch.Generator().manual_seed(0)
    U = torch.randn(3, 6, 2, generator=g, dtype=DT)
    d = torch.rand(3, 6, generator=g, dtype=DT) + 1
    b = torch.randn(6, generator=g, dtype=DT)
    K = L.LowRankPlusDiagonalOperator(U, d, positive_definite=True)  # batch of 3
    close(vmap(lambda K, b: K @ b, in_dims=(0, None))(K, b), K.to_dense() @ b)
    K0 = K[0]
    gK = grad(lambda K: (K @ b).sum())(K0)  # a cotangent with the operator's structure
    assert type(gK) is L.LowRankPlusDiagonalOperator
    close(gK.d, b)  # d/dd_i sum_j (d_j b_j + ...) = b_i
    close(
        gK.U,
        torch.outer(b, torch.ones(6, dtype=DT)) @ U[0]
        + torch.outer(torch.ones(6, dtype=DT), b) @ U[0],
    )
    # a tangent is an operator of the same class and declared properties (the same treespec)
    T = L.LowRankPlusDiagonalOperator(
        torch.zeros_like(U[0]), torch.ones(6, dtype=DT), positive_definite=True
    )
    _, t = jvp(lambda K: K @ b, (K0,), (T,))
    close(t, b)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("transform", ["jacrev", "jacfwd"])
def test_jacobians_through_structured_solve(impl, transform):
    jac = _get(impl, transform)
    case = next(c for c in CASES if c.name == "lowrank_plus_diag_pd")
    params, b = _inputs(case)
    structured, dense = _fns(case, "solve")
    J = jac(structured, argnums=(0, 1))(params, b)
    E = torch.func.jacrev(dense, argnums=(0, 1))(params, b)
    close(J, E)


def test_pd_logdet_derivatives_are_one_inverse_and_compose():
    """Note [Differentiating log det]: the Kronecker logdet's derivative goes through
    pd_logdet_sum (vjp w ct A^-1, jvp w tr(A^-1 dA)); second order, forward mode and vmap of
    grad must still match torch.func on the same (Cholesky-based) computation."""
    import functransforms.linalg as L

    import functransforms as ft

    g = torch.Generator().manual_seed(0)

    def spd(n, dtype=torch.float64):
        M = torch.randn(n, n, generator=g, dtype=dtype)
        return M @ M.mH / n + torch.eye(n, dtype=dtype)

    A, B = spd(3), spd(4)
    ours = lambda A, B: torch.logdet(L.KroneckerOperator(A, B, positive_definite=True))  # noqa: E731
    chol = lambda A, B: (
        8 * torch.linalg.cholesky(A).diagonal().log().sum()
        + 6 * torch.linalg.cholesky(B).diagonal().log().sum()
    )  # noqa: E731
    close(ft.grad(ours, argnums=(0, 1))(A, B), torch.func.grad(chol, argnums=(0, 1))(A, B))
    close(ft.hessian(ours)(A, B), torch.func.hessian(chol)(A, B))
    close(
        ft.jvp(ours, (A, B), (B[:3, :3], A.sum() * B))[1],
        torch.func.jvp(chol, (A, B), (B[:3, :3], A.sum() * B))[1],
    )
    As = torch.stack([spd(3) for _ in range(5)])
    close(
        ft.vmap(ft.grad(ours), in_dims=(0, None))(As, B),
        torch.func.vmap(torch.func.grad(chol), in_dims=(0, None))(As, B),
    )
    C = spd(3, torch.complex128)
    Bc = B.to(torch.complex128)
    close(
        ft.grad(lambda A: torch.logdet(L.KroneckerOperator(A, Bc, positive_definite=True)).real)(C),
        torch.func.grad(lambda A: torch.logdet(torch.kron(A, Bc)).real)(C),
    )
