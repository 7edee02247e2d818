"""Attention decided while a training graph is traced. A training graph's backward is traced
from the ops its forward ran, so what the compiler's graph passes rewrite after the trace
keeps the backward of what it replaced. Two decisions are therefore taken during the trace,
both by the compiler (Rust), each logged:

- Masks (`causal_mask` channel). Before a `scaled_dot_product_attention` call runs, the mask
  it is given is read (`rewrite::causal::mask_kind`, from the ops recorded so far that build
  it): one that keeps every key is left out, a causal one becomes `is_causal`. Given a mask,
  torch may choose its float32 math path where without one it would choose a fused kernel
  (Hugging Face's ViT builds a mask that keeps every key under compile; eager builds none and
  runs cuDNN); without it, torch chooses the kernel as eager would, forward and backward.
- Written-out attention (`attention` channel). After a matmul runs, the ops that computed its
  result are handed over (`rewrite::traced::attention_in_trace`); when they are attention
  (`q @ k^T`, scales, masks, softmax, `@ v`), the answer is new ops that compute the same value
  with the fused call, which run here in place of the matmul's result. Autograd then records
  the fused call's backward, and the forward saves no probabilities.

Part of the tracing layer (`direct_trace`).
"""

from __future__ import annotations

import json
import operator
import sys
import weakref

import torch

try:  # torch's dense FlexAttention, what eager runs (the scores materialized, the mods by vmap)
    from torch._higher_order_ops.flex_attention import sdpa_dense as _sdpa_dense
except ImportError:  # (a torch without FlexAttention)
    _sdpa_dense = None
try:  # its two steps: the attention, then its output copied into the query's stride order
    from torch._higher_order_ops.flex_attention import _permute_strides
    from torch._higher_order_ops.flex_attention import math_attention as _math_attention
except ImportError:
    _math_attention = _permute_strides = None

from . import attention_hook
from .extension import extension
from .runtime.triton_launch import cuda_arch
from .serialize import graph_to_dict

# F.scaled_dot_product_attention's parameters up to `is_causal`, in order (the rest are keywords)
_POSITIONAL = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
# the ops read for a mask or an attention: at most this many, this far back (masks built from
# positions and attention take tens of ops; a deeper input is read as an input)
_MOST_NODES = 2000
_FARTHEST = 64
_MATMULS = (operator.matmul, torch.matmul, torch.bmm)
_MATMUL_METHODS = ("matmul", "bmm")
_ATEN = torch.ops.aten
# a matmul's result as the recorder has it: the batched matmul or its view
_MATMUL_RESULTS = (_ATEN.bmm.default, _ATEN.view.default, _ATEN._unsafe_view.default)
_SOFTMAX_OPS = (_ATEN.exp.default, _ATEN._softmax.default)


def is_attention(target) -> bool:
    return target is torch._C._nn.scaled_dot_product_attention


def _flex_attention_op():
    return getattr(torch.ops.higher_order, "flex_attention", None)


def is_flex_attention(target) -> bool:
    """A FlexAttention call the trace records as its dense ATen ops (`flex_attention`)."""
    op = _flex_attention_op()
    return op is not None and target is op and _sdpa_dense is not None


def flex_attention(*args, **kwargs):
    """A FlexAttention call as torch's dense implementation's ATen ops: the inference graph's
    `attention` pass fuses them into one attention call where it proves what the mask and score
    modifications are (a causal `mask_mod` as `is_causal`, an ALiBi-style `score_mod` as the
    bias); other modifications run as generated kernels over the materialized scores.

    torch's dense form copies the output into a fresh tensor laid out in the query's stride
    order; where the product's result already is, the copy (a kernel as long as the output's
    write, 0.06 ms of 0.17 at 8k keys on the H200) is left out: the same values and strides."""
    if _math_attention is None:
        return _sdpa_dense(*args, **kwargs)
    out, *rest = _math_attention(*args, **kwargs)
    query = args[0] if args else kwargs["query"]
    if out.storage_offset() == 0 and out.stride() == _strides_in_order_of(out.shape, query.stride()):
        return (out, *rest)
    return (_permute_strides(out, query.stride()), *rest)


def _strides_in_order_of(shape, strides) -> tuple:
    """Dense strides for `shape` whose dims are ordered, innermost first, as `strides` order
    them (equal strides: the later dim inner, as torch orders them)."""
    order = sorted(range(len(strides)), key=lambda i: (strides[i], -i))
    out = [0] * len(shape)
    step = 1
    for i in order:
        out[i] = step
        step *= int(shape[i])
    return tuple(out)


def is_matmul(node: torch.fx.Node) -> bool:
    return (node.op == "call_function" and node.target in _MATMULS) or (
        node.op == "call_method" and node.target in _MATMUL_METHODS)


class TracedAttention:
    """The attention decisions of one trace, read from the ops recorded so far (`graph`, whose
    constants `root` holds; `node_of`: tensor -> its node, `values` the reverse). Each mask is
    read once (Hugging Face builds one mask for every layer)."""

    def __init__(self, graph: torch.fx.Graph, root: torch.nn.Module, node_of, values: weakref.WeakValueDictionary,
                 logs: tuple = (), backend: str = "auto") -> None:
        self.graph = graph
        self.backend = backend  # the compiler's `backend` option: whether its kernels are Triton's
        attention_hook.register()
        self.root = root
        self.node_of = node_of
        self.values = values  # node -> its tensor, while it lives
        self.logs = logs
        self.kinds: dict = {}  # (mask node, queries, keys) -> (kind, why)

    # ---- masks ----

    def arguments(self, node_name: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The call's arguments, without the mask where the compiler proves it open or causal."""
        bound = dict(zip(_POSITIONAL, args))
        bound.update(kwargs)
        mask = bound.get("attn_mask")
        query, key = bound.get("query"), bound.get("key")
        if not isinstance(mask, torch.Tensor) or bound.get("is_causal") or not all(
                isinstance(t, torch.Tensor) and t.dim() >= 2 for t in (query, key)):
            return args, kwargs
        mask_node = self.node_of(mask)
        if mask_node is None:
            return args, kwargs
        kind, why = self._kind(mask_node, query.shape[-2], key.shape[-2])
        if kind == "kept":
            self._say("causal_mask", f"{node_name}: mask {mask_node.name} kept: {why}")
            return args, kwargs
        rest = {k: v for k, v in bound.items() if k not in ("query", "key", "value")}
        rest.update(attn_mask=None, is_causal=kind == "causal")
        what = "is_causal" if kind == "causal" else "no mask (every key open)"
        self._say("causal_mask", f"{node_name}: {what} instead of mask {mask_node.name}, traced so")
        return (query, key, bound["value"]), rest

    def _kind(self, mask_node: torch.fx.Node, queries: int, keys: int) -> tuple[str, str]:
        key = (mask_node, queries, keys)
        if key not in self.kinds:
            if mask_node.op == "placeholder":
                self.kinds[key] = "kept", "the mask is an input"
            else:
                doc = graph_to_dict(self._graph_of(mask_node)[0], "attention_mask")
                self.kinds[key] = extension().attention_mask_kind(json.dumps(doc, allow_nan=False), int(queries),
                                                                  int(keys))
        return self.kinds[key]

    # ---- written-out attention ----

    def after(self, node: torch.fx.Node, value):
        """Dynamo node `node`'s value, computed by the fused call where it is a matmul's (or a
        FlexAttention call's) result and the ops that made it are attention."""
        if is_flex_attention(node.target):
            return self.flex_result(node.name, value)
        if is_matmul(node):
            return self.result(node.name, value)
        return value

    def result(self, node_name: str, value):
        """A matmul's result (`value`), computed by the fused call when the ops that made it are
        attention; `value` itself otherwise."""
        node = self.node_of(value) if isinstance(value, torch.Tensor) else None
        if node is None or node.target not in _MATMUL_RESULTS or not value.requires_grad:
            return value
        handed = self._graph_of(node, wanted=_SOFTMAX_OPS)
        if handed is None:
            return value
        graph, originals = handed
        arch = (cuda_arch(value.device) or 0) if value.device.type == "cuda" else 0
        doc = graph_to_dict(graph, "attention")
        replacement, decisions = extension().attention_in_trace(json.dumps(doc, allow_nan=False), arch,
                                                                           self.backend)
        for line in decisions:
            self._say("attention", f"{node_name} (training trace): {line}")
        if replacement is None:
            return value
        nodes, output = replacement
        try:
            fused = self._run(json.loads(nodes), output, originals)
        except Exception as e:  # noqa: BLE001 - the written-out ops stay, as traced
            self._say("attention", f"{node_name} (training trace): the fused ops did not run "
                                   f"({type(e).__name__}: {e}); the written-out ones stay")
            return value
        if (fused.shape, fused.dtype) != (value.shape, value.dtype):
            self._say("attention", f"{node_name} (training trace): the fused result is "
                                   f"{fused.dtype}{list(fused.shape)}, not {value.dtype}{list(value.shape)}; "
                                   "the written-out ops stay")
            return value
        if fused.stride() != value.stride():
            if not value.is_contiguous():
                self._say("attention", f"{node_name} (training trace): the written-out result is laid out "
                                       f"{tuple(value.stride())}; the written-out ops stay")
                return value
            # the matmul's result is dense, as later views of it may need (the compiler fuses
            # the copy into its reader)
            fused = _ATEN.clone.default(fused, memory_format=torch.contiguous_format)
        return fused

    def flex_result(self, node_name: str, results: tuple) -> tuple:
        """A FlexAttention call's results (`flex_attention`), its output computed by the fused call
        when its dense form is attention the compiler fuses (its log-sum-exp and maxima stay)."""
        out = results[0]
        node = self.node_of(out) if isinstance(out, torch.Tensor) else None
        if node is not None and node.target in _MATMUL_RESULTS:  # (laid out as the query already)
            fused = self.result(node_name, out)
            return results if fused is out or fused.stride() != out.stride() else (fused, *results[1:])
        # the dense form lays the matmul's result out like the query: a copy into a fresh tensor
        # (functionalized on CUDA: the copy scattered into the fresh tensor and viewed again)
        if node is not None and node.target is _ATEN.as_strided.default and isinstance(node.args[0], torch.fx.Node):
            scatter = node.args[0]
            if scatter.target is _ATEN.as_strided_scatter.default and isinstance(scatter.args[1], torch.fx.Node):
                node = scatter.args[1]
        if node is None or node.target is not _ATEN.copy.default or not isinstance(node.args[1], torch.fx.Node):
            return results
        matmul = self.values.get(node.args[1])
        if matmul is None:
            return results
        fused = self.result(node_name, matmul)
        if fused is matmul or fused.stride() != out.stride():
            return results
        return (fused, *results[1:])

    def _run(self, nodes: list, output: str, originals: dict):
        """Runs the new ops, reading the recorded nodes' values (recomputed where no longer
        held); `originals`: handed-over node name -> recorded node."""
        new: dict = {}

        def value_of(name: str):
            if name in new:
                return new[name]
            original = originals[name]
            held = self.values.get(original)
            return held if held is not None else self._recompute(original)

        def decode(a):
            if a is None:
                return None
            (kind, x), = a.items()
            if kind == "node":
                return value_of(x)
            if kind == "float":
                return float(x)
            if kind == "list":
                return [decode(i) for i in x]
            if kind in ("dtype", "layout", "memory_format"):
                return getattr(torch, x)
            if kind == "device":
                return torch.device(x)
            return x

        for n in nodes:
            target = operator.getitem if n["target"] == "getitem" else _aten_op(n["target"])
            args = [decode(a) for a in n["args"]]
            kwargs = {k: decode(a) for k, a in n["kwargs"].items()}
            bias = _bias_of(target, args, kwargs)
            if isinstance(bias, torch.Tensor) and bias.requires_grad:
                # (the fused calls' backwards give no gradient for their bias: T5's position bias)
                raise ValueError("the mask takes a gradient")
            new[n["name"]] = target(*args, **kwargs)
        return new[output]

    def _recompute(self, node: torch.fx.Node):
        """A recorded op's value again, from its inputs' (an op's scalar that nothing holds)."""
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            raise LookupError(f"no value for {getattr(node, 'name', None)}")
        if torch.Tag.nondeterministic_seeded in node.target.tags:
            raise LookupError(f"{node.name} is random")

        def load(a):
            if isinstance(a, torch.fx.Node):
                held = self.values.get(a)
                return held if held is not None else self._recompute(a)
            return a

        args, kwargs = torch.fx.node.map_aggregate((node.args, node.kwargs), load)
        return node.target(*args, **kwargs)

    # ---- the ops handed over ----

    def _graph_of(self, out: torch.fx.Node, wanted: tuple = ()) -> tuple[torch.fx.GraphModule, dict] | None:
        """The recorded ops up to `_FARTHEST` back from `out` (at most `_MOST_NODES`), as a graph
        returning it whose inputs are what they read from farther back, and the recorded node
        each of its nodes copies, by name; None when `wanted` names ops and none is among them."""
        read = {out}  # ops whose inputs are in the graph
        seen = {out}
        level = [out]
        for _ in range(_FARTHEST):
            following = []
            for n in level:
                for i in n.all_input_nodes:
                    if i not in seen and len(seen) < _MOST_NODES:
                        seen.add(i)
                        following.append(i)
            level = following
            read.update(n for n in level if len(seen) < _MOST_NODES)
        if wanted and not any(n.target in wanted for n in read):
            return None
        graph = torch.fx.Graph()
        env: dict = {}
        originals: dict = {}
        for n in self.graph.nodes:  # (graph order is an order of the ops)
            if n not in seen:
                continue
            if n in read and all(i in env for i in n.all_input_nodes):
                env[n] = graph.node_copy(n, env.__getitem__)
            else:  # read from farther back: an input
                env[n] = graph.placeholder(n.name)
                env[n].meta = dict(n.meta)
            originals[env[n].name] = n
        graph.output(env[out])
        return torch.fx.GraphModule(self.root, graph), originals

    def _say(self, channel: str, text: str) -> None:
        if channel in self.logs:
            print(f"[ferrocore:{channel}] {text}", file=sys.stderr)


_FUSED = getattr(_ATEN, "_scaled_dot_product_fused_attention_overrideable", None)
_FUSED_BACKWARD = getattr(_ATEN, "_scaled_dot_product_fused_attention_overrideable_backward", None)
_SEED_ARGS = (14, 15)  # the fused call's backward's philox seed and offset


def without_random_state(graph: torch.fx.Graph) -> None:
    """ferrocore's attention kernel (the fused call's backend hook) has no dropout: its backward
    reads no random state. The seed and offset the hook's forward returns are meta tensors in
    the trace, which no compiled graph can return; the backward is given the log-sum-exp (a
    tensor it holds anyway) in their place, and they are left unread."""
    if _FUSED_BACKWARD is None:
        return
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not _FUSED_BACKWARD.default:
            continue
        args = list(node.args)
        lse = args[7]
        for i in _SEED_ARGS:
            seed = args[i]
            if (isinstance(seed, torch.fx.Node) and seed.target is operator.getitem
                    and getattr(seed.args[0], "target", None) is _FUSED.default):
                args[i] = lse
        node.args = tuple(args)


def _bias_of(target, args: list, kwargs: dict):
    """The additive mask a fused attention call reads, if `target` is one."""
    if target in (_ATEN._scaled_dot_product_cudnn_attention.default,
                  _ATEN._scaled_dot_product_efficient_attention.default):
        return args[3] if len(args) > 3 else kwargs.get("attn_bias")
    if target is _ATEN._scaled_dot_product_flash_attention_for_cpu.default:
        return kwargs.get("attn_mask")
    return None


def _aten_op(name: str):
    """`aten.add.Tensor` -> torch.ops.aten.add.Tensor."""
    namespace, op, overload = name.split(".")
    if namespace != "aten":
        raise ValueError(f"not an ATen op: {name}")
    return getattr(getattr(torch.ops.aten, op), overload)
