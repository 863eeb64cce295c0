"""Pytree utilities (optree), used only at the API edge, never per op.

All registrations live in one optree namespace, so that our node types (LinearOperators, ...)
flatten in our transforms without leaking into other libraries' optree registries.
"""

from __future__ import annotations

import re

import optree

from . import _compat

NAMESPACE = "functransforms"

# None is a node with no children (as in PyTorch and JAX): `f(x, None)` maps over x only.
_KW = dict(none_is_leaf=False, namespace=NAMESPACE)


# functorch flattens with torch.utils._pytree, so a class registered there (register_pytree_node,
# register_dataclass) is a node for functorch's transforms: it must be one for ours. Its
# registrations are copied into our namespace when their count changes (a len() per call).
_torch_nodes = _compat.torch_pytree.SUPPORTED_NODES
_copied = [0]


def _copy_torch_registrations():
    from ._core.gcpause import paused_collector

    # two threads' first calls both copied, and the second registration raised "already
    # registered" (Note [One-time setup under one lock], _core/gcpause.py)
    with paused_collector():
        _copy_locked()


def _copy_locked():
    get = optree.register_pytree_node.get
    for cls, node in list(_torch_nodes.items()):
        # builtins, namedtuples and structseqs are nodes for optree already
        if not isinstance(cls, type) or get(cls, namespace=NAMESPACE) is not None:
            continue
        optree.register_pytree_node(
            cls,
            lambda obj, flatten=node.flatten_fn: tuple(flatten(obj)),
            lambda ctx, children, unflatten=node.unflatten_fn: unflatten(list(children), ctx),
            namespace=NAMESPACE,
        )
    _copied[0] = len(_torch_nodes)


def tree_flatten(tree):
    if len(_torch_nodes) != _copied[0]:
        _copy_torch_registrations()
    return optree.tree_flatten(tree, **_KW)


def tree_unflatten(treespec, leaves):
    return optree.tree_unflatten(treespec, leaves)


def tree_leaves(tree):
    if len(_torch_nodes) != _copied[0]:
        _copy_torch_registrations()
    return optree.tree_leaves(tree, **_KW)


def tree_map(fn, tree, *rest):
    if len(_torch_nodes) != _copied[0]:
        _copy_torch_registrations()
    return optree.tree_map(fn, tree, *rest, **_KW)


def tree_structure(tree):
    if len(_torch_nodes) != _copied[0]:
        _copy_torch_registrations()
    return optree.tree_structure(tree, **_KW)


def same_structure(a, b) -> bool:
    """``a == b`` for two tree structures, also when one was built by torch.compile's traced
    version of optree, which drops the namespace (``PyTreeSpec(*)`` vs ``PyTreeSpec(*,
    namespace='functransforms')``, or ``namespace=''`` on torch 2.15): the structures are
    compared without it."""
    if a == b:
        return True
    return _NAMESPACE_TAG.sub("", repr(a)) == _NAMESPACE_TAG.sub("", repr(b))


_NAMESPACE_TAG = re.compile(r", namespace='[^']*'")


def one_level(node):
    """``(children, structure)`` of a pytree node one level deep, or None for a leaf. The
    structure compares equal for two nodes of the same type and metadata."""
    if len(_torch_nodes) != _copied[0]:
        _copy_torch_registrations()
    if optree.treespec_is_leaf(optree.tree_structure(node, none_is_leaf=True, namespace=NAMESPACE)):
        return None
    children, spec = optree.tree_flatten(
        node, is_leaf=lambda x: x is not node, none_is_leaf=True, namespace=NAMESPACE
    )
    return children, spec


def keys_in_flatten_order(d) -> tuple:
    """The keys of a dict-like node in the order its leaves are flattened (optree sorts a
    dict's keys; an OrderedDict keeps its own order)."""
    return tuple(optree.tree_flatten_one_level(d, none_is_leaf=True, namespace=NAMESPACE).entries)


def register_pytree_node(cls, flatten, unflatten):
    """Register `cls` as a pytree node in our namespace.

    Args:
        cls: the node type.
        flatten: ``obj -> (children, aux_data)``; children are the leaves/subtrees (tensors).
        unflatten: ``(aux_data, children) -> obj``.
    """
    optree.register_pytree_node(
        cls,
        lambda obj: flatten(obj),
        lambda aux, children: unflatten(aux, children),
        namespace=NAMESPACE,
    )
    return cls
