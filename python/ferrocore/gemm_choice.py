"""Which GEMMs of a graph run as ferrocore's matrix-product template with their epilogue fused
(`gemm_template="measured"`, max-autotune's setting), measured on the device, cached on disk, and
named in the graph for the Rust lowering (`template_matmuls` in the graph document). On the GPU
dense 2-D convolutions are candidates too, as implicit-GEMM templates (`lowering/conv_template.rs`),
timed against cuDNN's NHWC call in a channels-last region as the graph would run them. On the GPU
the default mode (`gemm_template="cached"`) reads the decisions an earlier measurement cached and
times nothing: a GEMM never measured stays a library call. On the CPU (float32 GEMMs, C++
kernels) the default mode is the lowering's size rule, and `measured` times every GEMM.

The choice is between the library call followed by a kernel of its pointwise readers, and one
template kernel computing both. Each GEMM is cut out of the graph with its likely epilogue (the
pointwise nodes and views over its result; what they read besides is an input of the cut-out
graph) and, on the GPU, its likely prologue (the pointwise nodes computing an operand for it
alone), compiled both ways (the template's tiles autotuned) and timed on random data of the same shapes, strides
and dtypes (median of CUDA-event timings of each whole call). The template is kept where it is
faster by a margin. Decisions are cached per region (its ops, arguments, shapes, strides, dtypes),
device and versions under `cache_dir/gemm_template`.
"""

from __future__ import annotations

import contextlib
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from .extension import extension
from .runtime.measurement import cached_measurement, median_cuda_ms
from .runtime.versions import versions

# the template must beat the library call and its epilogue kernel by this much (timings move by
# a few percent from run to run)
MIN_GAIN = 0.97
# the cache entries' family (cache_dir/gemm_template/..)
FAMILY = "gemm_template"
# nodes of an epilogue cut out with its GEMM, at most
MAX_EPILOGUE = 12
_GEMMS = {
    torch.ops.aten.mm.default: (0, 1),
    torch.ops.aten.bmm.default: (0, 1),
    torch.ops.aten.addmm.default: (1, 2),
}
_VIEWS = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default}
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
# what an operand's prologue may pass through besides pointwise nodes
_TRANSPOSES = {torch.ops.aten.t.default, torch.ops.aten.transpose.int, torch.ops.aten.permute.default}
_CASTS = {torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default}
# nodes of an operand's prologue cut out with its GEMM, at most
MAX_PROLOGUE = 4


def template_matmuls(gm: torch.fx.GraphModule, opts: dict, compile_region: Callable) -> dict:
    """{GEMM node name: what was measured} for the GEMMs faster as templates with their epilogue;
    `compile_region(gm, opts)` compiles a cut-out region (the static compile, without measuring;
    without one, only what is cached is read)."""
    mode = opts.get("gemm_template")
    if mode not in ("measured", "cached"):
        return {}
    gemms = [n for n in gm.graph.nodes if _is_gemm(n) or _is_conv(n)]
    cpu = any(n.meta["val"].device.type == "cpu" for n in gemms)
    if cpu and mode == "cached":
        return {}  # the C++ backend's size rule decides (lowering/matmul.rs); measured: timed here
    if not cpu and not torch.cuda.is_available():
        return {}
    if mode == "cached" and not (opts.get("cache_dir") and (Path(opts["cache_dir"]) / FAMILY).is_dir()):
        return {}  # nothing measured yet (and no region is cut out to find that)
    measuring = mode == "measured" and compile_region is not None
    chosen = {}
    for n in gemms:
        region = _Region.of(n)
        key = [*region.key, _device_name(n.meta["val"].device)]
        ms = cached_measurement(opts.get("cache_dir"), FAMILY, key,
                                (lambda r=region: r.measure(opts, compile_region)) if measuring else None,
                                errors=(RuntimeError, torch.OutOfMemoryError, extension().FerrocoreError))
        if ms is None:
            continue
        library, template = ms
        why = f"{'measured' if measuring else 'cached:'} {template:.4f} ms as a template with {len(region.nodes) - 1} epilogue nodes, {library:.4f} ms as a library call"
        if template < MIN_GAIN * library:
            chosen[n.name] = why
        elif "gemm_template" in opts.get("logs", ()):
            print(f"[ferrocore:gemm_template] {n.name} stays a library call: {why}", file=sys.stderr)
    return chosen


def _is_gemm(n: torch.fx.Node) -> bool:
    if n.op != "call_function" or n.target not in _GEMMS:
        return False
    if n.target is torch.ops.aten.addmm.default and (n.kwargs.get("beta", 1) != 1 or n.kwargs.get("alpha", 1) != 1):
        return False
    vals = [n.args[i].meta.get("val") if isinstance(n.args[i], torch.fx.Node) else None for i in _GEMMS[n.target]]
    out = n.meta.get("val")
    if not isinstance(out, torch.Tensor) or out.numel() == 0:
        return False
    # the C++ matrix-product kernels compute float32 only
    floats = _FLOATS if out.device.type == "cuda" else (torch.float32,) if out.device.type == "cpu" else ()
    return out.dtype in floats and all(isinstance(v, torch.Tensor) and v.dtype == out.dtype for v in vals)


def _is_conv(n: torch.fx.Node) -> bool:
    """A forward 2-D GPU convolution the template computes: dense (one group) or depthwise (a
    group and one filter per channel), not transposed, input, weight and result of one float
    type."""
    if n.op != "call_function" or n.target is not torch.ops.aten.convolution.default or len(n.args) < 9:
        return False
    x, w, transposed, groups = n.args[0], n.args[1], n.args[6], n.args[8]
    out = n.meta.get("val")
    if not isinstance(out, torch.Tensor) or out.device.type != "cuda" or out.dim() != 4 or out.numel() == 0:
        return False
    if transposed or out.dtype not in _FLOATS:
        return False
    vals = [a.meta.get("val") if isinstance(a, torch.fx.Node) else None for a in (x, w)]
    if not all(isinstance(v, torch.Tensor) and v.dim() == 4 and v.dtype == out.dtype for v in vals):
        return False
    return groups == 1 or groups == vals[0].shape[1] == out.shape[1]


def _device_name(device: torch.device) -> str:
    """What a timing depends on besides the region: the GPU's model, or the CPU's and the
    threads kernels run on."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu {platform.processor() or platform.machine()} {torch.get_num_threads()} threads"


def _pointwise(n: torch.fx.Node) -> bool:
    tags = getattr(n.target, "tags", ())
    return torch.Tag.pointwise in tags or n.target in _VIEWS


def _prologue(operand) -> set:
    """The nodes that compute a GEMM operand from what it reads, where only the GEMM reads them
    (the compiler may compute them in the product's kernel: a cast, a scaling, a transpose): at
    most MAX_PROLOGUE, and none where they are only views."""
    found, frontier = set(), [operand]
    while frontier and len(found) < MAX_PROLOGUE:
        n = frontier.pop(0)
        if not isinstance(n, torch.fx.Node) or n.op != "call_function" or len(n.users) != 1:
            continue
        if not (_pointwise(n) or n.target in _TRANSPOSES or n.target in _CASTS) or not isinstance(n.meta.get("val"), torch.Tensor):
            continue
        # (floating inputs only: the measurement fills the region's inputs with random floats)
        ins = [a.meta.get("val") for a in n.all_input_nodes]
        if any(not isinstance(v, torch.Tensor) or v.device != n.meta["val"].device or not v.is_floating_point() for v in ins):
            continue
        found.add(n)
        frontier.extend(n.all_input_nodes)
    computes = any(n.target not in _VIEWS and n.target not in _TRANSPOSES for n in found)
    return found if computes else set()


class _Region:
    """A GEMM, the pointwise nodes and views over its result (its likely epilogue) and those that
    compute its operands for it alone (its likely prologue), as a graph of their own whose inputs
    are what they read from memory."""

    def __init__(self, nodes: list, gm: torch.fx.GraphModule, inputs: list, conv: bool = False):
        self.nodes, self.gm, self.inputs, self.conv = nodes, gm, inputs, conv
        self.key = self._key()

    @staticmethod
    def of(gemm: torch.fx.Node) -> "_Region":
        numel = gemm.meta["val"].numel()
        inside = {gemm}
        order = {n: i for i, n in enumerate(gemm.graph.nodes)}
        frontier = [gemm]
        while frontier and len(inside) <= MAX_EPILOGUE:
            for u in list(frontier.pop(0).users):
                val = u.meta.get("val")
                if u in inside or u.op != "call_function" or not _pointwise(u):
                    continue
                if not isinstance(val, torch.Tensor) or val.numel() != numel:
                    continue
                # what it reads besides the region are tensors in memory (random data here)
                outside = [a for a in u.all_input_nodes if a not in inside]
                if any(not isinstance(a.meta.get("val"), torch.Tensor) for a in outside):
                    continue
                inside.add(u)
                frontier.append(u)
        if gemm.target in _GEMMS and gemm.meta["val"].device.type != "cpu":  # (Triton's prologues)
            for i in _GEMMS[gemm.target]:
                inside |= _prologue(gemm.args[i])
        nodes = sorted(inside, key=order.__getitem__)
        conv = _is_conv(gemm)
        graph = torch.fx.Graph()
        env: dict = {}
        inputs = []
        for n in nodes:
            for a in n.all_input_nodes:
                if a not in inside and a not in env:
                    p = graph.placeholder(f"in{len(inputs)}")
                    val = a.meta["val"]
                    # a convolution graph's activations are channels-last buffers (its weights
                    # stay as the parameters lie)
                    if conv and val.dim() == 4 and a is not gemm.args[1]:
                        val = _channels_last_like(val)
                    p.meta["val"] = val
                    env[a] = p
                    inputs.append(val)
            env[n] = graph.node_copy(n, lambda a: env[a])
        outs = [env[n] for n in nodes if n is nodes[-1] or any(u not in inside for u in n.users)]
        graph.output(tuple(outs))
        return _Region(nodes, torch.fx.GraphModule(torch.nn.Module(), graph), inputs, conv)

    def _key(self) -> list:
        # nodes by position: a model's repeated layers are one entry
        position = {n: i for i, n in enumerate(self.gm.graph.nodes)}

        def describe(a):
            if isinstance(a, torch.fx.Node):
                return f"%{position[a]}"
            if isinstance(a, (list, tuple)):
                return [describe(x) for x in a]
            return repr(a)

        ops = [[str(n.target), describe(list(n.args)), describe(dict(n.kwargs))] for n in self.gm.graph.nodes
               if n.op == "call_function"]
        tensors = [[list(t.shape), list(t.stride()), str(t.dtype), str(t.device.type)] for t in self.inputs]
        return [ops, tensors, list(versions()[:3])]

    def measure(self, opts: dict, compile_region: Callable) -> tuple:
        """(ms as a library call and a kernel, ms as a template): GPU time per call, or on the
        CPU the time of the whole call."""
        device = self.inputs[0].device
        if device.type == "cpu":
            args = [_random_like(t) for t in self.inputs]
            base = {**opts, "logs": [], "debug_dir": None}
            library = compile_region(self.gm, {**base, "gemm_template": "never"})
            template = compile_region(self.gm, {**base, "gemm_template": "always"})
            return _cpu_ms(lambda: library(list(args))), _cpu_ms(lambda: template(list(args)))
        with torch.cuda.device(device):
            args = [_random_like(t) for t in self.inputs]
            base = {**opts, "cudagraphs": False, "logs": [], "debug_dir": None}
            if self.conv:
                base["conv_layout"] = "channels_last"
            library = compile_region(self.gm, {**base, "gemm_template": "never"})
            template = compile_region(self.gm, {**base, "gemm_template": "always", "autotune": True})
            return _gpu_ms(lambda: library(list(args))), _gpu_ms(lambda: template(list(args)))


def _channels_last_like(t: torch.Tensor) -> torch.Tensor:
    """`t`'s metadata with channels-last strides (a fake tensor of the same fake mode)."""
    with getattr(t, "fake_mode", None) or contextlib.nullcontext():
        return torch.empty(t.shape, dtype=t.dtype, device=t.device, memory_format=torch.channels_last)


def _random_like(t: torch.Tensor) -> torch.Tensor:
    span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return torch.randn(span, dtype=t.dtype, device=t.device).as_strided(t.shape, t.stride())


def _cpu_ms(fn, reps: int = 7) -> float:
    """Median over `reps` rounds of the time per call of `fn` on the CPU, each round about a
    millisecond of calls (a small GEMM takes microseconds: one call is below the clock's noise)."""
    fn()
    t = time.perf_counter()
    fn()
    calls = max(1, min(1000, int(1e-3 / max(time.perf_counter() - t, 1e-7))))
    samples = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t) * 1e3 / calls)
    return statistics.median(samples)


def _gpu_ms(fn, calls: int = 5) -> float:
    """GPU time per call of `fn`: calls recorded as a CUDA graph and replayed, so that what is
    timed is the kernels, not the host's launches (a small GEMM's library call and its epilogue
    kernel launch twice where the template launches once: back to back on the host, the two
    measured the host's time, and 2x apart from one run to the next); CUDA events around the
    plain calls where a recording fails."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    except RuntimeError:
        return median_cuda_ms(fn, calls=calls)
    return median_cuda_ms(graph.replay) / calls
