"""Structured linear operators: ``functransforms.linalg``.

Operators are never materialized unless asked (``to_dense()``); torch functions called on them
(``torch.linalg.solve``, ``torch.logdet``, ``torch.linalg.cholesky``, ...) dispatch to the
algorithms their structure allows. See docs/linalg.md.
"""

import sys as _sys

# Note [A clone shadowing the package]: Python started in the folder that *contains* a clone
# named functransforms/ imports that folder (no __init__.py) as a namespace package ahead of an
# editable install's finder; then this subpackage loads without the real functransforms. (From
# the repository root, `import linalg` loads this folder under its own name: said apart.)
if __name__ != "functransforms.linalg":
    raise ImportError(
        f"{__name__}: this folder is functransforms.linalg, found here as a top-level module "
        "because Python was started in the repository root. Do: `import functransforms.linalg`."
    )
if getattr(_sys.modules.get("functransforms"), "__file__", None) is None:
    raise ImportError(
        f"functransforms: the folder {_sys.modules['functransforms'].__path__[0]} (a clone of "
        "the repository) shadows the installed package as an empty namespace package. Do: start "
        "Python from another directory, or install with the README's command (`pip install -e "
        "<clone> --config-settings editable_mode=strict`), which imports from any directory."
    )

from . import _dispatch  # noqa: F401  (binds __torch_function__'s table: Note [The base class's import cycles])
from ._base import LinearOperator
from ._batch import BatchSumOperator, repeat, sum_batch
from ._block import BlockOperator, ZeroOperator, cat
from ._block_diagonal import BatchedBlockDiagonalOperator, BlockDiagonalOperator
from ._circulant import CirculantOperator, circulant_preconditioner
from ._composite import (
    AdjointOperator,
    ProductOperator,
    SumOperator,
    TransposeOperator,
    as_operator,
)
from ._curvature import GGNOperator, HessianOperator, JacobianOperator
from ._dense import (
    DenseOperator,
    DiagonalOperator,
    IdentityOperator,
    PermutationOperator,
    ScaledIdentityOperator,
    TriangularOperator,
)
from ._functions import (
    add,
    cholesky,
    cholesky_solve,
    det,
    diagonal,
    eigh,
    eigvalsh,
    frobenius_norm,
    inv,
    logdet,
    matmul,
    slogdet,
    solve,
    solve_triangular,
    svd,
    svdvals,
    trace,
)
from ._hadamard import HadamardProductOperator, hadamard
from ._implicit import InverseOperator
from ._iterative import (
    SolverInfo,
    cg,
    hutchinson_trace,
    hutchpp_trace,
    iterative,
    lanczos,
    slq_logdet,
)
from ._kernel import KernelOperator, inv_quad_logdet, matern52, rbf
from ._kronecker import KroneckerOperator, KroneckerPlusScaledIdentityOperator
from ._kronecker_sum import KroneckerSumOperator
from ._krylov import NormalOperator, bicgstab, gmres, lsmr, minres
from ._lowrank import LowRankOperator, LowRankPlusDiagonalOperator
from ._matfunc import eigsh, lanczos_matfunc
from ._roots import (
    estimate_diagonal,
    pivoted_cholesky,
    pivoted_cholesky_preconditioner,
    root_decomposition,
    root_inv_decomposition,
    sqrtm,
)
from ._sparse import SparseOperator
from ._structured import CholeskyOperator, RootOperator, ToeplitzOperator
from ._tridiagonal import TridiagonalOperator

__all__ = [
    "AdjointOperator",
    "BatchSumOperator",
    "BatchedBlockDiagonalOperator",
    "BlockDiagonalOperator",
    "BlockOperator",
    "CholeskyOperator",
    "CirculantOperator",
    "DenseOperator",
    "DiagonalOperator",
    "GGNOperator",
    "HadamardProductOperator",
    "HessianOperator",
    "IdentityOperator",
    "InverseOperator",
    "JacobianOperator",
    "KernelOperator",
    "KroneckerOperator",
    "KroneckerPlusScaledIdentityOperator",
    "KroneckerSumOperator",
    "LinearOperator",
    "LowRankOperator",
    "LowRankPlusDiagonalOperator",
    "NormalOperator",
    "PermutationOperator",
    "ProductOperator",
    "RootOperator",
    "ScaledIdentityOperator",
    "SolverInfo",
    "SparseOperator",
    "SumOperator",
    "ToeplitzOperator",
    "TransposeOperator",
    "TriangularOperator",
    "TridiagonalOperator",
    "ZeroOperator",
    "add",
    "as_operator",
    "bicgstab",
    "cat",
    "cg",
    "cholesky",
    "cholesky_solve",
    "circulant_preconditioner",
    "det",
    "diagonal",
    "eigh",
    "eigsh",
    "eigvalsh",
    "estimate_diagonal",
    "frobenius_norm",
    "gmres",
    "hadamard",
    "hutchinson_trace",
    "hutchpp_trace",
    "inv",
    "inv_quad_logdet",
    "iterative",
    "lanczos",
    "lanczos_matfunc",
    "logdet",
    "lsmr",
    "matern52",
    "matmul",
    "minres",
    "pivoted_cholesky",
    "pivoted_cholesky_preconditioner",
    "rbf",
    "repeat",
    "root_decomposition",
    "root_inv_decomposition",
    "slogdet",
    "slq_logdet",
    "solve",
    "solve_triangular",
    "sqrtm",
    "sum_batch",
    "svd",
    "svdvals",
    "trace",
]
