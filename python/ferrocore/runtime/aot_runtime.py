"""AOT autograd's runtime, rebuilt for graphs that skip AOT autograd: those loaded from the
compiled-graph cache, and inference graphs traced directly (`direct_trace`).

What AOT autograd's runtime wrappers would do around the compiled graphs is done here instead,
from a description recorded while AOT autograd compiled them (`inference_runtime`,
`training_runtime` + `add_backward`, stored as JSON in the entry), or, for a directly traced
graph, the plain inference runtime (`plain_inference_runtime`).
Only the plain cases are described: no input mutations applied outside the graph, no outputs
aliasing inputs or intermediates, no tensor subclasses, effect tokens, functionalized random
numbers, or symbolic sizes saved for the backward. Anything else raises `Bypass` and the graph
is compiled again in every process, as before.

A training graph runs as AOT autograd runs it: an autograd.Function whose forward calls the
compiled forward and saves the activations it returns, and whose backward passes the saved
activations and the incoming gradients (laid out as the backward was compiled for) to the
compiled backward.
"""

from __future__ import annotations

import torch
from torch._dynamo import disable

from .graph_cache import Bypass


def _fw_metadata():
    ctx = torch._guards.TracingContext.try_get()
    meta = getattr(ctx, "fw_metadata", None) if ctx is not None else None
    if meta is None:
        raise Bypass("AOT autograd's metadata is not available")
    return meta


def _check_plain(meta) -> None:
    checks = {
        "outputs alias inputs or each other": getattr(meta, "num_outputs_aliased", 1),
        "inputs are mutated outside the graph": getattr(meta, "num_mutated_inp_runtime_indices", 1),
        "intermediate bases are returned": getattr(meta, "num_intermediate_bases", 1),
        "effect tokens are threaded": len(getattr(meta, "tokens", ()) or ()),
        "random-number ops are functionalized": int(bool(getattr(meta, "is_rng_op_functionalized", True))),
        "random-number states are graph inputs": getattr(meta, "num_graphsafe_rng_states", 0),
        "grad mode is changed by the graph": int(getattr(meta, "grad_enabled_mutation", None) is not None),
        "outputs have dynamic sizes": int(bool(getattr(meta, "dynamic_outputs", False))),
        "tensor subclasses": int(any(type(m).__name__ == "SubclassCreationMeta"
                                     for m in (*(getattr(meta, "subclass_inp_meta", ()) or ()),
                                               *(getattr(meta, "subclass_fw_graph_out_meta", ()) or ())))),
    }
    for why, count in checks.items():
        if count:
            raise Bypass(f"AOT runtime: {why}")


def _autocast_on() -> bool:
    return bool(torch._C._is_any_autocast_enabled())


# ---- inference ---------------------------------------------------------------------------------


def inference_runtime() -> dict:
    """What AOT autograd's runtime does around the inference graph it is about to compile, when
    that is a plain call (read from its metadata); raises Bypass otherwise."""
    meta = _fw_metadata()
    _check_plain(meta)
    return {**plain_inference_runtime(),
            "written_inputs": [i for i, info in enumerate(meta.input_info) if info.mutates_data or info.mutates_metadata]}


def plain_inference_runtime() -> dict:
    """The runtime of an inference graph with no aliased outputs or input mutations: a call
    with grad off, and with autocast off if it was on when the graph was traced."""
    return {"disable_amp": _autocast_on(), "written_inputs": []}


def written_inputs(count: int) -> list | None:
    """The positions of the inputs the graph AOT autograd is compiling writes into, among the
    `count` inputs Dynamo passes; None where AOT's inputs are not Dynamo's (overlapping inputs
    it merged into one base) or its metadata is not available."""
    try:
        infos = list(_fw_metadata().input_info)
    except Bypass:
        return None
    if len(infos) != count:
        return None
    return [i for i, info in enumerate(infos) if info.mutates_data or info.mutates_metadata]


def inference_call(graph_call, runtime: dict, boxed: bool):
    """The callable Dynamo gets for a cached inference graph: as AOT autograd runs one, with grad
    off (and autocast off if it was on at compile time)."""

    def run(args):
        grad = torch.is_grad_enabled()
        if grad:
            torch._C._set_grad_enabled(False)
        try:
            if runtime["disable_amp"]:
                with torch._C._DisableAutocast():
                    return graph_call(args)
            return graph_call(args)
        finally:
            if grad:
                torch._C._set_grad_enabled(True)

    return _dynamo_callable(run, boxed)


def _dynamo_callable(run, boxed: bool):
    if boxed:
        run._boxed_call = True
        return run
    return lambda *args: run(list(args))


# ---- training ----------------------------------------------------------------------------------


def training_runtime(fw_graph: torch.fx.GraphModule) -> dict:
    """The forward's half of a training graph's runtime, read from AOT autograd's metadata as
    its forward is compiled: which outputs go to the user and which are saved for the backward,
    which outputs are not differentiable, whose gradients the backward takes. Raises Bypass
    where the runtime is more than that."""
    meta = _fw_metadata()
    _check_plain(meta)
    if getattr(meta, "num_symints_saved_for_bw", None) != 0:
        raise Bypass("AOT runtime: sizes are saved for the backward")
    returns = meta.num_forward_returns
    outs = list(fw_graph.graph.output_node().args[0])
    saved = outs[returns:]
    if not all(isinstance(o, torch.fx.Node) and isinstance(o.meta.get("val"), torch.Tensor) for o in saved):
        raise Bypass("AOT runtime: the forward saves values other than tensors")
    infos = list(meta.output_info)
    if len(infos) != returns:
        raise Bypass("AOT runtime: the forward returns more than the user's outputs")
    return {
        "kind": "training",
        "returns": returns,
        "saved": len(saved),
        # AOT autograd saves these without a version-counter check (ctx attributes)
        "saved_unchecked": int(getattr(meta, "num_tensors_saved_with_no_vc_check", 0) or 0),
        # a saved activation that is a view is saved detached, unless it is a graph input
        "saved_is_input": [o.op == "placeholder" for o in saved],
        "non_differentiable": [i for i, info in enumerate(infos) if not info.requires_grad],
        "with_gradient": [i for i, info in enumerate(infos)
                          if issubclass(info.raw_type, torch.Tensor)
                          and getattr(info, "requires_grad_for_backward", info.requires_grad)],
        "unsafe_views": list(getattr(meta, "unsafe_view_out_indices", ()) or ()),
        # inputs the graph writes into that autograd sees: their version counters move
        "bumped_inputs": list(getattr(meta, "mutated_graph_handled_indices_seen_by_autograd", ()) or ()),
        "inputs_requiring_grad": [bool(info.requires_grad) for info in meta.input_info],
        "inputs_non_leaf": [bool(info.requires_grad and not getattr(info, "is_leaf", False))
                            for info in meta.input_info],
        "deterministic": getattr(meta, "deterministic", None),
        "disable_amp": _autocast_on(),
        "written_inputs": [i for i, info in enumerate(meta.input_info) if info.mutates_data or info.mutates_metadata],
    }


def direct_training_runtime(joint, saved_is_input: list, example_inputs, unsafe_views: list) -> dict:
    """The runtime of a training graph traced and split by ferrocore (`direct_trace.trace_joint`,
    `joint_split`), in `training_runtime`'s form; `add_backward` completes it."""
    requires = list(joint.requires_grad)
    return {
        "kind": "training",
        "returns": joint.num_outputs,
        "saved": len(saved_is_input),
        "saved_unchecked": 0,
        "saved_is_input": list(saved_is_input),
        "non_differentiable": [i for i in range(joint.num_outputs) if i not in joint.differentiable],
        "with_gradient": list(joint.differentiable),
        "unsafe_views": list(unsafe_views),
        "bumped_inputs": list(joint.written),
        "inputs_requiring_grad": requires,
        "inputs_non_leaf": [bool(r and not x.is_leaf) for r, x in zip(requires, example_inputs)],
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "disable_amp": _autocast_on(),
        "written_inputs": list(joint.written),
    }


def add_backward(runtime: dict, bw_graph: torch.fx.GraphModule, bw_inputs, donated: list) -> dict:
    """A training runtime completed from the backward AOT autograd hands the compiler: the
    layout each incoming gradient must have, the inputs whose gradient is statically None
    (detached before the call, as AOT autograd does), the saved activations the backward frees."""
    placeholders = [n for n in bw_graph.graph.nodes if n.op == "placeholder"]
    examples = list(bw_inputs) if bw_inputs is not None else [n.meta.get("val") for n in placeholders]
    tangents = examples[runtime["saved"]:]
    if len(examples) != len(placeholders) or len(tangents) != len(runtime["with_gradient"]):
        raise Bypass("AOT runtime: the backward's inputs are not the saved activations and the gradients")
    if not all(isinstance(t, torch.Tensor) for t in tangents):
        raise Bypass("AOT runtime: a gradient input is not a tensor")
    grads = list(bw_graph.graph.output_node().args[0])
    if len(grads) != len(runtime["inputs_requiring_grad"]):
        raise Bypass("AOT runtime: the backward does not return one gradient per input")
    runtime["tangent_layouts"] = [[list(t.shape), list(t.stride())] for t in tangents]
    runtime["detached_inputs"] = [i for i, g in enumerate(grads) if g is None and runtime["inputs_non_leaf"][i]]
    runtime["donated"] = list(donated)
    return runtime


def training_call(fw_call, bw_call, runtime: dict, boxed: bool):
    """The callable Dynamo gets for a cached or directly traced training graph. Neither it nor
    the backward is Dynamo's to trace (a backward run from a compiled frame would be)."""
    bw_call = disable(bw_call, reason="do not trace the compiled backward")
    function = _autograd_function(fw_call, bw_call, runtime)
    detached, bumped = runtime["detached_inputs"], runtime["bumped_inputs"]

    def run(args):
        for i in detached:
            if isinstance(args[i], torch.Tensor):
                args[i] = args[i].detach()
        if bumped:
            torch.autograd.graph.increment_version(tuple(args[i] for i in bumped))
        replay = torch._C._is_view_replay_enabled()
        try:
            if not replay:
                torch._C._set_view_replay_enabled(True)
            with torch.enable_grad():
                outs = function.apply(*args)
        finally:
            if not replay:
                torch._C._set_view_replay_enabled(False)
        return list(outs)

    return _dynamo_callable(disable(run, reason="do not trace the compiled graph"), boxed)


def _autograd_function(fw_call, bw_call, runtime: dict) -> type:
    returns, n_saved, unchecked = runtime["returns"], runtime["saved"], runtime["saved_unchecked"]
    saved_is_input, non_diff = runtime["saved_is_input"], runtime["non_differentiable"]
    with_gradient, layouts = runtime["with_gradient"], runtime["tangent_layouts"]
    unsafe_views, donated, disable_amp = runtime["unsafe_views"], runtime["donated"], runtime["disable_amp"]
    deterministic = runtime["deterministic"]

    def call(fn, args):
        if disable_amp:
            with torch._C._DisableAutocast():
                return list(fn(args))
        return list(fn(args))

    class CompiledTraining(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            outs = call(fw_call, list(args))
            saved = [x if saved_is_input[i] or not x._is_view() else x.detach()
                     for i, x in enumerate(outs[returns:returns + n_saved])]
            checked = n_saved - unchecked
            ctx.save_for_backward(*saved[:checked])
            ctx.unchecked = saved[checked:]
            user = outs[:returns]
            for i in unsafe_views:
                user[i] = torch.ops.aten._unsafe_view(user[i], user[i].shape)
            ctx.mark_non_differentiable(*(user[i] for i in non_diff if isinstance(user[i], torch.Tensor)))
            ctx._materialize_non_diff_grads = False
            return tuple(user)

        @staticmethod
        def backward(ctx, *grads):
            if deterministic is False and torch.are_deterministic_algorithms_enabled():
                raise RuntimeError("This compiled backward function is being run with "
                                   "torch.use_deterministic_algorithms(True), but it was compiled while "
                                   "torch.use_deterministic_algorithms(False) was set.")
            args = [*ctx.saved_tensors, *ctx.unchecked]
            args.extend(_laid_out(grads[i], layout) for i, layout in zip(with_gradient, layouts))
            ctx.unchecked = []
            if hasattr(ctx, "maybe_clear_saved_tensors"):
                ctx.maybe_clear_saved_tensors()
            if donated and torch._C._autograd._get_current_graph_task_keep_graph():
                # the backward may write into the activations donated to it, which a retained
                # graph reads again: it gets copies (AOT autograd would compile another backward)
                for i in donated:
                    args[i] = _restrided(args[i], args[i].shape, args[i].stride())
            if torch.is_grad_enabled():
                return _NoDoubleBackward.apply(lambda: tuple(call(bw_call, args)), *_with_grad_leaf(args))
            return tuple(call(bw_call, args))

    return CompiledTraining


def _laid_out(grad, layout):
    """An incoming gradient with the shape and strides the compiled backward reads it with (AOT
    autograd coerces tangents the same way)."""
    shape, stride = layout
    if not isinstance(grad, torch.Tensor) or (list(grad.shape) == shape and list(grad.stride()) == stride):
        return grad
    return _restrided(grad, shape, stride)


def _restrided(t: torch.Tensor, shape, stride) -> torch.Tensor:
    out = torch.empty_strided(shape, stride, dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out


def _with_grad_leaf(args: list) -> list:
    # the graph must be connected for a second backward to reach _NoDoubleBackward's error
    if any(isinstance(t, torch.Tensor) and t.requires_grad for t in args):
        return args
    return [torch.empty(0, requires_grad=True), *args]


class _NoDoubleBackward(torch.autograd.Function):
    """The backward run under create_graph=True: its result is differentiable in form only."""

    @staticmethod
    def forward(ctx, run, *unused):
        return run()

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("torch.compile with aot_autograd does not currently support double backward")
