"""Graphs traced to core ATen in one lean pass, without AOT autograd.

For an inference graph, AOT autograd traces Dynamo's graph twice under fake tensors (a
functionalized pass that learns how outputs alias inputs and which inputs are written, then
`make_fx` under functionalization), and that costs 5–8x what running the graph on fake tensors
costs; for a training graph it traces the joint graph likewise and then partitions it.
`trace` runs Dynamo's graph once on Dynamo's fake tensors under a dispatch mode that records
each ATen op into a new graph, applying the same decompositions in the same places as
`make_fx`. Writes into fresh intermediates are recorded as their functional ops (what
functionalization gives for them); the resulting graph is AOT autograd's inference graph, node
for node (`tests/test_direct_trace.py` compares them across the model zoo). `trace_joint` does
the same with autograd on and then records `torch.autograd.grad`: AOT autograd's joint graph,
which `joint_split` splits into forward and backward.

What the lean pass does not handle raises `NeedsAot` with the reason, and the graph goes
through AOT autograd as before: symbolic sizes, parameters held by the graph module,
higher-order ops, grad-mode changes (in a training graph: grad mode left off), data-dependent
ops, writes into a tensor that has views, into a view of anything but a dense tensor the graph
made (such a write is a scatter into its base, `as_strided_scatter`, whose other views are read
anew), or into inputs autograd tracks (any input, for inference), and outputs aliasing inputs or
each other. Around an inference graph traced here, AOT autograd's runtime is
a call with grad off (`aot_runtime.inference_call`); around a training graph, its
autograd.Function (`aot_runtime.training_call`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import operator
import weakref

import torch
from torch._dispatch.python import enable_python_dispatcher
from torch._dynamo.utils import preserve_rng_state
from torch._functorch.aot_autograd import aot_autograd_decompositions
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils.weak import WeakIdKeyDictionary

from .fake_calls import FakeCalls
from .serialize import module_attr
from .traced_attention import (TracedAttention, flex_attention, is_attention, is_flex_attention,
                               without_random_state)


class NeedsAot(Exception):
    """The graph needs AOT autograd; the message says why."""


# Dynamo graph calls that change the grad mode for the rest of the graph
_GRAD_MODE_CHANGES = {torch._C._set_grad_enabled, torch.autograd.grad_mode.set_grad_enabled}
# node meta an ATen node takes from the Dynamo node it came from (as `make_fx` under
# `preserve_node_meta` copies it)
_COPIED_META = ("stack_trace", "nn_module_stack", "source_fn_stack", "torch_fn", "from_node", "custom")
_SHAPE_QUERIES = {torch.ops.aten.size.default, torch.ops.aten.stride.default, torch.ops.aten.storage_offset.default}


def check_graph(gm: torch.fx.GraphModule, example_inputs, training: bool = False) -> None:
    """Raises NeedsAot when Dynamo's graph cannot be traced here (checked before tracing). A
    training graph may switch grad mode off and on again (`torch.no_grad()` blocks)."""
    if not isinstance(gm, torch.fx.GraphModule):
        raise NeedsAot("the graph takes nested inputs")
    if torch.is_inference_mode_enabled():
        raise NeedsAot("inference mode is on")
    if torch._functorch.config.functionalize_rng_ops:
        raise NeedsAot("random-number ops are functionalized")
    if next(gm.parameters(), None) is not None or next(gm.buffers(), None) is not None:
        raise NeedsAot("the graph module holds parameters or buffers")
    for x in example_inputs:
        if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise NeedsAot("an input is a symbolic size")
        if type(x) not in (torch.Tensor, torch.nn.Parameter):
            raise NeedsAot(f"an input is a {type(x).__name__}")
    for node in gm.graph.nodes:
        if node.op == "call_module":
            raise NeedsAot(f"{node.name} calls a module")
        if node.op == "get_attr" and not isinstance(value := module_attr(gm, node.target), torch.Tensor) and not (
                isinstance(value, torch.fx.GraphModule) and all(is_flex_attention(u.target) for u in node.users)):
            raise NeedsAot(f"{node.name} is a {type(value).__name__}")
        if node.op == "call_function" and ((isinstance(node.target, torch._ops.HigherOrderOperator)
                                            and not is_flex_attention(node.target))
                                           or (node.target in _GRAD_MODE_CHANGES and not training)):
            raise NeedsAot(f"{node.name} calls {getattr(node.target, '__name__', node.target)}")
        if _symbolic(node.meta.get("example_value")):
            raise NeedsAot(f"{node.name} has symbolic sizes")


def static_inputs(gm: torch.fx.GraphModule) -> list:
    """The inputs Dynamo marks as keeping their addresses (parameters, buffers): AOT autograd's
    `static_input_indices` for a graph module without parameters of its own."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return [i for i, n in enumerate(placeholders) if n.meta.get("tensor_dict", {}).get("_dynamo_static_input_type")]


def _symbolic(val) -> bool:
    if isinstance(val, (list, tuple)):
        return any(_symbolic(v) for v in val)
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return True
    if isinstance(val, torch.Tensor):
        return any(isinstance(s, torch.SymInt) for s in (*val.shape, *val.stride()))
    return False


def trace(gm: torch.fx.GraphModule, example_inputs, decompositions: dict,
          as_written: bool = False) -> torch.fx.GraphModule:
    """Dynamo's graph as the core-ATen inference graph AOT autograd would give for it (with a
    tensor constant of one element as a `scalar_tensor`, unless `as_written`); raises NeedsAot
    for what only AOT autograd handles. Call `check_graph` first."""
    with _tracing(example_inputs, decompositions, scalar_constants=not as_written) as (recorder, fakes):
        outputs = _run(gm, fakes, recorder)
    recorder.finish(outputs)
    recorder.graph.eliminate_dead_code()
    return graph_module(recorder.root, recorder.graph)


@dataclasses.dataclass
class Joint:
    """A training graph's joint trace: placeholders are the primals (Dynamo's inputs) then one
    tangent per differentiable output; outputs are the forward's outputs, then each written
    input's new value (`copy_` nodes, see `written`), then one gradient per primal (None where
    the primal takes none)."""

    graph: torch.fx.GraphModule
    num_outputs: int  # the forward's user outputs
    differentiable: list  # positions of the outputs that take a tangent
    written: list  # positions of the primals the forward writes into
    requires_grad: list  # per primal
    # differentiable outputs that view an intermediate: returned through `_unsafe_view`, as AOT
    # autograd returns them, so that autograd sees plain outputs
    unsafe_views: list


def trace_joint(gm: torch.fx.GraphModule, example_inputs, decompositions: dict, logs: tuple = (),
                as_written: bool = False, backend: str = "auto") -> Joint:
    """Dynamo's graph as the joint forward-backward ATen graph AOT autograd would trace for it:
    the forward run with autograd on, then `torch.autograd.grad` of its differentiable outputs
    with respect to the primals that require grad, both recorded. Attention is decided as it is
    traced (`traced_attention`: masks the compiler proves open or causal left out, written-out
    attention run as the fused call; said on the `causal_mask` and `attention` channels of
    `logs`; `backend`: the compiler's option, whether its kernels are Triton's), and one-element
    tensor constants are recorded as `scalar_tensor`; `as_written`
    traces the graph as AOT autograd does. Raises NeedsAot for what only AOT autograd handles.
    Call `check_graph` first."""
    requires = [isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs]
    tracing = _tracing(example_inputs, decompositions, writable_inputs=True, scalar_constants=not as_written)
    with tracing as (recorder, fakes):
        primals = [f.detach().requires_grad_(r) for f, r in zip(fakes, requires)]
        attention = None
        if not as_written:
            attention = TracedAttention(recorder.graph, recorder.root, recorder.nodes.get, recorder.keep_values(), logs,
                                        backend)
        with torch.enable_grad():
            outputs = _run(gm, primals, recorder, attention)
            if not torch.is_grad_enabled():
                raise NeedsAot("the graph leaves grad mode off")
            outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
            differentiable = [i for i, o in enumerate(outputs) if isinstance(o, torch.Tensor) and o.requires_grad]
            for i in differentiable:
                if not outputs[i].is_contiguous():
                    raise NeedsAot("a differentiable output is not contiguous")
            tangents = [recorder.tangent(outputs[i]) for i in differentiable]
            wrt = [p for p, r in zip(primals, requires) if r]
            recorder.meta = {}
            grads = []
            if wrt and differentiable:
                with recorder:
                    grads = list(torch.autograd.grad([outputs[i] for i in differentiable], wrt, tangents,
                                                     allow_unused=True))
    grads_iter = iter(grads)
    per_primal = [next(grads_iter, None) if r else None for r in requires]
    written = recorder.finish(outputs, gradients=per_primal)
    without_random_state(recorder.graph)
    recorder.graph.eliminate_dead_code()
    unsafe_views = [i for i in differentiable if outputs[i]._base is not None and outputs[i]._base.requires_grad]
    return Joint(graph_module(recorder.root, recorder.graph), len(outputs), differentiable, written, requires,
                 unsafe_views)


@contextlib.contextmanager
def _tracing(example_inputs, decompositions: dict, writable_inputs: bool = False, scalar_constants: bool = True):
    """The recorder and Dynamo's fake inputs, with the modes a trace runs under."""
    fake_mode = torch._guards.detect_fake_mode(example_inputs)
    if fake_mode is None:
        raise NeedsAot("Dynamo's fake mode is not active")
    recorder = _Recorder({**aot_autograd_decompositions, **decompositions}, fake_mode, writable_inputs,
                         scalar_constants)
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.autograd.set_multithreading_enabled(False))
        stack.enter_context(preserve_rng_state())
        stack.enter_context(enable_python_dispatcher())
        nested = getattr(torch._dynamo.eval_frame, "_use_eager_on_nested_compile", None)
        if nested is not None:
            stack.enter_context(nested())
        fakes = [fake_mode.from_tensor(x, static_shapes=True) for x in example_inputs]
        with fake_mode:
            yield recorder, fakes


# an autograd node's metadata key: the stack trace of the Dynamo node that made it, which the
# backward ops it runs take (`_Recorder._annotate`), as AOT autograd's do by `seq_nr`
_FORWARD_TRACE = "ferrocore_forward_trace"


def _tag_autograd_nodes(result, trace: str | None) -> None:
    """Tags the autograd nodes not tagged yet behind `result` (the ones its Dynamo node made)."""
    if not trace or not torch.is_grad_enabled():
        return
    todo = [t.grad_fn for t in torch.utils._pytree.tree_leaves(result) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    while todo:
        fn = todo.pop()
        if fn is None or _FORWARD_TRACE in fn.metadata:
            continue
        fn.metadata[_FORWARD_TRACE] = trace
        todo.extend(next_fn for next_fn, _ in fn.next_functions)


def _run(gm: torch.fx.GraphModule, fakes: list, recorder: "_Recorder", attention: TracedAttention | None = None):
    """Runs Dynamo's graph on fake tensors with the recorder on; returns its outputs.
    `attention` decides attention as it is traced (a training trace's)."""
    env: dict = {}
    load = lambda a: torch.fx.node.map_arg(a, env.__getitem__)  # noqa: E731
    placeholders = iter(fakes)
    for node in gm.graph.nodes:
        recorder.meta = node.meta
        if node.op == "placeholder":
            env[node] = recorder.placeholder(next(placeholders))
        elif node.op == "get_attr":
            value = module_attr(gm, node.target)
            # (a FlexAttention call's score_mod or mask_mod: run as a function)
            env[node] = value if isinstance(value, torch.fx.GraphModule) else recorder.constant(value)
        elif node.op == "call_function":
            args, kwargs = load(node.args), load(node.kwargs)
            if attention is not None and is_attention(node.target):
                args, kwargs = attention.arguments(node.name, args, kwargs)
            target = flex_attention if is_flex_attention(node.target) else node.target
            with recorder:
                env[node] = target(*args, **kwargs)
                if attention is not None:
                    env[node] = attention.after(node, env[node])
            _tag_autograd_nodes(env[node], node.meta.get("stack_trace"))
        elif node.op == "call_method":
            self_arg, *args = load(node.args)
            with recorder:
                env[node] = getattr(self_arg, node.target)(*args, **load(node.kwargs))
                if attention is not None:
                    env[node] = attention.after(node, env[node])
            _tag_autograd_nodes(env[node], node.meta.get("stack_trace"))
        elif node.op == "output":
            return load(node.args[0])
        else:
            raise NeedsAot(f"{node.name}: {node.op} nodes")
    raise NeedsAot("the graph has no output")


class _Recorder(TorchDispatchMode):
    """Records the ATen ops that reach it into `graph`, each tensor's producing node by its id."""

    def __init__(self, decompositions: dict, fake_mode, writable_inputs: bool = False,
                 scalar_constants: bool = True) -> None:
        super().__init__()
        self.writable_inputs = writable_inputs
        # a one-element constant (`torch.tensor(-inf)` in FlexAttention's dense form) recorded as
        # the `scalar_tensor` it is, so that the graph passes read its value
        self.scalar_constants = scalar_constants
        self.prefix = "primals_" if writable_inputs else "arg"
        self.inputs: dict[int, int] = {}  # id of a placeholder's tensor -> its position
        self.written: dict[int, torch.Tensor] = {}  # position -> the input tensor written into
        self.tangents = 0
        self.table = decompositions
        self.fake_mode = fake_mode
        self.fake_calls = FakeCalls(fake_mode)
        self.root = torch.nn.Module()
        self.graph = torch.fx.Graph()
        self.meta: dict = {}  # the meta of the Dynamo node being run
        # tensor -> the node that made it; weak, as make_fx's proxy slots are
        self.nodes = WeakIdKeyDictionary()
        self.values: weakref.WeakValueDictionary | None = None  # node -> its tensor (`keep_values`)
        self.storages: dict = {}  # storage -> how many recorded tensors have lived on it
        self.read_only: dict[int, torch.Tensor] = {}  # inputs and constants (held: ids stay unique)
        self.placeholders = 0
        self.constants = 0

    # ---- tensors and their nodes ----

    def bind(self, tensor: torch.Tensor, node: torch.fx.Node, val: torch.Tensor | None = None) -> None:
        node.meta["val"] = tensor if val is None else val
        self.nodes[tensor] = node
        if self.values is not None:
            self.values[node] = tensor
        ref = StorageWeakRef(tensor.untyped_storage())
        self.storages[ref] = self.storages.get(ref, 0) + 1

    def keep_values(self) -> weakref.WeakValueDictionary:
        """From now on, each recorded node's tensor while it lives (what `traced_attention`
        reads its new ops' inputs from); a trace that reads none does not keep them."""
        self.values = weakref.WeakValueDictionary()
        return self.values

    def placeholder(self, fake: torch.Tensor) -> torch.Tensor:
        name = f"primals_{self.placeholders + 1}" if self.writable_inputs else f"arg{self.placeholders}_1"
        node = self.graph.placeholder(name)
        self.bind(fake, node, val=fake)
        self.inputs[id(fake)] = self.placeholders
        self.placeholders += 1
        self.read_only[id(fake)] = fake
        return fake

    def tangent(self, output: torch.Tensor) -> torch.Tensor:
        """A placeholder after the primals for the gradient of `output` (contiguous)."""
        last = [n for n in self.graph.nodes if n.op == "placeholder"][-1]
        self.tangents += 1
        with self.graph.inserting_after(last):
            node = self.graph.placeholder(f"tangents_{self.tangents}")
        fake = torch.empty(output.shape, dtype=output.dtype, device=output.device)
        self.bind(fake, node, val=fake)
        self.read_only[id(fake)] = fake
        return fake

    def constant(self, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor the graph holds (a Dynamo get_attr, or a constant an op reads)."""
        name = f"_tensor_constant{self.constants}"
        self.constants += 1
        setattr(self.root, name, tensor)
        node = self.graph.get_attr(name)
        self._annotate(node)
        fake = self.fake_mode.from_tensor(tensor, static_shapes=True)
        self.bind(fake, node, val=fake)
        self.read_only[id(fake)] = fake
        return fake

    def _node_of(self, value):
        if isinstance(value, torch.Tensor):
            node = self.nodes.get(value)
            if node is not None:
                return node
            if isinstance(value, torch._subclasses.FakeTensor):
                raise NeedsAot("an op reads a tensor the graph did not make")
            return self.nodes[self.constant(value)]
        if isinstance(value, (list, tuple)):
            return type(value)(self._node_of(v) for v in value)
        if isinstance(value, dict):
            return {k: self._node_of(v) for k, v in value.items()}
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise NeedsAot("an op takes a symbolic value")
        return value

    def _annotate(self, node: torch.fx.Node) -> None:
        for key in _COPIED_META:
            if key in self.meta:
                node.meta[key] = self.meta[key]
        if "stack_trace" not in self.meta:
            running = torch._C._current_autograd_node()  # a backward op: its forward op's line
            trace = running.metadata.get(_FORWARD_TRACE) if running is not None else None
            if trace:
                node.meta["stack_trace"] = trace

    # ---- ops ----

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.prim.device.default:
            # (thousands of calls a trace) what FakeTensor answers, without the dispatch there
            x = args[0]
            if type(x) is torch._subclasses.FakeTensor and not x.fake_mode.in_kernel_invocation:
                return x.fake_device
            return func(*args)
        kwargs = kwargs or {}
        if func._schema.is_mutable:
            # before any decomposition: functionalization turns `hardswish_` into `hardswish`,
            # whose decomposition make_fx then records
            return self._write(func, args, kwargs)
        decomposition = self.table.get(func)
        if decomposition is not None:
            with self:
                out = decomposition(*args, **kwargs)
            if out is not NotImplemented:
                return out
        if func not in _SHAPE_QUERIES and _composite_implicit(func, args, kwargs):
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        if torch.Tag.data_dependent_output in func.tags or func is torch.ops.aten.is_nonzero.default:
            raise NeedsAot(f"{func} reads tensor data")
        if func is torch.ops.aten.lift_fresh.default:
            t = args[0]
            if (self.scalar_constants and t.dim() == 0 and type(t) is torch.Tensor
                    and not t.requires_grad and not t.is_complex()):
                with _disable_current_modes():  # (the value itself: no op to record)
                    value = t.item()
                with self:
                    return torch.ops.aten.scalar_tensor.default(value, dtype=t.dtype, device=t.device)
            func = torch.ops.aten.lift_fresh_copy.default  # the constant stays unwritten (as make_fx)
        node = self.graph.create_node("call_function", func, self._node_of(args), self._node_of(_explicit(func, kwargs)),
                                      name=func.overloadpacket.__name__)
        out = self.fake_calls(func, args, kwargs)
        self._annotate(node)
        if is_factory(func) and isinstance(out, torch.Tensor):
            # torch's factory functions detach a result Python still holds: the node keeps an alias
            self.bind(out, node, val=out.detach())
        else:
            self._bind_outputs(out, node)
        return out

    def _bind_outputs(self, out, node: torch.fx.Node) -> None:
        if isinstance(out, torch.Tensor):
            self.bind(out, node)
        elif isinstance(out, (tuple, list)):
            node.meta["val"] = out
            for i, o in enumerate(out):
                if isinstance(o, torch.Tensor):
                    item = self.graph.create_node("call_function", operator.getitem, (node, i), name="getitem")
                    self._annotate(item)
                    self.bind(o, item)
                elif o is not None and type(o) not in (int, float, bool):  # (flash attention's sizes)
                    raise NeedsAot(f"{node.target} returns a {type(o).__name__}")
        elif out is None:
            node.meta["val"] = None
        else:
            raise NeedsAot(f"{node.target} returns a {type(out).__name__}")

    def _write(self, func, args, kwargs):
        """An in-place op on a fresh intermediate, recorded as its functional op (what
        functionalization records: `relu_` as `relu`, `as_strided_` as the view `as_strided`);
        later reads of the tensor read the functional op's result. An op with a `_functional`
        twin (batch norm's running statistics) is recorded as the twin, whose last results are
        the written arguments' new values."""
        written = [a for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        packet = func.overloadpacket.__name__
        twin = getattr(getattr(torch.ops.aten, packet + "_functional", None), func._overloadname, None)
        if func.namespace == "aten" and twin is not None:
            return self._write_through_twin(func, twin, written, args, kwargs)
        if (func.namespace != "aten" or not packet.endswith("_") or len(written) != 1
                or written[0] is not func._schema.arguments[0] or not isinstance(args[0], torch.Tensor)):
            raise NeedsAot(f"{func} writes into a tensor")
        target = args[0]
        base = None if torch.Tag.inplace_view in func.tags else self._fresh_base(target)
        if base is None:
            self._check_writable(func, target)
        form = _functional_form(func)
        if form is None:
            raise NeedsAot(f"{func} has no functional form")
        functional, defaults = form
        with self:
            out = functional(*args, *defaults[len(args):], **kwargs)
        if torch.Tag.inplace_view in func.tags:
            node = self.nodes[target]
            if node.meta.get("val") is target:
                node.meta["val"] = target.detach()  # the node keeps the sizes it made
            func(*args, **kwargs)  # the fake takes the view's sizes and strides
        if not isinstance(out, torch.Tensor) or not _same_layout(out, target):
            raise NeedsAot(f"{func} changes its tensor's layout")
        if base is not None:
            self._write_into_view(base, target, out)
        else:
            self.nodes[target] = self.nodes[out]
        return target

    def _fresh_base(self, target: torch.Tensor) -> torch.Tensor | None:
        """The base of `target` when it is a view of a dense tensor the graph made (no input,
        no constant), which a write into the view may rewrite (`_write_into_view`); else None."""
        base = target._base
        if base is None or target not in self.nodes or base not in self.nodes:
            return None
        if id(base) in self.read_only or id(target) in self.read_only or id(base) in self.inputs:
            return None
        if not base.is_contiguous() or base.storage_offset() != 0:
            return None
        return base

    def _write_into_view(self, base: torch.Tensor, target: torch.Tensor, value: torch.Tensor) -> None:
        """What functionalization makes of a write into a view of a fresh tensor: the base with
        the view's new `value` scattered in, and every live tensor on its storage read from that
        (autograd's backward of some views copies the gradient into an `as_strided` view of
        zeros it lays out itself)."""
        storage = StorageWeakRef(base.untyped_storage())
        aliases = [t for t in list(self.nodes.keys())
                   if t is not base and StorageWeakRef(t.untyped_storage()) == storage]
        with self:
            new_base = torch.ops.aten.as_strided_scatter.default(base, value, target.size(), target.stride(),
                                                                 target.storage_offset())
        self.nodes[base] = self.nodes[new_base]
        for alias in aliases:
            with self:
                view = torch.ops.aten.as_strided.default(new_base, alias.size(), alias.stride(), alias.storage_offset())
            self.nodes[alias] = self.nodes[view]

    def _write_through_twin(self, func, twin, written: list, args, kwargs):
        schema = func._schema
        bound = dict(zip((a.name for a in schema.arguments), args))
        bound.update(kwargs)
        targets = [bound.get(a.name) for a in written]
        if any(a.alias_info is not None for a in schema.returns) or not all(isinstance(t, torch.Tensor)
                                                                            for t in targets):
            raise NeedsAot(f"{func} writes into a tensor")
        for target in targets:
            self._check_writable(func, target, in_place=False)
        with self:
            outs = twin(*args, **kwargs)
        news = outs[len(outs) - len(targets):]
        for target, new in zip(targets, news):
            if new.dtype != target.dtype:  # (bfloat16 running statistics updated in float32)
                with self:
                    new = torch.ops.aten._to_copy.default(new, dtype=target.dtype)
            if not _same_layout(new, target):
                raise NeedsAot(f"{func} changes a written tensor's layout")
            self.nodes[target] = self.nodes[new]
        kept = outs[:len(outs) - len(targets)]
        return kept[0] if len(schema.returns) == 1 else tuple(kept)

    def _check_writable(self, func, target: torch.Tensor, in_place: bool = True) -> None:
        """Raises NeedsAot unless functionalization would turn this write into a new value: a
        fresh intermediate without views, or (in a joint trace) a whole input autograd does not
        track; a written input is recorded (the graph copies its new value back in)."""
        position = self.inputs.get(id(target))
        if position is not None and self.writable_inputs and not target.requires_grad \
                and target.is_contiguous() and not (in_place and torch.Tag.inplace_view in func.tags):
            self.written[position] = target
        elif id(target) in self.read_only or target not in self.nodes:
            raise NeedsAot(f"{func} writes into a graph input or constant")
        if target._base is not None or self.storages.get(StorageWeakRef(target.untyped_storage()), 0) > 1:
            raise NeedsAot(f"{func} writes into a tensor that has views")

    def finish(self, outputs, gradients: list | None = None) -> list:
        """The output node (the outputs, then `gradients` if given) after a `copy_` into each
        input written; raises NeedsAot for outputs AOT autograd's runtime must rebuild. Returns
        the positions of the inputs written."""
        inputs = {StorageWeakRef(v.untyped_storage()) for v in self.read_only.values()}
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        for position, tensor in sorted(self.written.items()):
            node = self.graph.create_node("call_function", torch.ops.aten.copy_.default,
                                          (placeholders[position], self.nodes[tensor]), name="copy_")
            node.meta["val"] = placeholders[position].meta["val"]
        seen = set()
        nodes = []
        for out in outputs if isinstance(outputs, (list, tuple)) else (outputs,):
            if not isinstance(out, torch.Tensor):
                raise NeedsAot(f"an output is a {type(out).__name__}")
            storage = StorageWeakRef(out.untyped_storage())
            if storage in inputs:
                raise NeedsAot("an output aliases an input")
            if storage in seen:
                raise NeedsAot("two outputs alias each other")
            seen.add(storage)
            nodes.append(self._node_of(out))
        for grad in gradients or ():
            nodes.append(None if grad is None else self._node_of(grad))
        self.graph.output(tuple(nodes))
        return sorted(self.written)


def _explicit(func, kwargs: dict) -> dict:
    """The keyword arguments without those that are None by default (a backward formula passes
    them; what functionalization records leaves them out)."""
    if not any(v is None for v in kwargs.values()):
        return kwargs
    defaults = {a.name for a in func._schema.arguments if a.kwarg_only and a.has_default_value()
                and a.default_value is None}
    return {k: v for k, v in kwargs.items() if not (v is None and k in defaults)}


def graph_module(root: torch.nn.Module, graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """A graph module whose Python code is generated at its first call, if any: ferrocore
    compiles the graph and never runs it (0.1 s a graph for a full-size model)."""
    return _LazyGraphModule(root, graph)


def _composite_implicit(func, args, kwargs) -> bool:
    """Whether `make_fx` would run this op's CompositeImplicitAutograd decomposition here: it has
    one, and the first tensor argument's backend has no kernel of its own (so autograd would
    have decomposed it, had it run)."""
    if not func.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeImplicitAutograd):
        return False
    for a in torch.utils._pytree.arg_tree_leaves(*args, **kwargs):
        if isinstance(a, torch.Tensor):
            backend = torch._C._parse_dispatch_key(torch._C._dispatch_key_for_device(a.device.type))
            return not torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), backend)
    return True


@functools.lru_cache(maxsize=None)
def _functional_form(func):
    """The functional overload of the in-place aten op `func` and the positional defaults to
    complete a call with, found as functionalization finds it: the overload of the same name
    (`relu_.default` -> `relu.default`, no defaults needed), else the one taking the same
    arguments (`bernoulli_.float` -> `bernoulli.p`, dropout's mask), with `func`'s defaults: the
    dispatcher leaves out trailing arguments at their defaults, which that overload may lack
    (`p=0.5`). None if there is none."""
    packet = getattr(torch.ops.aten, func.overloadpacket.__name__[:-1], None)
    if packet is None:
        return None
    same_name = getattr(packet, func._overloadname, None)
    if same_name is not None:
        return same_name, ()
    wanted = [(a.name, str(a.type), a.kwarg_only) for a in func._schema.arguments]
    for name in packet.overloads():
        overload = getattr(packet, name)
        if [(a.name, str(a.type), a.kwarg_only) for a in overload._schema.arguments] == wanted:
            # (an argument without a default is never left out, so its placeholder is never taken)
            defaults = tuple(a.default_value if a.has_default_value() else None
                             for a in func._schema.arguments if not a.kwarg_only)
            return overload, defaults
    return None


def _same_layout(a, b) -> bool:
    return (isinstance(b, torch.Tensor) and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
            and a.device == b.device and a.storage_offset() == b.storage_offset())


@functools.lru_cache(None)
def is_factory(func) -> bool:
    """Ops taking tensor options (arange, full, zeros_like...)."""
    return any(a.name == "pin_memory" for a in func._schema.arguments)
