"""A fuzz program as data: inputs (how each is built), ops (statements over named values), the
returned names. It renders to a standalone Python repro; the minimizer edits the data.

An input is built from its own seed (`torch.Generator().manual_seed(seed)`), so dropping or
changing one input never changes another's values. An op is a statement template whose operand
slots (`{a}`, `{b}`, ...) name earlier values and whose `{t}` is the value it defines (none for an
in-place statement on an existing value).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

import torch

DTYPES = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
FLOATS = ("float16", "bfloat16", "float32", "float64")
INTS = ("uint8", "int8", "int16", "int32", "int64")


@dataclass
class Input:
    """A tensor argument. `layout` is how its strides are made: "contiguous", "transposed"
    (built with the dims reversed, then permuted back), "sliced" (every other element of a larger
    tensor along `dim`, from offset 1), "expanded" (size-1 along `dim`, then expanded).
    `values`: "normal", "special" (floats: NaN, +-inf, -0.0 and large values mixed in; ints: the
    dtype's extremes mixed in), "index" (integers in [low, high)), "perm" (`high` distinct indices
    per slice along `dim`, taken from a permutation of `low` = the indexed size), "mask" (bool).
    `base`: another input (contiguous) this one is a view of, `low` elements into its storage,
    laid out contiguously: the two overlap in memory, as views of one tensor passed to a function
    do (`layout` "alias"). `rounded`: a float type the values pass through first (the float64
    reference run takes the values eager's inputs hold)."""

    name: str
    shape: list
    dtype: str
    seed: int
    layout: str = "contiguous"
    dim: int = 0
    values: str = "normal"
    low: int = 0
    high: int = 0
    base: str = ""
    rounded: str = ""

    def build_lines(self) -> list:
        if self.base:
            stride = [1] * len(self.shape)
            for d in range(len(self.shape) - 2, -1, -1):
                stride[d] = stride[d + 1] * max(self.shape[d + 1], 1)
            return [f"{self.name} = {self.base}.as_strided({list(self.shape)}, {stride}, "
                    f"{self.base}.storage_offset() + {self.low})"]
        g = f"torch.Generator().manual_seed({self.seed})"
        shape = list(self.shape)
        base = _base_shape(shape, self.layout, self.dim)
        make = _values_expr(self, base, g)
        view = _layout_suffix(shape, self.layout, self.dim)
        return [f"{self.name} = {make}{view}"]


def _base_shape(shape: list, layout: str, dim: int) -> list:
    if layout == "transposed":
        return list(reversed(shape))
    if layout == "sliced" and shape:
        s = list(shape)
        s[dim] = 2 * s[dim] + 1
        return s
    if layout == "expanded" and shape:
        s = list(shape)
        s[dim] = 1
        return s
    return list(shape)


def _layout_suffix(shape: list, layout: str, dim: int) -> str:
    n = len(shape)
    if layout == "transposed" and n >= 2:
        return f".permute({', '.join(str(d) for d in reversed(range(n)))})"
    if layout == "sliced" and n:
        return f".narrow({dim}, 1, {2 * shape[dim]})[{':, ' * dim}::2]" if shape[dim] else f".narrow({dim}, 0, 0)"
    if layout == "expanded" and n:
        return f".expand({', '.join(str(s) for s in shape)})"
    return ""


def _values_expr(inp: Input, shape: list, g: str) -> str:
    size = f"({', '.join(str(s) for s in shape)}{',' if len(shape) == 1 else ''})"
    dt = f"torch.{inp.dtype}"
    if inp.values == "index":
        return f"torch.randint({inp.low}, {inp.high}, {size}, generator={g})"
    if inp.values == "perm":
        # distinct indices along `dim`: argsort of random keys over the indexed size, cut to `high`
        keyed = list(shape)
        keyed[inp.dim] = inp.low
        ksize = f"({', '.join(str(s) for s in keyed)}{',' if len(keyed) == 1 else ''})"
        return f"torch.rand({ksize}, generator={g}).argsort({inp.dim}).narrow({inp.dim}, 0, {inp.high})"
    if inp.values == "mask" or inp.dtype == "bool":
        return f"(torch.rand({size}, generator={g}) < 0.5)"
    if inp.dtype in FLOATS:
        body = f"torch.randn({size}, generator={g}, dtype=torch.float64)"
        if inp.values == "special":
            body = f"_special({body}, {g})"
        if inp.rounded:
            return f"({body} * 3).to(torch.{inp.rounded}).to({dt})"
        return f"({body} * 3).to({dt})"
    info = torch.iinfo(DTYPES[inp.dtype])
    lo, hi = (0, 16) if inp.dtype == "uint8" else (-12, 13)
    body = f"torch.randint({lo}, {hi}, {size}, generator={g})"
    if inp.values == "special":
        body = f"_extremes({body}, {info.min}, {info.max}, {g})"
    return f"{body}.to({dt})"


# the worker's Dynamo settings: `.item()` and data-dependent shapes go into the graph
CAPTURE = ("torch._dynamo.config.capture_scalar_outputs = True\n"
           "torch._dynamo.config.capture_dynamic_output_shape_ops = True\n")

HELPERS = '''\
def _special(x, g):
    # NaN, +-inf, -0.0 and large values at random positions
    pick = torch.randint(0, 12, x.shape, generator=g)
    for k, v in enumerate((float("nan"), float("inf"), float("-inf"), -0.0, 1e4, -3e4)):
        x = torch.where(pick == k, torch.tensor(v, dtype=x.dtype), x)
    return x


def _extremes(x, lo, hi, g):
    pick = torch.randint(0, 8, x.shape, generator=g)
    x = torch.where(pick == 0, torch.tensor(lo), x)
    return torch.where(pick == 1, torch.tensor(hi), x)
'''


@dataclass
class Op:
    """One statement. `code` uses `{t}` for the value it defines (`target`; empty for an in-place
    statement) and `{slot}` for each operand named in `args`. `mutates`: the slot it writes in
    place, if any."""

    code: str
    args: dict
    target: str = ""
    mutates: str = ""

    def render(self) -> str:
        return self.code.format(t=self.target, **self.args)


@dataclass
class Program:
    inputs: list
    ops: list
    outputs: list
    ident: str = ""  # "seed:index" of a generated program
    notes: list = field(default_factory=list)  # hazards the generator saw (see classify)

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> "Program":
        return Program(
            inputs=[Input(**i) for i in d["inputs"]],
            ops=[Op(**o) for o in d["ops"]],
            outputs=list(d["outputs"]),
            ident=d.get("ident", ""),
            notes=list(d.get("notes", [])),
        )

    def function_source(self, name: str = "f") -> str:
        params = ", ".join(i.name for i in self.inputs)
        body = [line for op in self.ops for line in op.render().split("\n")]
        ret = ", ".join(self.outputs) + ("," if len(self.outputs) == 1 else "")
        lines = [f"def {name}({params}):"] + [f"    {b}" for b in body] + [f"    return ({ret})"]
        return "\n".join(lines) + "\n"

    def inputs_source(self, name: str = "make_inputs") -> str:
        lines = [f"def {name}(device='cpu'):"]
        for inp in self.inputs:
            if inp.base:  # a view of the base as the function receives it (on the device)
                lines.append(f"    {inp.base} = {inp.base}.to(device)")
            lines += [f"    {line}" for line in inp.build_lines()]
        moved = ", ".join(f"{i.name}.to(device)" for i in self.inputs)
        lines.append(f"    return [{moved}]")
        return "\n".join(lines) + "\n"

    def repro(self, backend: str = "cpp", device: str = "cpu") -> str:
        """A standalone script: runs the program eagerly and compiled and compares."""
        options = "" if backend == "auto" else f", options={{'backend': '{backend}'}}"
        inputs = self.inputs_source()
        helpers = f"{HELPERS}\n\n" if "_special(" in inputs or "_extremes(" in inputs else ""
        capture = CAPTURE if ".item()" in self.function_source() else ""
        return (
            f"# fuzz program {self.ident or '(edited)'}\nimport torch\nimport torch.nn.functional as F\n{capture}\n\n{helpers}"
            f"{self.inputs_source()}\n\n{self.function_source()}\n\n"
            f"expected = f(*make_inputs('{device}'))\n"
            f"actual = torch.compile(f, backend='ferrocore', fullgraph=True{options})(*make_inputs('{device}'))\n"
            "for e, a in zip(expected, actual):\n"
            "    torch.testing.assert_close(a, e, equal_nan=True)\n"
            "    same = all(n <= 1 or x == y for n, x, y in zip(e.shape, a.stride(), e.stride()))  # dims of size > 1\n"
            "    assert a.dtype == e.dtype and (same or not e.is_contiguous()), (a.stride(), e.stride())\n"
        )

    def op_count(self) -> int:
        return len(self.ops)


def batch_repro(programs: list, backend: str = "cpp", device: str = "cpu") -> str:
    """A standalone script that compiles `programs` as one graph, as a fuzz batch runs them, and
    compares every output with eager (the repro of a `batch_only` failure)."""
    options = "" if backend == "auto" else f", options={{'backend': '{backend}'}}"
    sources = [(p.inputs_source(f"make_inputs_{k}"), p.function_source(f"f_{k}")) for k, p in enumerate(programs)]
    special = any("_special(" in i or "_extremes(" in i for i, _ in sources)
    lines = [f"# fuzz programs {', '.join(p.ident or '(edited)' for p in programs)}, compiled as one graph",
             "import torch", "import torch.nn.functional as F", CAPTURE, ""]
    if special:
        lines += [HELPERS, ""]
    for inputs, fn in sources:
        lines += [inputs, "", fn, ""]
    k = len(programs)
    lines += [
        f"PROGRAMS = [{', '.join(f'(f_{j}, {len(p.inputs)})' for j, p in enumerate(programs))}]",
        f"MAKERS = [{', '.join(f'make_inputs_{j}' for j in range(k))}]",
        "",
        "",
        "def batch(*args):",
        "    out, at = [], 0",
        "    for f, n in PROGRAMS:",
        "        out.append(f(*args[at:at + n]))",
        "        at += n",
        "    return tuple(out)",
        "",
        "",
        f"inputs = lambda: [t for make in MAKERS for t in make('{device}')]",
        "expected = batch(*inputs())",
        f"actual = torch.compile(batch, backend='ferrocore', fullgraph=True{options})(*inputs())",
        "for es, acts in zip(expected, actual):",
        "    for e, a in zip(es, acts):",
        "        torch.testing.assert_close(a, e, equal_nan=True)",
        "        same = all(n <= 1 or x == y for n, x, y in zip(e.shape, a.stride(), e.stride()))  # dims of size > 1",
        "        assert a.dtype == e.dtype and (same or not e.is_contiguous()), (a.stride(), e.stride())",
    ]
    return "\n".join(lines) + "\n"


def rename(text: str, old: str, new: str) -> str:
    return re.sub(rf"\b{re.escape(old)}\b", new, text)


def compile_functions(program: Program, fname: str = "f") -> tuple:
    """(make_inputs, f) of the program, executed from its rendered source."""
    ns: dict = {"torch": torch, "F": torch.nn.functional}
    exec(compile(HELPERS, "<fuzz-helpers>", "exec"), ns)
    exec(compile(program.inputs_source(), f"<fuzz {program.ident} inputs>", "exec"), ns)
    exec(compile(program.function_source(fname), f"<fuzz {program.ident}>", "exec"), ns)
    return ns["make_inputs"], ns[fname]
