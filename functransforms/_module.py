"""functional_call and stack_module_state: call an nn.Module with parameters passed as values."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from . import _compat


def _split(name):
    *path, leaf = name.split(".")
    return path, leaf


def _submodule(module, path):
    for p in path:
        module = getattr(module, p)
    return module


@contextlib.contextmanager
def _swapped(module, tensors, strict):
    known = dict(module.named_parameters(remove_duplicate=False))
    known.update(dict(module.named_buffers(remove_duplicate=False)))
    if strict:
        missing = sorted(set(known) - set(tensors))
        unexpected = sorted(set(tensors) - set(known))
        if missing or unexpected:
            raise RuntimeError(
                f"functional_call(module, parameter_and_buffer_dicts, strict=True): the dicts must "
                "name every parameter and buffer exactly. "
                f"Missing: {missing}; unexpected: {unexpected}."
            )
    saved = []
    try:
        for name, value in tensors.items():
            path, leaf = _split(name)
            owner = _submodule(module, path)
            if leaf in owner._parameters:
                saved.append((owner, "_parameters", leaf, owner._parameters[leaf]))
                owner._parameters[leaf] = value
            elif leaf in owner._buffers:
                saved.append((owner, "_buffers", leaf, owner._buffers[leaf]))
                owner._buffers[leaf] = value
            else:
                saved.append((owner, None, leaf, owner.__dict__.get(leaf, _MISSING)))
                object.__setattr__(owner, leaf, value)
        yield
    finally:
        for owner, where, leaf, old in reversed(saved):
            if where is None:
                if old is _MISSING:
                    owner.__dict__.pop(leaf, None)
                else:
                    object.__setattr__(owner, leaf, old)
            else:
                getattr(owner, where)[leaf] = old


_MISSING = object()


def functional_call(
    module: torch.nn.Module,
    parameter_and_buffer_dicts: dict[str, Any] | tuple[dict[str, Any], ...],
    args: Any = None,
    kwargs: dict[str, Any] | None = None,
    *,
    tie_weights: bool = True,
    strict: bool = False,
) -> Any:
    """Call ``module`` with its parameters and buffers replaced by the given tensors.

    Args:
        module: an ``nn.Module``.
        parameter_and_buffer_dicts: a dict ``name -> tensor`` (or a tuple of such dicts).
        args: positional inputs (a single non-tuple value is one input).
        kwargs: keyword inputs.
        tie_weights: tied parameters (one tensor under two names) follow a replacement given
            under either name.
        strict: require the dicts to name every parameter and buffer.

    Returns:
        What ``module`` returns.

    Example:
        >>> import torch, functransforms as ft
        >>> m = torch.nn.Linear(3, 2)
        >>> p = {k: torch.zeros_like(v) for k, v in m.named_parameters()}
        >>> ft.functional_call(m, p, (torch.ones(3),))             # [2]
        tensor([0., 0.])
    """
    if isinstance(parameter_and_buffer_dicts, dict):
        tensors = dict(parameter_and_buffer_dicts)
    elif not (
        isinstance(parameter_and_buffer_dicts, (list, tuple))
        and all(isinstance(d, dict) for d in parameter_and_buffer_dicts)
    ):
        raise ValueError(  # functorch's class
            "functional_call(module, parameter_and_buffer_dicts, ...): expected a dict, or a "
            "list/tuple of dicts, of name -> tensor; got "
            f"{type(parameter_and_buffer_dicts).__name__}."
        )
    else:
        tensors = {}
        for d in parameter_and_buffer_dicts:
            dup = set(tensors) & set(d)
            if dup:
                raise ValueError(f"functional_call: {sorted(dup)} appear in more than one dict.")
            tensors.update(d)
    if tie_weights:
        by_id = {}
        for name, t in list(module.named_parameters(remove_duplicate=False)) + list(
            module.named_buffers(remove_duplicate=False)
        ):
            by_id.setdefault(id(t), []).append(name)
        for names in by_id.values():
            given = [n for n in names if n in tensors]
            if len({id(tensors[n]) for n in given}) > 1:
                # functorch's refusal: one weight cannot take two values (differentiating
                # both would silently give one of them a zero gradient)
                raise ValueError(
                    f"functional_call(module, parameter_and_buffer_dicts, tie_weights=True): "
                    f"the tied names {sorted(given)} got different tensors; expected one tensor "
                    "for a tied weight (give one of the names), or pass tie_weights=False."
                )
            if given:
                for n in names:
                    tensors.setdefault(n, tensors[given[0]])
    if args is None:
        args = ()
    elif not isinstance(args, tuple):
        args = (args,)
    with _swapped(module, tensors, strict):
        return module(*args, **(kwargs or {}))


def stack_module_state(
    models: list[torch.nn.Module] | tuple[torch.nn.Module, ...],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Stack the parameters and buffers of same-structured modules for ``vmap`` ensembling.

    Returns:
        ``(params, buffers)``: dicts ``name -> tensor`` with a leading dim of ``len(models)``.

    Example:
        >>> import torch, functransforms as ft
        >>> ms = [torch.nn.Linear(3, 2) for _ in range(4)]
        >>> params, buffers = ft.stack_module_state(ms)
        >>> params["weight"].shape                                  # [4, 2, 3]
        torch.Size([4, 2, 3])
    """
    models = list(models)
    if not models:
        raise ValueError("stack_module_state(models): expected at least one module, got none.")
    kinds = {type(m) for m in models}
    if len(kinds) > 1:
        raise ValueError(
            "stack_module_state(models): expected modules of one type; got "
            f"{sorted(k.__name__ for k in kinds)}."
        )
    params = {
        k: torch.stack([dict(m.named_parameters())[k].detach() for m in models]).requires_grad_(
            v.requires_grad
        )
        for k, v in models[0].named_parameters()
    }
    buffers = {
        k: torch.stack([dict(m.named_buffers())[k] for m in models])
        for k, _ in models[0].named_buffers()
    }
    return params, buffers


def replace_all_batch_norm_modules_(root: torch.nn.Module) -> torch.nn.Module:
    """Make every batch norm module in ``root`` use batch statistics only, in place (as
    PyTorch's): ``running_mean``/``running_var``/``num_batches_tracked`` become None and
    ``track_running_stats`` False, so that ``vmap`` over a model in training mode normalizes
    each example with its own statistics instead of writing one update per example into
    shared buffers (which raises).

    Returns:
        ``root``.

    Example:
        >>> import torch, functransforms as ft
        >>> net = ft.replace_all_batch_norm_modules_(torch.nn.Sequential(torch.nn.BatchNorm1d(3)))
        >>> net[0].running_mean is None
        True
        >>> ft.vmap(net)(torch.randn(4, 5, 3)).shape                # [4, 5, 3]
        torch.Size([4, 5, 3])
    """
    for m in root.modules():
        if isinstance(m, _compat.BatchNormBase) and m.track_running_stats:
            m.running_mean = None
            m.running_var = None
            m.num_batches_tracked = None
            m.track_running_stats = False
    return root
