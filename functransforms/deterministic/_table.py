"""The table of nondeterministic ops: every op torch documents as nondeterministic or as raising
under ``torch.use_deterministic_algorithms(True)`` (checked against torch 2.13 and 2.15: the
docstring of ``torch.use_deterministic_algorithms`` and the alert names of torch's test suite),
plus the CPU cases measured here. Entries torch documents from some version on carry that
version (``since``); ``ENTRIES`` holds those of the installed torch.
tests/determinism/test_deterministic.py compares it with the installed torch's own list and fails
when torch has an entry we lack.

Each entry names the ATen overloads it applies to (the ops a mode sees: backward kernels for
"when attempting to differentiate"), the device it is nondeterministic on, the argument
condition, why, and whether torch has a deterministic alternative and how to get it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from functransforms._compat import TORCH_VERSION

aten = torch.ops.aten

_DET = "torch.use_deterministic_algorithms(True) selects a deterministic kernel"
_NONE = "none in torch: torch.use_deterministic_algorithms(True) makes it raise"


@dataclass(frozen=True)
class Entry:
    ops: tuple  # ATen overload names, "aten::name.overload"
    device: str  # "cuda", "cpu" or "any"
    reason: str
    alternative: str
    documented: tuple = ()  # names in torch.use_deterministic_algorithms' docstring
    alerts: tuple = ()  # alert names torch raises with (its test suite / Python sources)
    condition: object = None  # (args, kwargs) -> bool; None: always
    raises: bool = False  # True: torch has no deterministic kernel
    ours: str = ""  # what ft.deterministic.enabled() does about it
    extra: dict = field(default_factory=dict)
    since: tuple = (2, 13)  # the first torch (major, minor) that documents it
    until: tuple = (99, 0)  # the first torch that documents it otherwise (cumsum: 2.15)


def _arg(args, kwargs, i, name, default=None):
    if len(args) > i:
        return args[i]
    return kwargs.get(name, default)


def _dups(index) -> bool:
    index = index.reshape(-1)
    return index.numel() > 1 and index.unique().numel() < index.numel()


def _index_dups(args, kwargs):
    x, indices = args[0], args[1]
    idx = [i for i in indices if i is not None]
    if not idx:
        return False
    try:
        pos = torch.arange(x.numel(), device=x.device).view(x.shape)[tuple(indices)]
    except Exception:
        return True
    return _dups(pos)


def _is_float(t):
    return t.dtype.is_floating_point or t.dtype.is_complex


_conv = (
    "aten::convolution.default",
    "aten::convolution_backward.default",
    "aten::cudnn_convolution.default",
    "aten::cudnn_convolution_transpose.default",
)

_ALL = (
    Entry(
        _conv,
        "cuda",
        "cuDNN convolution may select a nondeterministic algorithm (atomicAdd in backward)",
        _DET + " (or torch.backends.cudnn.deterministic = True)",
        documented=(
            "torch.nn.Conv1d",
            "torch.nn.Conv2d",
            "torch.nn.Conv3d",
            "torch.nn.ConvTranspose1d",
            "torch.nn.ConvTranspose2d",
            "torch.nn.ConvTranspose3d",
        ),
    ),
    Entry(
        tuple(f"aten::replication_pad{d}d_backward.default" for d in (1, 2, 3)),
        "cuda",
        "replication-pad backward accumulates with atomicAdd on CUDA",
        _DET,
        documented=tuple(f"torch.nn.ReplicationPad{d}d" for d in (1, 2, 3)),
        alerts=tuple(f"replication_pad{d}d_backward_cuda" for d in (1, 2, 3)),
    ),
    Entry(
        ("aten::bmm.default",),
        "cuda",
        "sparse-dense bmm on CUDA (cuSPARSE) is nondeterministic",
        _DET,
        documented=("torch.bmm",),
        condition=lambda a, k: a[0].layout != torch.strided,
    ),
    Entry(
        ("aten::index_put.default", "aten::index_put_.default", "aten::_index_put_impl_.default"),
        "cpu",
        "accumulating index_put (the backward of x[idx]): parallel atomic adds on CPU",
        _DET + "; ft.deterministic.enabled() makes our rules accumulate in a fixed order",
        documented=("torch.Tensor.index_put", "torch.Tensor.__getitem__"),
        condition=lambda a, k: bool(_arg(a, k, 3, "accumulate", False)),
        ours="rewritten to a serial index_add over flat positions",
    ),
    Entry(
        ("aten::index_put.default", "aten::index_put_.default", "aten::_index_put_impl_.default"),
        "any",
        "index_put with duplicate indices: which value is written is unspecified",
        _DET,
        documented=("torch.Tensor.index_put",),
        condition=lambda a, k: not _arg(a, k, 3, "accumulate", False) and _index_dups(a, k),
    ),
    Entry(
        ("aten::put_.default", "aten::put.default"),
        "cpu",
        "accumulating put_ on CPU adds in parallel",
        _DET,
        documented=("torch.Tensor.put_",),
        alerts=("put_",),
        condition=lambda a, k: bool(_arg(a, k, 3, "accumulate", False)),
    ),
    Entry(
        ("aten::put_.default", "aten::put.default"),
        "cuda",
        "accumulating put_ on CUDA uses atomicAdd",
        _NONE + "; use index_put(accumulate=True) on the flattened tensor",
        documented=("torch.Tensor.put_",),
        alerts=("put_",),
        condition=lambda a, k: bool(_arg(a, k, 3, "accumulate", False)),
        raises=True,
    ),
    Entry(
        ("aten::put_.default", "aten::put.default"),
        "any",
        "put_ without accumulate: with duplicate indices the value written is unspecified",
        _NONE + "; deduplicate the indices",
        documented=("torch.Tensor.put_",),
        alerts=("put_",),
        condition=lambda a, k: not _arg(a, k, 3, "accumulate", False),
        raises=True,
    ),
    Entry(
        ("aten::scatter_add.default", "aten::scatter_add_.default"),
        "cuda",
        "atomicAdd scatter on CUDA (also the backward of gather)",
        _DET + "; ft.deterministic.enabled() makes our rules use a sort-based index_put",
        documented=("torch.Tensor.scatter_add_", "torch.gather"),
        alerts=("scatter_add_cuda_kernel",),
        ours="rewritten to index_put(accumulate=True) over flat positions (sort + segment sum)",
    ),
    Entry(
        ("aten::index_add.default", "aten::index_add_.default"),
        "cuda",
        "atomicAdd index_add on CUDA (also the backward of index_select, repeat_interleave)",
        _DET + "; ft.deterministic.enabled() makes our rules use a sort-based index_put",
        documented=("torch.index_add", "torch.index_select", "torch.repeat_interleave"),
        alerts=("index_add_cuda_",),
        ours="rewritten to index_put(accumulate=True) over flat positions (sort + segment sum)",
    ),
    Entry(
        ("aten::index_copy.default", "aten::index_copy_.default"),
        "any",
        "index_copy with duplicate indices: which value is written is unspecified",
        _DET,
        documented=("torch.Tensor.index_copy",),
        condition=lambda a, k: _dups(a[2]),
    ),
    Entry(
        (
            "aten::scatter.src",
            "aten::scatter_.src",
            "aten::scatter.reduce",
            "aten::scatter_.reduce",
        ),
        "cuda",
        "scatter of a src tensor on CUDA: with duplicate indices the value written is unspecified",
        _DET,
        documented=("torch.Tensor.scatter",),
    ),
    Entry(
        ("aten::scatter_reduce.two", "aten::scatter_reduce_.two"),
        "cuda",
        "scatter_reduce sum/mean on CUDA uses atomicAdd",
        _DET + "; ft.deterministic.enabled() rewrites reduce='sum' in our rules",
        documented=("torch.Tensor.scatter_reduce",),
        condition=lambda a, k: _arg(a, k, 4, "reduce") in ("sum", "mean"),
    ),
    Entry(
        ("aten::scatter_reduce.two", "aten::scatter_reduce_.two"),
        "cuda",
        "scatter_reduce prod on CUDA uses atomic multiplies",
        _NONE,
        documented=("torch.Tensor.scatter_reduce",),
        condition=lambda a, k: _arg(a, k, 4, "reduce") == "prod",
        raises=True,
    ),
    Entry(
        ("aten::max_pool3d_with_indices_backward.default",),
        "cuda",
        "max_pool3d backward accumulates with atomicAdd on CUDA",
        _DET,
        documented=("torch.nn.MaxPool3d",),
        alerts=("max_pool3d_with_indices_backward_cuda",),
    ),
    Entry(
        ("aten::avg_pool3d_backward.default",),
        "cuda",
        "avg_pool3d backward accumulates with atomicAdd on CUDA",
        _NONE,
        documented=("torch.nn.AvgPool3d",),
        alerts=("avg_pool3d_backward_cuda",),
        raises=True,
    ),
    Entry(
        ("aten::_adaptive_avg_pool2d_backward.default",),
        "cuda",
        "adaptive_avg_pool2d backward accumulates with atomicAdd on CUDA",
        _NONE,
        documented=("torch.nn.AdaptiveAvgPool2d",),
        alerts=("adaptive_avg_pool2d_backward_cuda",),
        raises=True,
    ),
    Entry(
        ("aten::_adaptive_avg_pool3d_backward.default",),
        "cuda",
        "adaptive_avg_pool3d backward accumulates with atomicAdd on CUDA",
        _NONE,
        documented=("torch.nn.AdaptiveAvgPool3d",),
        alerts=("adaptive_avg_pool3d_backward_cuda",),
        raises=True,
    ),
    Entry(
        ("aten::adaptive_max_pool2d_backward.default",),
        "cuda",
        "adaptive_max_pool2d backward accumulates with atomicAdd on CUDA",
        _NONE,
        documented=("torch.nn.AdaptiveMaxPool2d",),
        alerts=("adaptive_max_pool2d_backward_cuda",),
        raises=True,
    ),
    Entry(
        (
            "aten::fractional_max_pool2d_backward.default",
            "aten::fractional_max_pool3d_backward.default",
        ),
        "cuda",
        "fractional max-pool backward accumulates with atomicAdd on CUDA",
        _NONE,
        documented=("torch.nn.FractionalMaxPool2d", "torch.nn.FractionalMaxPool3d"),
        alerts=("fractional_max_pool2d_backward_cuda", "fractional_max_pool3d_backward_cuda"),
        raises=True,
    ),
    Entry(
        ("aten::max_unpool2d.default", "aten::max_unpool3d.default"),
        "any",
        "max_unpool with duplicate indices: which value is written is unspecified",
        _NONE,
        documented=("torch.nn.MaxUnpool1d", "torch.nn.MaxUnpool2d", "torch.nn.MaxUnpool3d"),
        alerts=("max_unpooling2d_forward_out", "max_unpooling3d_forward_out"),
        raises=True,
    ),
    Entry(
        (
            "aten::upsample_linear1d_backward.default",
            "aten::upsample_bilinear2d_backward.default",
            "aten::upsample_bicubic2d_backward.default",
            "aten::upsample_trilinear3d_backward.default",
        ),
        "cuda",
        "interpolate backward (linear, bilinear, bicubic, trilinear) uses atomicAdd on CUDA",
        _NONE,
        documented=("torch.nn.functional.interpolate",),
        alerts=(
            "upsample_linear1d_backward_out_cuda",
            "upsample_bilinear2d_backward_out_cuda",
            "upsample_bicubic2d_backward_out_cuda",
            "upsample_trilinear3d_backward_out_cuda",
        ),
        raises=True,
    ),
    Entry(
        tuple(f"aten::reflection_pad{d}d_backward.default" for d in (1, 2, 3)),
        "cuda",
        "reflection-pad backward accumulates with atomicAdd on CUDA",
        _NONE,
        documented=tuple(f"torch.nn.ReflectionPad{d}d" for d in (1, 2, 3)),
        alerts=(
            "reflection_pad1d_backward_out_cuda",
            "reflection_pad2d_backward_cuda",
            "reflection_pad3d_backward_out_cuda",
        ),
        raises=True,
    ),
    Entry(
        ("aten::nll_loss2d_forward.default",),
        "cuda",
        "nll_loss2d forward reduces with atomicAdd on CUDA",
        _NONE,
        documented=("torch.nn.NLLLoss",),
        alerts=("nll_loss2d_forward_out_cuda_template",),
        raises=True,
    ),
    Entry(
        ("aten::_ctc_loss_backward.default", "aten::_ctc_loss_backward.Tensor"),
        "cuda",
        "CTC loss backward accumulates with atomicAdd on CUDA",
        _NONE,
        documented=("torch.nn.CTCLoss",),
        alerts=("ctc_loss_backward_gpu",),
        raises=True,
    ),
    Entry(
        ("aten::_embedding_bag_backward.default", "aten::_embedding_bag_dense_backward.default"),
        "cuda",
        "embedding_bag backward with mode='max' uses atomicAdd on CUDA",
        _NONE,
        documented=("torch.nn.EmbeddingBag",),
        alerts=("embedding_bag_backward_cuda_max",),
        condition=lambda a, k: any(type(v) is int and v == 2 for v in a[7:9]),  # mode max
        raises=True,
    ),
    Entry(
        ("aten::histc.default",),
        "cuda",
        "histc on CUDA counts with atomicAdd (floating point input)",
        _NONE,
        documented=("torch.histc",),
        alerts=("_histc_cuda", "_histc_cuda with floating point input"),
        raises=True,
    ),
    Entry(
        ("aten::bincount.default",),
        "cuda",
        "bincount with weights on CUDA sums with atomicAdd",
        _NONE,
        documented=("torch.bincount",),
        alerts=("_bincount_cuda",),
        condition=lambda a, k: _arg(a, k, 1, "weights") is not None,
        raises=True,
    ),
    Entry(
        ("aten::median.dim", "aten::nanmedian.dim", "aten::mode.default"),
        "cuda",
        "median/mode with indices on CUDA: which index of a repeated value is returned varies",
        _NONE,
        documented=("torch.median",),
        alerts=("median CUDA with indices output",),
        raises=True,
    ),
    Entry(
        ("aten::kthvalue.default",),
        "cuda",
        "kthvalue on CUDA: which index of a repeated value is returned varies",
        _NONE,
        alerts=("kthvalue CUDA",),
        raises=True,
    ),
    Entry(
        ("aten::grid_sampler_2d_backward.default", "aten::grid_sampler_3d_backward.default"),
        "cuda",
        "grid_sample backward accumulates with atomicAdd on CUDA",
        _NONE,
        documented=("torch.nn.functional.grid_sample",),
        alerts=("grid_sampler_2d_backward_cuda", "grid_sampler_3d_backward_cuda"),
        raises=True,
    ),
    Entry(
        ("aten::cumsum.default", "aten::cumsum_.default"),
        "cuda",
        "floating cumsum on CUDA (parallel scan) is nondeterministic",
        _NONE,
        documented=("torch.cumsum",),
        alerts=("cumsum_cuda_kernel",),
        condition=lambda a, k: _is_float(a[0]),
        raises=True,
        until=(2, 15),
    ),
    Entry(  # torch 2.15 moved cumsum to the ops with a deterministic kernel
        ("aten::cumsum.default", "aten::cumsum_.default"),
        "cuda",
        "floating cumsum on CUDA (parallel scan) is nondeterministic",
        _DET,
        documented=("torch.cumsum",),
        alerts=("cumsum_cuda_kernel",),
        condition=lambda a, k: _is_float(a[0]),
        since=(2, 15),
    ),
    Entry(
        ("aten::embedding_dense_backward.default",),
        "cuda",
        "embedding backward on CUDA accumulates rows of repeated indices in parallel",
        _DET,
        documented=("torch.nn.Embedding",),
        since=(2, 15),
    ),
    # torch 2.15 documents MPS kernels that raise under use_deterministic_algorithms(True)
    *(
        Entry(
            ops,
            "mps",
            f"{why} on MPS",
            _NONE,
            documented=doc,
            condition=cond,
            raises=True,
            since=(2, 15),
        )
        for ops, why, doc, cond in (
            (
                (
                    "aten::index_put.default",
                    "aten::index_put_.default",
                    "aten::_index_put_impl_.default",
                ),
                "index_put with accumulate=True (floating or complex)",
                ("torch.Tensor.index_put",),
                lambda a, k: bool(_arg(a, k, 3, "accumulate", False)) and _is_float(a[0]),
            ),
            (
                ("aten::index_reduce.default", "aten::index_reduce_.default"),
                "index_reduce with reduce='prod' or 'mean' (floating or complex)",
                ("torch.Tensor.index_reduce",),
                lambda a, k: _arg(a, k, 4, "reduce") in ("prod", "mean") and _is_float(a[0]),
            ),
            (
                ("aten::scatter_reduce.two", "aten::scatter_reduce_.two"),
                "scatter_reduce",
                ("torch.Tensor.scatter_reduce",),
                None,
            ),
            (("aten::kthvalue.default",), "kthvalue", ("torch.kthvalue",), None),
            (
                ("aten::embedding_dense_backward.default",),
                "embedding backward",
                ("torch.nn.Embedding",),
                None,
            ),
            (
                (
                    "aten::_embedding_bag_backward.default",
                    "aten::_embedding_bag_dense_backward.default",
                ),
                "embedding_bag backward",
                ("torch.nn.EmbeddingBag",),
                None,
            ),
            (
                (
                    "aten::grid_sampler_2d_backward.default",
                    "aten::grid_sampler_3d_backward.default",
                ),
                "grid_sample backward",
                ("torch.nn.functional.grid_sample",),
                None,
            ),
            (
                (
                    "aten::max_pool2d_with_indices_backward.default",
                    "aten::max_pool3d_with_indices_backward.default",
                    "aten::avg_pool3d_backward.default",
                ),
                "max_pool2d/max_pool3d/avg_pool3d backward",
                ("torch.nn.MaxPool2d", "torch.nn.MaxPool3d", "torch.nn.AvgPool3d"),
                None,
            ),
            (
                (
                    "aten::upsample_linear1d_backward.default",
                    "aten::upsample_bilinear2d_backward.default",
                    "aten::upsample_bicubic2d_backward.default",
                    "aten::upsample_trilinear3d_backward.default",
                ),
                "interpolate backward (torch: 'in some cases'; the interpolating modes listed)",
                ("torch.nn.functional.interpolate",),
                None,
            ),
        )
    ),
    Entry(
        ("aten::resize_.default",),
        "any",
        "resize_ of a quantized tensor leaves new memory uninitialized",
        _NONE,
        documented=("torch.Tensor.resize_",),
        alerts=("quantized_resize_cpu_",),
        condition=lambda a, k: a[0].is_quantized,
        raises=True,
    ),
)

ENTRIES = tuple(e for e in _ALL if e.since <= TORCH_VERSION < e.until)


def _resolve(name):
    ns, rest = name.split("::")
    op, _, overload = rest.partition(".")
    try:
        return getattr(getattr(getattr(torch.ops, ns), op), overload or "default")
    except (AttributeError, RuntimeError):
        return None  # not in this torch build


_by_op = None


def entries_for(func):
    """The table entries that name ``func`` (an OpOverload)."""
    global _by_op
    if _by_op is None:
        by = {}
        for e in ENTRIES:
            for name in e.ops:
                op = _resolve(name)
                if op is not None:
                    by.setdefault(op, []).append(e)
        _by_op = by
    return _by_op.get(func, ())


def documented_names():
    return {n for e in ENTRIES for n in e.documented}


def alert_names():
    return {n for e in ENTRIES for n in e.alerts}
