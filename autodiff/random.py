"""Derivative rules of random ops: a draw is a constant of the level (no derivative flows
into it or through its parameters), so each op is declared non-differentiable, except the
reparameterized gamma draw, which torch differentiates in its concentration, and normal(mean,
std), reparameterised by its decomposition. vmap's rules for
the same ops are in batching/random.py (Note [Batching random ops])."""

from __future__ import annotations

import torch

from .elementwise import def_nondifferentiable, def_unary

aten = torch.ops.aten

def_nondifferentiable(
    aten.rand_like.default,
    aten.randn_like.default,
    aten.bernoulli.default,
    # random fills of a fresh buffer (dropout's `empty_like(x).bernoulli_(p)`): the buffer is a
    # constant of the level (Note [Buffers held by kernels]), filled by the functional variant
    aten.bernoulli.Tensor,
    aten.bernoulli.p,
    aten.normal_functional.default,
    getattr(aten.random, "from"),
    aten.random.to,
    aten.random.default,
    aten.cauchy.default,
    aten.log_normal.default,
    aten.geometric.default,
    # its absence sent exponential_ through torch's decomposition (-log1p(-uniform) / lambd),
    # which draws other values than the kernel: a seeded draw differed from eager and PyTorch
    aten.exponential.default,
    aten.uniform.default,
    # a count: torch's derivative in the rate is 0 (it raised MissingRuleError). normal(mean,
    # std) is not listed: it is reparameterised on purpose, through its decomposition
    # (docs/design/derivative-rules.md, "Decisions where torch is inconsistent or wrong")
    aten.poisson.default,
)


def _standard_gamma_deriv(alpha, out, generator=None):
    """d sample / d alpha at a fixed uniform: torch's implicit reparameterization gradient
    (Gamma/Beta ``rsample``); torch has no derivative of it, so nor do we (a second order
    raises MissingRuleError)."""
    return aten._standard_gamma_grad.default(alpha, out)


def_unary(aten._standard_gamma.default, _standard_gamma_deriv)
