"""The compiled graph as the Rust side returns it (`artifact::CompiledGraph`, docs/compiled_graph.md):
a JSON value holding the kernel unit, each kernel's definition span and launch, the host plan
and what running it involves. The runtime reads these facts here, from that value, never from
the wrapper module's text or its module-level names."""

from __future__ import annotations

import json


def parse(text: str) -> dict:
    """The compiled graph from its JSON text (kept as text by a compiled graph that lives on: a
    parsed copy would be thousands of objects for the garbage collector to walk at every full
    collection)."""
    return json.loads(text)


def unit_source(graph: dict) -> str | None:
    """The kernels' source unit (C++ or the Triton functions with their prelude), or None."""
    unit = graph.get("unit")
    return unit["source"] if unit else None


def prelude(graph: dict) -> str:
    """The part of the unit every kernel shares, before the first definition ("" without one)."""
    unit = graph.get("unit")
    if not unit:
        return ""
    span = unit["prelude"]
    return unit["source"][span["start"]:span["end"]]


def kernel_text(graph: dict, kernel: dict) -> str:
    span = kernel["definition"]
    return graph["unit"]["source"][span["start"]:span["end"]]


def runs_host_kernels(graph: dict) -> bool:
    """Whether its kernels are C++ functions run on the host."""
    return graph["language"] == "cpp" and bool(graph["kernels"])


def has_triton_kernels(graph: dict) -> bool:
    return graph["language"] == "triton" and any(k["launch"]["kind"] == "grid" for k in graph["kernels"])


def checks_indices_by_flag(graph: dict) -> bool:
    """Whether `call(args, index_flag)` takes the flag its kernels raise on an out-of-range
    gather index (reading it is then left to the caller)."""
    return graph.get("index_check") is not None


def holds_donated_inputs(graph: dict) -> bool:
    """Whether `call(args, held)` writes results over donated inputs whose storage a CUDA graph's
    recording must hold (`runtime.wrapper.owned_storage`)."""
    return any(not w["escapes"] for w in graph["donated_writes"])


def cuda_graph_hazard(graph: dict) -> str | None:
    """Why the call must not be recorded in a CUDA graph (its library calls'), or None."""
    return "; ".join(graph["cuda_graph_hazards"]) or None


def block_constexprs(config: dict) -> dict:
    """A grid configuration's block constexprs: a matrix-product kernel's tile, else XBLOCK."""
    if config.get("tile"):
        return dict(zip(("BLOCK_M", "BLOCK_N", "BLOCK_K"), config["tile"]))
    return {"XBLOCK": config["xblock"]}


def triton_kernels(graph: dict, module) -> tuple[list, dict]:
    """Each Triton kernel defined in `module` (the graph's wrapper module), once per name, as
    `(function, signature, constexprs, launch)` for `runtime.precompile.precompile_triton` (launch: grid,
    num_warps, num_stages, the autotuner's candidates, arg_numel and the definition's text), and
    the launchers (`TritonLaunch`) by kernel name."""
    namespace = vars(module)
    entries, launchers = [], {}
    for k in graph["kernels"]:
        name, launch = k["name"], k["launch"]
        if launch["kind"] != "grid" or name in launchers:
            continue
        config = launch["config"]
        entries.append((
            namespace[name],
            dict(k["signature"]),
            block_constexprs(config),
            {"grid": config["grid"], "num_warps": config["num_warps"], "num_stages": config["num_stages"],
             "candidates": [(c["grid"], tuple(block_constexprs(c).items()), c["num_warps"], c["num_stages"])
                            for c in launch["candidates"]],
             "arg_numel": list(k["arg_numel"]), "text": kernel_text(graph, k)},
        ))
        launchers[name] = namespace["launch_" + name]
    return entries, launchers
