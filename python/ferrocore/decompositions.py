"""The decomposition table graphs are traced with (docs/front.md): core ATen's as AOT autograd
applies it, less the ops ferrocore lowers better itself, plus the foreach ops and, for training
graphs, the softmaxes and normalizations.

Part of the tracing layer; imports nothing of the front but `foreach`.
"""

from __future__ import annotations

import functools
import math

import torch
import torch._decomp as decomp
import torch._inductor.inductor_prims  # noqa: F401 - registers the prims `_max_pool_saving_offsets` calls
from torch._decomp import get_decompositions

from . import foreach


@functools.lru_cache(None)
def decompositions(training: bool = False) -> dict:
    """Core ATen's table, less the ops ferrocore lowers better itself; for training graphs also
    the softmaxes and normalizations. The partitioner recomputes only ops it knows to be cheap and
    treats these as opaque, so it would save their full-size outputs beside their inputs; taken
    apart, it saves the input and the per-row statistics, and the backward recomputes the rest
    in its kernels (as Inductor's table does)."""
    table = _core_aten_table()
    # Lowered natively as a gather; torch's decomposition is a scatter-add (index_put).
    table.pop(torch.ops.aten.col2im.default, None)
    # A library call (fused CPU flash attention): its decomposition returns the attention
    # weights where the op returns logsumexp, and lays the output out unlike the kernel.
    table.pop(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, None)
    # Lowered natively as ATen's kernel computes it; the decomposition works in the default float
    # type and disagrees with eager (e.g. an int64 linspace off by one at half the points).
    # logspace likewise (its decomposition takes the power of unrounded float64 points where a
    # half-type eager result rounds the bounds first).
    for op in (torch.ops.aten.linspace, torch.ops.aten.logspace):
        for overload in ("default", "Tensor_Tensor", "Tensor_Scalar", "Scalar_Tensor"):
            table.pop(getattr(op, overload), None)
    table.update(foreach.decompositions())
    # (not in torch 2.11's core table: gradient clipping's norms ran as ATen calls on its GPUs)
    table.update(get_decompositions([torch.ops.aten.linalg_vector_norm]))
    # (not in core ATen's either: FlexAttention's dense form lays its output out with it)
    table.update(get_decompositions([torch.ops.aten.new_empty_strided]))
    if training:
        aten = torch.ops.aten
        table.update(get_decompositions([
            aten._log_softmax, aten._softmax, aten.native_layer_norm, aten.native_group_norm,
            aten._native_batch_norm_legit, aten._native_batch_norm_legit_functional,
            aten._native_batch_norm_legit_no_training, aten.native_batch_norm,
            aten._batch_norm_with_update, aten._batch_norm_with_update_functional, aten._batch_norm_no_update,
        ]))
        table[aten.max_pool2d_with_indices.default] = functools.partial(_max_pool_saving_offsets, dims=2)
        table[aten.max_pool3d_with_indices.default] = functools.partial(_max_pool_saving_offsets, dims=3)
    return table


def _core_aten_table() -> dict:
    """Core ATen's decompositions as AOT autograd applies them. `core_aten_decompositions()` also
    maps every CompositeImplicitAutograd op to its own composite kernel, for export, which traces
    above the dispatcher; AOT autograd traces below it, where those ops have decomposed already.
    Listing them costs 0.14 s per process; the graphs of the model benchmark's 16 models,
    inference and training, are identical without them."""
    post_autograd = getattr(decomp, "_core_aten_decompositions_post_autograd", None)
    if post_autograd is None:  # (another torch): the whole table
        return dict(decomp.core_aten_decompositions().items())
    return dict(post_autograd())


def _max_pool_saving_offsets(x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False, *, dims):
    """Max pooling whose argmax is the int8 offset of the tap within its window, turned into
    ATen's indices by a separate op the partitioner may recompute: the forward of a training
    graph then saves a byte per pooled element instead of an int64 (ResNet's stem pool)."""
    def spread(v, default):
        v = [v] if isinstance(v, int) else list(v)
        return default if not v else v * dims if len(v) == 1 else v

    kernel = spread(kernel_size, None)
    stride = spread(stride, kernel)
    padding = spread(padding, [0] * dims)
    dilation = spread(dilation, [1] * dims)
    prims = torch.ops.prims
    if math.prod(kernel) > torch.iinfo(torch.int8).max or not hasattr(prims, "_low_memory_max_pool_with_offsets"):
        return NotImplemented
    values, offsets = prims._low_memory_max_pool_with_offsets(x, kernel, stride, padding, dilation, ceil_mode)
    indices = prims._low_memory_max_pool_offsets_to_indices(offsets, kernel, x.shape[-dims:], stride, padding, dilation)
    return values, indices
