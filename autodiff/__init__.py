"""Forward- and reverse-mode derivative rules, by op family. Importing registers them all."""

from . import (  # noqa: F401  (registration)
    convolution,
    elementwise,
    linalg,
    nn,
    normalization,
    pooling,
    reductions,
    sorting,
    spectral,
    views,
)
from ._registry import JVP_RULES, VJP_RULES, register_jvp_rule, register_vjp_rule
from .forward import DualTensor, JvpInterpreter
from .reverse import GradInterpreter, GradTensor

__all__ = [
    "JVP_RULES",
    "VJP_RULES",
    "DualTensor",
    "GradInterpreter",
    "GradTensor",
    "JvpInterpreter",
    "register_jvp_rule",
    "register_vjp_rule",
]
