"""functransforms: composable function transforms for PyTorch (grad, vjp, jvp, vmap, ...)."""

import os as _os
import sys as _sys

# In a source checkout the subpackages live beside this folder (batching/, autodiff/, linalg/)
# and the installed package-dir mapping finds them. Run from the repository root, though,
# `python -m functransforms` finds this folder through sys.path[0] first, bypassing the
# mapping: let the import system look beside it too. (An installed wheel nests them, so
# this does nothing there.)
_here = _os.path.dirname(__file__)
if not _os.path.isdir(_os.path.join(_here, "autodiff")):
    __path__.append(_os.path.dirname(_here))

from ._core.gcpause import paused_collector as _paused_collector  # noqa: E402

# Note [Long-lived setup without young collections] (_core/gcpause.py)
with _paused_collector():
    from . import (  # noqa: E402, F401  (the interpreters of grad/vjp/jvp; determinism)
        autodiff,
        deterministic,  # noqa: E402, F401
    )
    from ._ad import (
        grad,
        grad_and_value,
        jvp,
        linearize,
        value_and_grad,
        vjp,
    )
    from ._autograd_function import install as _install_autograd_function  # noqa: E402
    from ._custom import custom_jvp, custom_vjp, custom_vmap, sequential_vmap, stop_gradient
    from ._functionalize import functionalize
    from ._jacobians import hessian, jacfwd, jacrev
    from ._vmap import vmap

    _install_autograd_function()  # Note [autograd.Function under transforms]
    # Note [torch.compile inside our transforms] (_core/compiling.py)
    if "torch._dynamo" in _sys.modules:
        from ._core.compiling import keep_dynamo_out as _keep_dynamo_out

        _keep_dynamo_out()

# Note [Lazy parts of the package]: what no rule needs loads at first use (PEP 562), so
# ``import functransforms`` stays cheap (cold start, docs/performance.md): ``jit`` (make_fx's
# machinery is imported by its first trace anyway), ``distributed`` (process launching), the
# collectives and pmap (their custom ops), rearrange, the nn.Module helpers and the extras, and
# the ``batching`` package (vmap's interpreter, wrapper classes and rules: ``vmap``'s first call
# imports it; a first ``grad`` does not need it), and the ``linalg`` and ``testing`` packages
# (``ft.linalg.KroneckerOperator`` works without ``import functransforms.linalg``).
# After the first access the name is a plain module attribute. (The rule families load on
# first use too: Note [Rule families load on first use], _core/ops.py.)
_LAZY = {
    "jit": "._jit",  # the package; its jit function is the value
    "distributed": ".distributed",
    "batching": ".batching",  # vmap's interpreter and rules: imported by vmap's first call
    "linalg": ".linalg",  # structured operators (also `import functransforms.linalg`)
    "testing": ".testing",  # check_grads, check_vmap, hypothesis strategies
    "pmap": ".distributed._pmap",
    "rearrange": "._rearrange",
    **dict.fromkeys(
        (
            "all_gather",
            "all_to_all",
            "axis_index",
            "axis_size",
            "pmax",
            "pmean",
            "pmin",
            "ppermute",
            "psum",
            "psum_scatter",
        ),
        ".distributed._collectives",
    ),
    **dict.fromkeys(
        ("functional_call", "replace_all_batch_norm_modules_", "stack_module_state"), "._module"
    ),
    **dict.fromkeys(("checkpoint", "debug_unwrap", "linear_transpose"), "._extras"),
}

_SUBPACKAGES = (
    "batching",
    "distributed",
    "linalg",
    "testing",
)  # the module itself, not a name in it


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    with _paused_collector():  # Note [Long-lived setup without young collections]
        mod = importlib.import_module(module, __name__)
    value = mod if name in _SUBPACKAGES else getattr(mod, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "all_gather",
    "all_to_all",
    "axis_index",
    "axis_size",
    "pmax",
    "pmean",
    "pmin",
    "pmap",
    "ppermute",
    "psum",
    "psum_scatter",
    "checkpoint",
    "linear_transpose",
    "custom_jvp",
    "deterministic",
    "distributed",
    "custom_vjp",
    "custom_vmap",
    "debug_unwrap",
    "sequential_vmap",
    "stop_gradient",
    "functional_call",
    "functionalize",
    "grad",
    "grad_and_value",
    "hessian",
    "jacfwd",
    "jacrev",
    "jit",
    "jvp",
    "linearize",
    "rearrange",
    "replace_all_batch_norm_modules_",
    "stack_module_state",
    "value_and_grad",
    "vjp",
    "vmap",
]
__version__ = "0.1.0"
