"""A graph made ready to serialize (`prepare`), part of the static compile: effect tokens
unwrapped, integer clamp bounds wrapped as eager's kernel takes them, 0-d host scalars moved to
the graph's GPU, the GEMMs to pad (GPU, `padding`) or to run as templates (GPU, `gemm_choice`)
or the convolution layout (CPU, `conv_layout`) chosen.

Part of the compile layer: it imports `padding`, `gemm_choice`, `conv_layout` and
`runtime.triton_launch` (and through them the runtime), nothing above
(tests/test_front_imports.py).
"""

from __future__ import annotations

import contextlib
import functools
import operator
import sys
import time

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from . import conv_layout, gemm_choice, padding
from .runtime.triton_launch import cuda_arch


def prepare(gm: torch.fx.GraphModule, name: str, opts: dict, timings: dict, measured, compile_region=None) -> tuple:
    """The graph made ready to serialize: effect tokens and clamp bounds unwrapped, host scalars
    moved to its device, GEMMs to pad or to run as templates (GPU) or the convolution layout
    (CPU) chosen. Returns (device, host scalars, the GEMMs named for the compiler
    (`padded_matmuls`, `template_matmuls`), the options with the layout chosen and the GPU's
    architecture, seconds spent timing GEMMs or layouts: not serialization's).
    `compile_region(gm, opts)` compiles the cut-out graphs `gemm_choice` times."""
    excluded = 0.0
    _unwrap_effects(gm)
    _wrap_integer_clamp_bounds(gm)
    device, host_scalars = _host_scalars(gm)
    if device is not None and not torch.cuda.is_available():
        # (a graph traced on fake GPU tensors) rather than the driver's message at the first call
        raise RuntimeError(f"ferrocore: graph {name} computes on {device}, but this machine has no usable GPU "
                           "(torch.cuda.is_available() is False)")
    if device is None and opts["autotune"] and not _said["cpu_autotune"]:
        _said["cpu_autotune"] = True
        print(f"[ferrocore] {name} is on the CPU: autotuning (mode='max-autotune') times each float32 GEMM as a "
              "C++ kernel against the library call; other C++ kernels compile as in the default mode", file=sys.stderr)
    if device is not None:
        _move_host_scalars(gm, device, host_scalars)
        # which library kernels the GPU has (the attention pass's cuDNN call: Hopper)
        opts = {**opts, "cuda_arch": cuda_arch(device) or 0}
    gemms = {}
    if device is not None:
        t = time.perf_counter()
        gemms["padded_matmuls"] = padding.padded_matmuls(gm, opts, measured)
        timings["padding"] = (time.perf_counter() - t) * 1e3
        if opts.get("gemm_template") in ("cached", "measured"):
            t2 = time.perf_counter()
            gemms["template_matmuls"] = gemm_choice.template_matmuls(gm, opts, compile_region)
            timings["gemm_template"] = (time.perf_counter() - t2) * 1e3
        excluded += time.perf_counter() - t
    else:
        t = time.perf_counter()
        if opts.get("gemm_template") == "measured":
            gemms["template_matmuls"] = gemm_choice.template_matmuls(gm, opts, compile_region)
            timings["gemm_template"] = (time.perf_counter() - t) * 1e3
        excluded += time.perf_counter() - t
        t = time.perf_counter()
        layout = conv_layout.choose(gm, opts)
        if layout is not None:
            opts = {**opts, "conv_layout": layout[0]}
            timings["conv_layout"] = (time.perf_counter() - t) * 1e3
            if "layout" in opts["logs"]:
                print(f"[ferrocore:layout]\n{name}: {layout[1]}", file=sys.stderr)
        excluded += time.perf_counter() - t
    return device, host_scalars, gemms, opts, excluded


# what the process has been told once
_said = {"cpu_autotune": False}


def _host_scalars(gm: torch.fx.GraphModule) -> tuple:
    """(the graph's GPU device, positions of its 0-d CPU tensor inputs), or (None, []) for a
    graph that touches no GPU."""
    device = None
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        for v in val if isinstance(val, (tuple, list)) else (val,):
            if isinstance(v, torch.Tensor) and v.device.type == "cuda":
                device = v.device
                break
        if device is not None:
            break
    if device is None:
        return None, []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    # an input the graph writes into stays where it is (a copy on the GPU would take the write)
    written = {n.args[0] for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.copy_.default}
    host = [
        i for i, n in enumerate(placeholders)
        if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].device.type == "cpu"
        and n.meta["val"].dim() == 0 and n not in written
    ]
    return device, host


def declared_gpu_scalars(gm: torch.fx.GraphModule, host: list) -> list:
    """Positions of the 0-d inputs the graph declares on the GPU (other than the host scalars it
    moves there itself): such a tensor may arrive on the CPU, where ATen would take it."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return [i for i, n in enumerate(placeholders) if i not in host and isinstance(n.meta.get("val"), torch.Tensor)
            and n.meta["val"].device.type == "cuda" and n.meta["val"].dim() == 0]


def _move_host_scalars(gm: torch.fx.GraphModule, device: torch.device, host: list) -> None:
    """Declares the 0-d CPU inputs of a GPU graph as GPU tensors (the call moves them there) and
    moves its 0-d CPU constants, so that every kernel reads device memory."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i in host:
        _declare_on(placeholders[i], device)
    for n in gm.graph.nodes:
        if n.op != "get_attr":
            continue
        *path, leaf = n.target.split(".")
        owner = gm
        for part in path:
            owner = getattr(owner, part)
        t = getattr(owner, leaf)
        if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dim() == 0:
            # a real copy: the backend may run under dynamo's fake mode, where `.to` is fake
            with unset_fake_temporarily():
                setattr(owner, leaf, t.to(device))
            _declare_on(n, device)
    _move_host_scalar_nodes(gm, device)


def _declare_on(n: torch.fx.Node, device: torch.device) -> None:
    val = n.meta.get("val")
    if isinstance(val, torch.Tensor):
        mode = getattr(val, "fake_mode", None)
        with mode if mode is not None else contextlib.nullcontext():
            n.meta["val"] = torch.empty((), dtype=val.dtype, device=device)


def _on_cpu_0d(n) -> bool:
    val = n.meta.get("val") if isinstance(n, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.device.type == "cpu" and val.dim() == 0


def _move_host_scalar_nodes(gm: torch.fx.GraphModule, device: torch.device) -> None:
    """0-d CPU tensors made inside a GPU graph only to feed GPU ops (`scalar_tensor`/`full` on
    the CPU, a copy of a moved constant) are made on the GPU instead, so that their consumers
    compile rather than fall back on mixed devices. A graph output stays where eager puts it."""
    for n in gm.graph.nodes:
        if n.op != "call_function" or not _on_cpu_0d(n):
            continue
        if not n.users or any(u.op == "output" for u in n.users):
            continue
        inputs = [a for a in n.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        asked = n.kwargs.get("device")
        if inputs:
            # derived from tensors that now all live on the GPU, with no device of its own
            movable = asked is None and all(a.meta["val"].device.type == device.type for a in inputs)
        else:
            # made from literals: on the CPU where it names no device (`_to_copy(0.125)`)
            movable = asked is None or torch.device(asked).type == "cpu"
        if not movable:
            continue
        if not inputs:  # made from literals: told where to be made
            n.kwargs = {**n.kwargs, "device": device}
        _declare_on(n, device)


def _unwrap_effects(gm: torch.fx.GraphModule) -> None:
    """AOT autograd threads a token through ops with side effects (`with_effects(token, op,
    *args)`, e.g. `_linalg_check_errors`) so that they stay ordered and alive. The wrapper runs
    steps in graph order and keeps calls without results, so the op becomes a plain call and the
    returned token is the token that came in."""
    effects = getattr(torch.ops.higher_order, "with_effects", None)
    changed = False
    for n in list(gm.graph.nodes):
        if effects is None or n.op != "call_function" or n.target is not effects:
            continue
        if any(u.target is not operator.getitem for u in n.users):
            continue  # an unexpected use: leave this node as it is (the graph then runs eagerly)
        token, op, *args = n.args
        results = list(n.meta.get("val") or ())[1:]
        with gm.graph.inserting_before(n):
            call = gm.graph.call_function(op, tuple(args), dict(n.kwargs))
        call.meta["val"] = None if not results else results[0] if len(results) == 1 else tuple(results)
        for user in list(n.users):
            index = user.args[1]
            if index == 0:
                user.replace_all_uses_with(token)
            elif len(results) == 1:
                user.replace_all_uses_with(call)
            else:
                with gm.graph.inserting_before(user):
                    item = gm.graph.call_function(operator.getitem, (call, index - 1))
                item.meta = dict(user.meta)
                user.replace_all_uses_with(item)
            gm.graph.erase_node(user)
        gm.graph.erase_node(n)
        changed = True
    if changed:
        gm.recompile()


_CLAMPS = {
    torch.ops.aten.clamp.default: (1, 2),
    torch.ops.aten.clamp_min.default: (1,),
    torch.ops.aten.clamp_max.default: (1,),
}


@functools.lru_cache(None)
def _eager_wraps_clamp_bounds() -> bool:
    """Whether this torch's clamp converts an integer bound past the tensor's range to the
    tensor's type, wrapping (torch 2.11: clamp(uint8, min=-1) is 255 everywhere), rather than
    letting it bound nothing (later versions keep the values)."""
    try:
        return int(torch.clamp(torch.tensor([4], dtype=torch.uint8), min=-1)) == 255
    except RuntimeError:
        return False


def _wrap_integer_clamp_bounds(gm: torch.fx.GraphModule) -> None:
    """Gives clamps of integer tensors the bounds eager's kernel uses, where this torch wraps an
    out-of-range bound into the type (the lowering lets such a bound clamp nothing)."""
    changed = False
    for n in gm.graph.nodes:
        positions = _CLAMPS.get(n.target) if n.op == "call_function" else None
        val = n.meta.get("val")
        if positions is None or not isinstance(val, torch.Tensor) or val.dtype.is_floating_point \
                or val.dtype in (torch.bool, torch.int64) or not _eager_wraps_clamp_bounds():
            continue
        info = torch.iinfo(val.dtype)
        args = list(n.args)
        for i in positions:
            bound = args[i] if i < len(args) else None
            if isinstance(bound, int) and not isinstance(bound, bool) and not info.min <= bound <= info.max:
                span = info.max - info.min + 1
                args[i] = (bound - info.min) % span + info.min
                changed = True
        n.args = tuple(args)
    if changed:
        gm.recompile()
