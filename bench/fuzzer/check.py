"""Runs programs eagerly and compiled (one graph for a batch of programs) and classifies each.

Runs inside a worker process (see worker.py): the backend's settings (`TRITON_INTERPRET`,
`FERROCORE_BACKEND`) are in its environment before torch is imported.

Classes: `pass`; `invalid` (eager raised: a generator bug, counted); `mismatch:*` (compare.py);
`deviation:*` (documented, compare.py); `torch:*` (torch fails alike without ferrocore); `compile_error`
(ferrocore raised compiling); `runtime_error` (the compiled graph raised where eager did not);
`dynamo` (dynamo could not capture the function: not ferrocore's); `graph_fallback` (ferrocore
ran the whole graph eagerly). Worker crashes and timeouts are classified by the runner.
"""

from __future__ import annotations

import re
import sys
import traceback

import torch

from . import compare
from .program import DTYPES, FLOATS, Program, compile_functions
from .runner import is_failure


def _widened(program: Program) -> Program:
    """The program with every float input and float cast widened to float64 (the reference)."""
    p = Program.from_dict(program.to_dict())
    for inp in p.inputs:
        if inp.dtype in FLOATS:
            inp.rounded, inp.dtype = inp.dtype, "float64"
    for op in p.ops:
        op.code = re.sub(r"torch\.(float16|bfloat16|float32|half|float)\b", "torch.float64", op.code)
        op.code = op.code.replace(".half()", ".double()").replace(".float()", ".double()")
    return p


class Prepared:
    """One program's functions and eager results."""

    def __init__(self, program: Program, device: str):
        self.program = program
        self.device = device
        self.make_inputs, self.fn = compile_functions(program, "f")
        self.error = None
        try:
            inputs = self.make_inputs(device)
            self.expected = self.fn(*inputs)
            self.inputs_after = inputs
        except Exception as e:  # noqa: BLE001 - eager rejected the program
            self.error = f"eager raised {type(e).__name__}: {e}"
        self._ref = None
        self._mag = None

    def meta_outputs(self):
        """(shape, stride, dtype) of each output as PyTorch's own meta functions give them (what
        the traced graph says), or None when the program does not run on fake tensors. A shape
        environment lets data-dependent ops (boolean masks) run; a stride that stays symbolic
        is None."""
        try:
            from torch._subclasses import FakeTensorMode
            from torch.fx.experimental.symbolic_shapes import ShapeEnv

            with FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=False) as mode:
                inputs = [mode.from_tensor(t) for t in self.make_inputs(self.device)]
                return [(tuple(o.stride()), o.dtype) for o in self.fn(*inputs)]
        except Exception:  # noqa: BLE001
            return None

    def reference(self):
        """(outputs, inputs after) of the float64 run, or None when it does not run."""
        if self._ref is None:
            try:
                mk, fn = compile_functions(_widened(self.program), "f")
                inputs = mk(self.device)
                self._ref = (fn(*inputs), inputs)
            except Exception:  # noqa: BLE001
                self._ref = False
        return self._ref or None


    @property
    def precision(self):
        """The least precise float type the program computes in (its float inputs and casts),
        or None: a float64 result of float32 work carries float32 rounding."""
        names = [i.dtype for i in self.program.inputs if i.dtype in FLOATS]
        for op in self.program.ops:
            names += re.findall(r"torch\.(float16|bfloat16|float32)\b", op.code)
            names += ["float16"] * op.code.count(".half()") + ["float32"] * op.code.count(".float()")
        for name in ("bfloat16", "float16", "float32", "float64"):
            if name in names:
                return DTYPES[name]
        return None

    @property
    def terms(self) -> int:
        """The most terms any reduction of the program can add: its largest input's size."""
        return max((int(torch.Size(i.shape).numel()) for i in self.program.inputs), default=1)

    def magnitude(self):
        """(outputs, inputs after) of the float64 run on the inputs' absolute values: the scale
        of the terms each result adds up, or None when it does not run. Integer inputs keep
        their dtype (the minimum becomes the maximum; see _to_magnitude)."""
        if self._mag is None:
            try:
                mk, fn = compile_functions(_widened(self.program), "f")
                inputs = mk(self.device)
                for t in inputs:
                    _to_magnitude(t)
                outs = fn(*inputs)
                self._mag = ([_abs64(o) for o in outs], [_abs64(t) for t in inputs])
            except Exception:  # noqa: BLE001
                self._mag = False
        return self._mag or None


def _to_magnitude(t: torch.Tensor) -> None:
    """|t| in place. Integer inputs that could be indices (all values within the largest size
    the generator draws, where a negative index would turn into another) are left as they are."""
    if t.dtype == torch.bool:
        return
    if t.is_floating_point():
        t.abs_()
    elif t.numel() and int(t.abs().max()) > 128:
        info = torch.iinfo(t.dtype)
        t.copy_(torch.where(t == info.min, torch.full_like(t, info.max), t.abs()))


def _abs64(t):
    return t.double().abs() if isinstance(t, torch.Tensor) and t.is_floating_point() else None


class _Strided:
    def __init__(self, shape, stride):
        self.shape, self._stride = shape, stride

    def stride(self):
        return self._stride


def _mutated(program: Program) -> list:
    """Positions of the inputs some statement writes in place."""
    names = {op.args[op.mutates] for op in program.ops if op.mutates}
    return [k for k, i in enumerate(program.inputs) if i.name in names]


def classify(prep: Prepared, actual, inputs_after) -> tuple:
    """(class, detail) of one program's compiled results against eager's."""
    expected = prep.expected
    if not isinstance(actual, tuple) or len(actual) != len(expected):
        return "mismatch:structure", f"{type(actual).__name__} of {len(actual)}, eager {len(expected)}"
    pairs = [(f"output {k}", e, a, True) for k, (e, a) in enumerate(zip(expected, actual))]
    pairs += [(f"input {k} after the call", prep.inputs_after[k], inputs_after[k], False)
              for k in _mutated(prep.program)]
    found = []
    for where, e, a, strides in pairs:
        aliased = compare.aliases_any(e, prep.inputs_after)
        diff = compare.compare_tensor(e, a, aliased=aliased, check_strides=strides)
        if diff is None:
            continue
        cls, detail = diff
        if not strides and cls == "mismatch:value":
            cls = "mismatch:mutation"
        found.append((_explain(prep, where, e, a, cls), f"{where}: {detail}"))
    # a real mismatch wins over a documented deviation elsewhere in the program
    found.sort(key=lambda f: f[0].startswith("deviation:"))
    return found[0] if found else ("pass", "")


def _explain(prep: Prepared, where: str, e, a, cls: str) -> str:
    if cls in ("mismatch:stride", "mismatch:dtype") and where.startswith("output"):
        # the compiled graph keeps the strides (dtype) of PyTorch's meta function where eager's
        # real kernel gives others (copysign of a transposed input; bool ** True)
        meta = prep.meta_outputs()
        stride, dtype = meta[int(where.split()[1])] if meta is not None else ((None,), None)
        if cls == "mismatch:dtype":
            return "deviation:meta_dtype" if a.dtype == dtype else cls
        traced = None not in stride and compare.same_strides(a, _Strided(a.shape, stride))
        return "deviation:meta_strides" if traced else cls
    if cls not in ("mismatch:value", "mismatch:nan", "mismatch:mutation"):
        return cls
    ref = prep.reference()
    if ref is None:
        return cls
    outs, ins = ref
    k = int(where.split()[1])
    r = outs[k] if where.startswith("output") else ins[k]
    mag = prep.magnitude()
    m = None if mag is None else (mag[0][k] if where.startswith("output") else mag[1][k])
    return compare.explained_by_rounding(e, a, r, m, prep.terms, prep.precision) or cls


def _batch_function(preps: list):
    """One function calling every program: `batch(*all inputs) -> tuple of result tuples`."""
    ns, params, calls = {}, [], []
    for k, prep in enumerate(preps):
        ns[f"p{k}"] = prep.fn
        names = [f"a{k}_{j}" for j in range(len(prep.program.inputs))]
        params += names
        calls.append(f"p{k}({', '.join(names)})")
    src = f"def batch({', '.join(params)}):\n    return ({', '.join(calls)},)\n"
    exec(compile(src, "<fuzz batch>", "exec"), ns)
    return ns["batch"]


def _error_class(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    if "BackendCompilerFailed" in type(exc).__name__ or "error in compile_graph" in text:
        return "compile_error"
    if type(exc).__module__.startswith("torch._dynamo") or "Unsupported" in type(exc).__name__:
        return "dynamo"
    return "runtime_error"


def run_programs(programs: list, backend: str, device: str, compiler=None) -> list:
    """Each program's {"class", "detail"}; all of them in one compiled graph. `compiler`: a
    dynamo backend to use instead of ferrocore (the tests plant bugs with one)."""
    from ferrocore import metrics  # the Metrics instance

    preps = [Prepared(p, device) for p in programs]
    results = [None] * len(preps)
    live = []
    for k, prep in enumerate(preps):
        if prep.error:
            results[k] = {"class": "invalid", "detail": prep.error}
        else:
            live.append(k)
    if not live:
        return results
    torch._dynamo.reset()
    metrics.reset()
    options = {} if backend == "auto" or compiler else {"backend": backend}
    compiled = torch.compile(_batch_function([preps[k] for k in live]), backend=compiler or "ferrocore",
                             fullgraph=True, dynamic=False, options=options or None)
    with _FallbackLog() as log:
        outcome = _call_twice(compiled, [preps[k] for k in live], device)
    total = metrics.total
    # one program's failure, or a whole batch's exception: torch's own if its pipeline fails alike
    whole = len(live) == 1 or outcome[0][2] is not None
    if whole and not compiler and is_failure(outcome[0][0]) \
            and _torch_fails_alike([preps[k] for k in live], device, outcome[0]):
        cls, detail, kind = outcome[0]
        outcome = [(f"torch:{cls}", detail, kind)] * len(live)
    for j, k in enumerate(live):
        cls, detail, _kind = outcome[j]
        if cls == "pass" and total.get("graph_fallbacks"):
            cls, detail = "graph_fallback", "; ".join(log.reasons) or "ferrocore ran the graph eagerly"
        results[k] = {"class": cls, "detail": detail}
    # the graph's node fallbacks and stage timings, once per batch
    results[live[0]]["fallback_ops"] = sorted(total.get("fallback_ops", {}))
    results[live[0]]["timings_ms"] = dict(total.get("timings_ms", {}))
    return results


def _call_twice(compiled, preps: list, device: str) -> list:
    """Per program (class, detail, error kind), over two calls with fresh inputs (the second
    reuses the compiled graph); the kind names the exception (inside dynamo's wrapper) of a call
    that raised, else it is None."""
    outcome = [("pass", "", None)] * len(preps)
    for call in ("first", "second"):
        inputs = [p.make_inputs(device) for p in preps]
        try:
            actual = compiled(*[t for ins in inputs for t in ins])
        except Exception as e:  # noqa: BLE001
            cls = _error_class(e)
            detail = f"{call} call: {type(e).__name__}: {str(e)[:2000]}\n{_tail(e)}"
            kind = f"{call}:{type(getattr(e, 'inner_exception', None) or e).__name__}"
            return [(cls, detail, kind)] * len(preps)
        for j, prep in enumerate(preps):
            if outcome[j][0] != "pass":
                continue
            cls, detail = classify(prep, actual[j], inputs[j])
            if cls != "pass":
                outcome[j] = (cls, f"{call} call, {detail}", None)
    return outcome


def _torch_reference():
    """ferrocore's torch half alone: AOT autograd with ferrocore's options and decomposition
    table, its graphs run as traced. An error this backend raises too is torch's, not ferrocore's."""
    from ferrocore.decompositions import decompositions
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    def run(gm, _inputs):
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=run, bw_compiler=run, inference_compiler=run,
                        keep_inference_input_mutations=True, decompositions=decompositions())


def _torch_fails_alike(preps: list, device: str, outcome: tuple) -> bool:
    """Whether the torch reference backend fails the programs (one graph) the same way: the same
    exception in the same call, or the same wrong result (the same values at the same place)."""
    torch._dynamo.reset()
    compiled = torch.compile(_batch_function(preps), backend=_torch_reference(), fullgraph=True, dynamic=False)
    cls, detail, kind = _call_twice(compiled, preps, device)[0]
    if kind is not None or outcome[2] is not None:
        return cls == outcome[0] and kind == outcome[2]
    return cls == outcome[0] and detail == outcome[1]


class _FallbackLog:
    """Collects the reasons ferrocore prints for graphs it runs eagerly (stderr lines
    `[ferrocore:fallback] graph NAME runs eagerly: REASON`)."""

    def __enter__(self):
        self.reasons, self.inner = [], sys.stderr
        sys.stderr = self
        return self

    def write(self, text: str) -> int:
        for line in text.splitlines():
            if line.startswith("[ferrocore:fallback]") and "runs eagerly: " in line:
                self.reasons.append(line.split("runs eagerly: ", 1)[1].strip())
        return self.inner.write(text)

    def flush(self) -> None:
        self.inner.flush()

    def __exit__(self, *exc):
        sys.stderr = self.inner


def _tail(e: BaseException) -> str:
    return "".join(traceback.format_exception(e)[-3:])[-1500:]
