"""The collective primitives, as ops of the ``functransforms`` torch library namespace.

Note [Collectives are ops]
    A collective (``psum``, ``all_gather``, ...) is not a function of one example: under vmap it
    reduces or permutes *across* the mapped axis, so it cannot be written with per-example ops.
    It is a primitive, like JAX's ``psum_p``: an op of its own (``functransforms::psum``) that
    reaches our interpreters through torch's dispatcher like any aten op, so that every
    transform handles it through its registry (``batching/collectives.py``,
    ``autodiff/collectives.py``) and nothing else in the core knows about axes.

    The op names its axis by the *level* of the vmap that binds it (``axis``): the public
    functions (``functransforms/_collectives.py``) resolve names to levels, and lift the operand
    to be batched at that level first, so the named vmap always processes the op. A vmap of
    another level passes it through to the level below (it commutes with the collective); the
    named level turns it into a reduction, gather or permutation of its physical tensor. The
    kernels below run only if an op escapes every interpreter, which the public functions rule
    out: they raise.
"""

from __future__ import annotations

import torch

_LIB = torch.library.Library("functransforms", "DEF")  # noqa: TOR901 - a private op namespace

# Each op: its schema after the operand. ``axis`` is the binding vmap's level.
_SCHEMAS = {
    "psum": "int axis",
    "pmean": "int axis",
    "pmax": "int axis",
    "pmin": "int axis",
    # all_gather / psum_scatter / all_to_all are the tiled forms (JAX's tiled=True); the untiled
    # ones add and remove a size-1 dim around them (functransforms/_collectives.py)
    "all_gather": "int axis, int dim",
    "psum_scatter": "int axis, int dim",
    "all_to_all": "int axis, int split_dim, int concat_dim",
    # src[i]: the example whose value example i receives, -1 for none (zeros)
    "ppermute": "int axis, int[] src",
}


def _escaped(name):
    def kernel(x, *params):
        raise RuntimeError(
            f"functransforms.{name}: the collective reached a tensor outside the vmap that binds "
            "its axis (an internal error: please report it with the code that raised it)."
        )

    return kernel


for _name, _params in _SCHEMAS.items():
    _LIB.define(f"{_name}(Tensor x, {_params}) -> Tensor")
    _LIB.impl(_name, _escaped(_name), "CompositeExplicitAutograd")

OPS = {name: getattr(torch.ops.functransforms, name).default for name in _SCHEMAS}
psum, pmean, pmax, pmin = OPS["psum"], OPS["pmean"], OPS["pmax"], OPS["pmin"]
all_gather, psum_scatter = OPS["all_gather"], OPS["psum_scatter"]
all_to_all, ppermute = OPS["all_to_all"], OPS["ppermute"]
