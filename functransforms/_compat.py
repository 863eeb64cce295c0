"""What differs between the supported torch versions (pyproject: ``torch>=2.13,<2.16``), in one
place, so that version-aware code reads a named fact instead of comparing version strings.

Note [Supported torch versions]
    We match torch.func bit for bit where we can, so where torch changed a formula between
    releases we follow the installed torch (a rule of ours that computed 2.13's formula on 2.15
    would be a silent difference from ``torch.func`` there). Each fact below names the torch
    change it stands for; docs/design.md "Supported torch versions" lists them with the tests
    that pin each one. Other version-dependent torch API this library relies on:
    ``torch.autograd.Function.apply`` (a Python classmethod up to 2.14, a C
    ``classmethod_descriptor`` in 2.15: ``_autograd_function._original_apply``) and the
    namespace torch.compile writes into tree specs (``_pytree.same_structure``).
"""

from __future__ import annotations

import torch


def _minor(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


TORCH_VERSION = _minor(torch.__version__)
"""(major, minor) of the installed torch, e.g. ``(2, 15)``."""

TORCH_MINOR = f"{TORCH_VERSION[0]}.{TORCH_VERSION[1]}"
"""``"2.15"``: the key of per-version tables (conformance expected failures, coverage)."""

DOCS_TORCH = "2.13"
"""The torch the generated docs (docs/coverage.md, docs/conformance.md) and the base table of
conformance expected failures are made with (the oldest supported); other versions get
overlays and pages of their own (docs/coverage-torch2.15.md)."""

# torch 2.15 derivatives.yaml: fmax/fmin, clamp_min/clamp_max/clamp with Tensor bounds split the
# derivative evenly at ties (as maximum/minimum always did); in 2.13 it goes to `self` (2.14 is
# not installed here: it is taken to be 2.13's).
SPLIT_TIES_FMAX_CLAMP_TENSOR = TORCH_VERSION >= (2, 15)

# torch 2.15 derivatives.yaml: log_ndtr's derivative multiplies by 1/sqrt(2 pi) (a constant)
# where 2.13 divided by sqrt(2 pi): the float32 results round differently.
LOG_NDTR_MULTIPLIES = TORCH_VERSION >= (2, 15)
