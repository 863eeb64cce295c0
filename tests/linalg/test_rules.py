"""Structure rules are single-dispatch functions: users register rules for their own operators,
precedence is the MRO (unary) and left-then-right (binary) (Note [Dispatch precedence]), and
the package keeps no function-local imports (Note [The base class's import cycles])."""

import ast
import pathlib

import functransforms.linalg as L
import pytest
import torch
from functransforms.linalg import _rules

import functransforms as ft

DT = torch.float64
CALLS: list = []


class Reflection(L.LinearOperator):
    """``I - 2 v v^T / v^T v`` through ``_matmul`` only."""

    _tree_fields = ("v",)
    _core_ndims = (1,)

    def __init__(self, v, **props):
        self.v = v
        n = v.shape[-1]
        props.update(symmetric=True, unitary=True)
        super().__init__(v.shape[:-1] + (n, n), v.dtype, v.device, **props)

    def _matmul(self, X):
        u = self.v.unsqueeze(-1)
        return X - 2 * u @ (u.mT @ X) / (u.mT @ u)


class RegisteredReflection(Reflection):
    pass


class SubReflection(RegisteredReflection):
    pass


@L.solve.register(RegisteredReflection)
def _solve_registered(A, B):
    CALLS.append(("solve", type(A).__name__))
    return A._matmul(B)  # H^{-1} = H


@L.inv.register(RegisteredReflection)
def _inv_registered(A):
    CALLS.append(("inv", type(A).__name__))
    return A  # H^{-1} = H


@L.inv.register(SubReflection)
def _inv_sub(A):
    CALLS.append(("inv-sub", type(A).__name__))
    return A


@L.trace.register(RegisteredReflection)
def _trace_registered(A):
    CALLS.append(("trace", type(A).__name__))
    return torch.full(A.batch_shape, A.shape[-1] - 2.0, dtype=A.dtype)  # tr H = n - 2


def _v(n=6, seed=0, batch=()):
    return torch.randn(*batch, n, dtype=DT, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(autouse=True)
def _clear():
    CALLS.clear()


def test_public_functions_expose_the_rule_registries():
    for name in ("solve", "inv", "slogdet", "cholesky", "eigh", "svd", "trace", "diagonal"):
        assert getattr(L, name).register == getattr(_rules, name).register
        assert getattr(L, name).dispatch(L.LinearOperator) is getattr(_rules, name).dispatch(
            L.LinearOperator
        )
    assert L.matmul.register == _rules.matmul.register
    assert L.matmul.register_right == _rules.rmatmul.register
    assert L.add.register == _rules.add.register


def test_registered_rules_are_used_and_the_dense_default_otherwise():
    v, b = _v(), _v(seed=1)
    H, Hr = Reflection(v), RegisteredReflection(v)
    want = torch.linalg.solve(H.to_dense(), b)
    torch.testing.assert_close(torch.linalg.solve(H, b), want)  # the dense default
    assert CALLS == []
    torch.testing.assert_close(torch.linalg.solve(Hr, b), want)
    torch.testing.assert_close(torch.trace(Hr), torch.trace(Hr.to_dense()))
    assert L.inv(Hr) is Hr
    assert CALLS == [
        ("solve", "RegisteredReflection"),
        ("trace", "RegisteredReflection"),
        ("inv", "RegisteredReflection"),
    ]
    assert type(L.inv(H)).__name__ == "TransposeOperator"  # the default for unitary A: A^H
    torch.testing.assert_close(L.inv(H).to_dense(), torch.linalg.inv(H.to_dense()))


def test_unary_precedence_is_the_mro():
    v = _v()
    S = SubReflection(v)
    assert L.inv(S) is S and torch.linalg.solve(S, v) is not None
    # SubReflection's own inv rule wins; solve is inherited from RegisteredReflection.
    assert CALLS == [("inv-sub", "SubReflection"), ("solve", "SubReflection")]


def test_binary_precedence_left_then_right_then_lazy():
    v = _v()
    H = RegisteredReflection(v)
    D = L.DiagonalOperator(torch.rand(6, dtype=DT) + 1)
    I6 = L.IdentityOperator(6, dtype=DT)
    # No rule for Reflection @ Diagonal on either side: a lazy product.
    assert type(H @ D).__name__ == "ProductOperator"
    # The right operand's rule: A @ I = A (registered with matmul.register_right).
    assert (H @ I6) is H
    # The left operand's rule is asked first: Diagonal @ Diagonal stays diagonal.
    assert type(D @ D).__name__ == "DiagonalOperator"
    # Sums: the left operand's add rules, then the right operand's with the operands swapped.
    U = torch.randn(6, 2, dtype=DT)
    assert type(L.LowRankOperator(U) + D).__name__ == "LowRankPlusDiagonalOperator"
    assert type(D + L.LowRankOperator(U)).__name__ == "LowRankPlusDiagonalOperator"
    assert type(H + D).__name__ == "SumOperator"


def test_a_user_binary_rule_is_used():
    class Rotation(Reflection):
        pass

    @L.matmul.register(Rotation)
    def _matmul_rotation(A, B):
        # R R^T = I for a unitary R given as its own transpose (here: a reflection)
        if B is A:
            return L.IdentityOperator(A.shape[-1], dtype=A.dtype)
        return None

    R = Rotation(_v())
    assert type(R @ R).__name__ == "IdentityOperator"
    assert type(R @ Reflection(_v(seed=2))).__name__ == "ProductOperator"


def test_registered_solve_is_differentiated_as_a_whole_in_every_mode():
    b = _v(seed=1)

    def ours(v):
        return b @ torch.linalg.solve(RegisteredReflection(v), b).sin()

    def dense(v):
        return b @ torch.linalg.solve(Reflection(v).to_dense(), b).sin()

    v = _v()
    torch.testing.assert_close(ft.grad(ours)(v), torch.func.grad(dense)(v))
    t = _v(seed=3)
    torch.testing.assert_close(ft.jvp(ours, (v,), (t,))[1], torch.func.jvp(dense, (v,), (t,))[1])
    torch.testing.assert_close(ft.hessian(ours)(v), torch.func.hessian(dense)(v))
    vs = _v(batch=(3,), seed=4)
    torch.testing.assert_close(
        ft.vmap(ft.grad(ours))(vs), torch.func.vmap(torch.func.grad(dense))(vs)
    )
    assert ("solve", "RegisteredReflection") in CALLS


def test_no_rule_for_a_non_operator_names_the_query():
    with pytest.raises(TypeError, match=r"inv\(A, \.\.\.\): expected a LinearOperator"):
        _rules.inv(torch.eye(2))


def test_function_local_imports_only_break_named_cycles():
    root = pathlib.Path(L.__file__).parent
    found = []
    for path in sorted(root.glob("*.py")):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for sub in ast.walk(node):
                    if isinstance(sub, (ast.Import, ast.ImportFrom)):
                        above = "\n".join(lines[max(0, sub.lineno - 5) : sub.lineno - 1])
                        assert "cycle" in above, (
                            f"{path.name}:{sub.lineno}: a function-local import without a "
                            "comment naming the import cycle it breaks"
                        )
                        found.append((path.name, node.name))
    assert found == []  # the base class's two cycles are broken by a module-level import
