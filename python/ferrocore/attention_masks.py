"""Attention masks a training trace leaves out: the compiler reads the mask a
`scaled_dot_product_attention` call is given (`rewrite::causal::mask_kind`); one it proves keeps
every key is dropped, one it proves causal becomes `is_causal`, before the call is traced.

Why at trace time: given a mask, torch may choose its float32 math path where without one it
would choose a fused kernel (Hugging Face's ViT: the mask its compiled forward builds keeps every
key, and eager, which builds none, runs cuDNN). A training graph's backward is traced from the
ops the forward ran, so a mask left out after the trace (the `causal_mask` graph pass, which
serves inference graphs) would stay in the backward and keep the math path's saved
probabilities. Without the mask, torch chooses the kernel as eager would, forward and backward.

Part of the tracing layer (`direct_trace`); the decision is the compiler's, logged on the
`causal_mask` channel.
"""

from __future__ import annotations

import json
import sys

import torch

from .extension import extension
from .serialize import graph_to_dict

# F.scaled_dot_product_attention's parameters up to `is_causal`, in order (the rest are keywords)
_POSITIONAL = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
# a mask built from more nodes than this is not read (masks from positions take tens)
_MOST_NODES = 2000


def is_attention(target) -> bool:
    return target is torch._C._nn.scaled_dot_product_attention


class MaskReader:
    """Reads the masks of one trace's attention calls from the ops recorded so far; each mask
    node is read once (Hugging Face builds one mask for every layer)."""

    def __init__(self, graph: torch.fx.Graph, root: torch.nn.Module, node_of, log: bool) -> None:
        self.graph = graph
        self.root = root
        self.node_of = node_of  # tensor -> its recorded node, or None
        self.log = log
        self.kinds: dict = {}  # (mask node, queries, keys) -> (kind, why)

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
            self._say(f"{node_name}: mask {mask_node.name} kept: {why}")
            return args, kwargs
        rest = {k: v for k, v in bound.items() if k not in ("query", "key", "value")}
        rest.update(attn_mask=None, is_causal=kind == "causal")
        what = "is_causal" if kind == "causal" else "no mask (every key open)"
        self._say(f"{node_name}: {what} instead of mask {mask_node.name}, traced so")
        return (query, key, bound["value"]), rest

    def _kind(self, mask_node: torch.fx.Node, queries: int, keys: int) -> tuple[str, str]:
        key = (mask_node, queries, keys)
        if key not in self.kinds:
            self.kinds[key] = self._read(mask_node, queries, keys)
        return self.kinds[key]

    def _read(self, mask_node: torch.fx.Node, queries: int, keys: int) -> tuple[str, str]:
        if mask_node.op == "placeholder":
            return "kept", "the mask is an input"
        graph = self._mask_graph(mask_node)
        if graph is None:
            return "kept", f"the mask is built from more than {_MOST_NODES} ops"
        doc = graph_to_dict(torch.fx.GraphModule(self.root, graph), "attention_mask")
        return extension().attention_mask_kind(json.dumps(doc, allow_nan=False), int(queries), int(keys))

    def _mask_graph(self, mask_node: torch.fx.Node) -> torch.fx.Graph | None:
        """The recorded ops the mask is built from, as a graph returning it."""
        seen = {mask_node}
        todo = [mask_node]
        while todo:
            for n in todo.pop().all_input_nodes:
                if n not in seen:
                    seen.add(n)
                    todo.append(n)
            if len(seen) > _MOST_NODES:
                return None
        graph = torch.fx.Graph()
        env: dict = {}
        for n in self.graph.nodes:  # (graph order is an order of the ancestors)
            if n in seen:
                env[n] = graph.node_copy(n, env.__getitem__)
        graph.output(env[mask_node])
        return graph

    def _say(self, text: str) -> None:
        if self.log:
            print(f"[ferrocore:causal_mask] {text}", file=sys.stderr)
