"""functransforms: composable function transforms for PyTorch (grad, vjp, jvp, vmap, ...)."""

from . import autodiff, batching  # noqa: F401  (registers the rules)
from ._ad import grad, grad_and_value, hessian, jacfwd, jacrev, jvp, linearize, value_and_grad, vjp
from ._custom import custom_jvp, custom_vjp, stop_gradient
from ._module import functional_call, stack_module_state
from ._vmap import vmap

__all__ = [
    "custom_jvp",
    "custom_vjp",
    "stop_gradient",
    "functional_call",
    "grad",
    "grad_and_value",
    "hessian",
    "jacfwd",
    "jacrev",
    "jvp",
    "linearize",
    "stack_module_state",
    "value_and_grad",
    "vjp",
    "vmap",
]
__version__ = "0.1.0"
