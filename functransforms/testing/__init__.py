"""Test helpers: numerical derivative checks and vmap-vs-loop checks.

``check_grads`` and ``check_vmap`` need only torch. The hypothesis strategies live in
``functransforms.testing.strategies``, which imports hypothesis (a test extra) on use.
"""

from functransforms.deterministic._check import assert_deterministic

from ._checks import check_grads, check_vmap

__all__ = ["assert_deterministic", "check_grads", "check_vmap"]
