"""Random programs, built by running each candidate op eagerly on the values so far (on CPU):
an op eager rejects, or one whose result is too large, is dropped and another drawn. Program
`index` of seed `seed` depends only on (seed, index): `random.Random` seeded with a string
(sha512, independent of PYTHONHASHSEED) and per-input torch generators.

Left out on purpose (the compiler's documented or pending behaviour, not a finding):
integer division or modulo by zero (ATen raises), float -> integer casts of values the target
cannot hold (NaN, inf, out of range: undefined in C++; the `numerics` work owns them).

Besides small programs (results up to MAX_NUMEL elements), a few per run reduce or scan one
long input (LONG_SIZES: up to 10^7 elements), write into an input that overlaps another one in
memory (`Input.base`), or size a result by a tensor's `.item()` (the worker captures scalar
outputs and data-dependent shapes).
"""

from __future__ import annotations

import random
from typing import Callable

import torch
import torch.nn.functional as F

from .program import DTYPE_NAMES, DTYPES, FLOATS, INTS, HELPERS, Input, Op, Program

MAX_NUMEL = 4096
ALL_DTYPES = tuple(DTYPES)


class Context:
    """The program under construction and its eager values (name -> tensor)."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.inputs: list = []
        self.ops: list = []
        self.values: dict = {}
        self.notes: set = set()
        self.pending_inputs: list = []
        self.count = 0
        self.ns: dict = {"torch": torch, "F": F}
        exec(HELPERS, self.ns)

    # ---- names and inputs
    def fresh(self, prefix: str = "v") -> str:
        self.count += 1
        return f"{prefix}{self.count}"

    def add_input(self, shape, dtype: str, **kw) -> str:
        inp = Input(name=self.fresh("x"), shape=list(shape), dtype=dtype, seed=self.rng.randrange(2**31), **kw)
        exec(inp.build_lines()[0], self.ns)
        self.values[inp.name] = self.ns[inp.name]
        self.pending_inputs.append(inp)
        return inp.name

    def index_input(self, shape, low: int, high: int) -> str:
        return self.add_input(shape, "int64", values="index", low=low, high=high)

    def perm_input(self, shape, dim: int, size: int) -> str:
        """Indices distinct along `dim` (shape[dim] <= size) in [0, size)."""
        return self.add_input(shape, "int64", values="perm", dim=dim, low=size, high=shape[dim])

    # ---- picking operands
    def pick(self, pred: Callable = lambda t: True) -> str | None:
        names = [n for n, t in self.values.items() if pred(t)]
        if not names:
            return None
        # prefer recent values so that programs chain
        weights = [1 + i for i in range(len(names))]
        return self.rng.choices(names, weights)[0]

    def t(self, name: str) -> torch.Tensor:
        return self.values[name]


def rand_shape(rng: random.Random, max_dims: int = 4) -> list:
    n = rng.choice([0, 1, 1, 2, 2, 2, 3, 3, 4][: max_dims * 2 + 1])
    shape = []
    for _ in range(n):
        r = rng.random()
        shape.append(0 if r < 0.04 else 1 if r < 0.2 else rng.randint(2, 7) if r < 0.9 else rng.choice([9, 17, 33, 65]))
    while _numel(shape) > 1024:
        shape[shape.index(max(shape))] //= 2
    return shape


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def new_input(ctx: Context, shape=None, dtype=None) -> str:
    rng = ctx.rng
    shape = rand_shape(rng) if shape is None else shape
    dtype = dtype or rng.choice(ALL_DTYPES + ("float32", "float32", "int64"))
    layouts = ["contiguous"] * 3 + (["transposed", "sliced", "expanded"] if shape else [])
    layout = rng.choice(layouts)
    if layout == "transposed" and len(shape) < 2:
        layout = "contiguous"
    values = "special" if rng.random() < 0.15 and dtype != "bool" else "normal"
    return ctx.add_input(shape, dtype, layout=layout, dim=rng.randrange(max(len(shape), 1)), values=values)


# ------------------------------------------------------------------------------------------------
# Op builders: each returns an Op (with `{t}` for its result) or None, and may add inputs.

UNARY = ("abs neg exp log sqrt sin cos tanh sigmoid relu floor ceil round trunc sign reciprocal rsqrt "
         "expm1 log1p erf square frac bitwise_not logical_not isnan isinf signbit exp2 log2 atan "
         "sinh acos asinh erfinv clone tan asin cosh acosh atanh log10 lgamma sinc deg2rad nan_to_num").split()
# float activations and special functions, as models call them
ACTIVATIONS = ("F.gelu F.silu F.softplus F.elu F.leaky_relu F.hardsigmoid F.hardswish F.mish F.selu F.celu "
               "F.logsigmoid F.hardtanh F.relu6 torch.special.erfc torch.logit torch.special.expit").split()
BINARY = ("add sub mul div floor_divide remainder fmod maximum minimum atan2 pow bitwise_and "
          "bitwise_or bitwise_xor bitwise_left_shift bitwise_right_shift eq ne lt le gt ge "
          "logical_and logical_or logical_xor hypot copysign fmax fmin").split()
INT_DIVISION = ("floor_divide", "remainder", "fmod", "div_floor", "div_trunc")
SCALARS = (0, 1, 2, 3, -1, -7, 0.5, -2.25, 1e3, True, False, 1.0)
# exponents ATen computes specially (square root, reciprocal square root, ...) and others
POW_SCALARS = (0.5, -0.5, -2, 2, 3, -1, 0.7, 0, -1.5)
# scalars outside narrow types: arithmetic wraps (eager raises where a fill converts them; such
# an op is dropped as eager rejects it)
OUT_OF_RANGE = (300, -129, 70000, 1e39, 2**31, -256, 65536.0)


def _scalar(rng) -> str:
    return repr(rng.choice(OUT_OF_RANGE if rng.random() < 0.05 else SCALARS))


def _broadcast_partner(ctx: Context, a: str) -> str:
    """An operand broadcastable with `a`: a value of a compatible shape, a new input of a shape
    broadcast against it, or a 0-dim tensor."""
    rng, ta = ctx.rng, ctx.t(a)
    r = rng.random()
    if r < 0.35:
        b = ctx.pick(lambda t: _broadcasts(t.shape, ta.shape))
        if b is not None:
            return b
    if r < 0.45:
        return new_input(ctx, shape=[])
    shape = [s if rng.random() < 0.7 else 1 for s in ta.shape]
    if rng.random() < 0.3:
        shape = shape[rng.randrange(len(shape) + 1):]
    return new_input(ctx, shape=shape)


def _broadcasts(s1, s2) -> bool:
    try:
        torch.broadcast_shapes(s1, s2)
        return True
    except RuntimeError:
        return False


def op_unary(ctx: Context):
    a = ctx.pick()
    if ctx.rng.random() < 0.25:
        return Op(f"{{t}} = {ctx.rng.choice(ACTIVATIONS)}({{a}})", {"a": a})
    fn = ctx.rng.choice(UNARY)
    return Op(f"{{t}} = torch.{fn}({{a}})", {"a": a})


def op_binary(ctx: Context):
    rng = ctx.rng
    a = ctx.pick()
    fn = rng.choice(BINARY + ["div_floor", "div_trunc"])
    call = {"div_floor": "torch.div({x}, {y}, rounding_mode='floor')",
            "div_trunc": "torch.div({x}, {y}, rounding_mode='trunc')"}.get(fn, f"torch.{fn}({{x}}, {{y}})")
    # pow takes a scalar exponent more often: ATen computes several of them specially
    if rng.random() < (0.6 if fn == "pow" else 0.3) and fn not in ("atan2", "hypot", "copysign", "fmax", "fmin", "logical_xor"):
        return _binary_scalar(ctx, fn, call, a)
    b = _broadcast_partner(ctx, a)
    if not _divisor_ok(ctx, fn, ctx.t(a), ctx.t(b)):
        return None
    return Op(f"{{t}} = {call.format(x='{a}', y='{b}')}", {"a": a, "b": b})


# the operator form of a python scalar on the left
SCALAR_LEFT = {"add": "{s} + {{a}}", "sub": "{s} - {{a}}", "mul": "{s} * {{a}}", "div": "{s} / {{a}}",
               "pow": "{s} ** {{a}}", "remainder": "{s} % {{a}}", "floor_divide": "{s} // {{a}}",
               "bitwise_and": "{s} & {{a}}", "eq": "{s} == {{a}}", "lt": "{s} < {{a}}"}


def _binary_scalar(ctx: Context, fn: str, call: str, a: str):
    rng = ctx.rng
    s = rng.choice(OUT_OF_RANGE if rng.random() < 0.05 else SCALARS)
    if fn == "pow" and rng.random() < 0.7:
        s = rng.choice(POW_SCALARS)
    if fn in ("bitwise_left_shift", "bitwise_right_shift"):
        s = rng.randrange(0, 9)
    ta = ctx.t(a)
    if fn in SCALAR_LEFT and rng.random() < 0.3:
        if not _divisor_ok(ctx, fn, torch.tensor(s), ta):
            return None
        return Op("{t} = " + SCALAR_LEFT[fn].format(s=repr(s)), {"a": a})
    if not _divisor_ok(ctx, fn, ta, torch.tensor(s)):
        return None
    return Op(f"{{t}} = {call.format(x='{a}', y=repr(s))}", {"a": a})


def _divisor_ok(ctx: Context, fn: str, x: torch.Tensor, y: torch.Tensor) -> bool:
    """Integer division or modulo by zero is left out (ATen raises; compiled code gives 0, a
    documented deviation). Notes MIN // -1 (eager wraps around; so must the compiled code)."""
    if fn not in INT_DIVISION or x.is_floating_point() or y.is_floating_point():
        return True
    if bool((y == 0).any()):
        return False
    ctype = torch.promote_types(x.dtype, y.dtype)
    if ctype not in (torch.bool, torch.uint8) and bool((y == -1).any()):
        if bool((x.to(torch.int64) == torch.iinfo(ctype).min).any()):
            ctx.notes.add("int_min_div_neg1")
    return True


def op_where_clamp(ctx: Context):
    rng = ctx.rng
    a = ctx.pick()
    r = rng.random()
    if r < 0.4:
        c = ctx.pick(lambda t: t.dtype == torch.bool and _broadcasts(t.shape, ctx.t(a).shape))
        b = _broadcast_partner(ctx, a)
        if c is None or rng.random() < 0.5:
            return Op(f"{{t}} = torch.where({{a}} > {_scalar(rng)}, {{a}}, {{b}})", {"a": a, "b": b})
        return Op("{t} = torch.where({c}, {a}, {b})", {"a": a, "b": b, "c": c})
    if r < 0.8:
        lo, hi = sorted([rng.choice((-3, -1, 0, 0.5, 2)), rng.choice((1, 2, 4, 2.5))])
        kind = rng.choice(["both", "min", "max"])
        args = {"both": f"min={lo}, max={hi}", "min": f"min={lo}", "max": f"max={hi}"}[kind]
        return Op(f"{{t}} = torch.clamp({{a}}, {args})", {"a": a})
    b = _broadcast_partner(ctx, a)
    return Op("{t} = torch.clamp({a}, min={b})", {"a": a, "b": b})


def op_cast(ctx: Context):
    a = ctx.pick()
    dt = ctx.rng.choice(ALL_DTYPES)
    return Op(f"{{t}} = {{a}}.to(torch.{dt})", {"a": a})


def cast_guard(ctx: Context, op: Op) -> bool:
    """Float -> integer conversions (`.to`, `copy_` into an integer tensor) only of values the
    target holds: NaN, inf and out-of-range values are undefined in C++ (`numerics` owns them)."""
    if ".to(torch." in op.code:
        src, dst = ctx.t(op.args["a"]), DTYPES[op.code.split(".to(torch.")[1].split(")")[0]]
    elif ".copy_({b})" in op.code:
        src, dst = ctx.t(op.args["b"]), ctx.t(op.args["a"]).dtype
    else:
        return True
    if not src.is_floating_point() or dst.is_floating_point or dst == torch.bool:
        return True
    x = src.double()
    info = torch.iinfo(dst)
    return bool((torch.isfinite(x) & (x > float(info.min) - 1) & (x < float(info.max) + 1)).all())


def overlap_guard(ctx: Context, op: Op) -> bool:
    """In-place writes only into tensors without internal overlap (an expanded input): eager's
    result there depends on its loop order."""
    if not op.mutates:
        return True
    return torch._debug_has_internal_overlap(ctx.t(op.args[op.mutates])) == 0


REDUCTIONS = "sum mean amax amin argmax argmin prod var std logsumexp cumsum any all nansum max min".split()


def op_reduction(ctx: Context):
    rng = ctx.rng
    a = ctx.pick(lambda t: t.dim() > 0) or ctx.pick()
    n = ctx.t(a).dim()
    fn = rng.choice(REDUCTIONS)
    keep = rng.choice([True, False])
    narrow = ["bool", "int8", "uint8", "int16", "int32", "int64"]
    integral = not ctx.t(a).is_floating_point() and not ctx.t(a).is_complex()
    if fn in ("cumsum",):
        # integer running sums in a narrow type wrap as eager's
        dt = f", dtype=torch.{rng.choice(narrow[1:])}" if integral and rng.random() < 0.3 else ""
        return Op(f"{{t}} = torch.cumsum({{a}}, {rng.randrange(-n, max(n, 1))}{dt})", {"a": a})
    if fn in ("max", "min") and n:
        k = rng.randrange(2)
        return Op(f"{{t}} = torch.{fn}({{a}}, {rng.randrange(-n, n)}, keepdim={keep})[{k}]", {"a": a})
    if fn in ("argmax", "argmin"):
        dim = rng.randrange(-n, n) if n and rng.random() < 0.8 else None
        return Op(f"{{t}} = torch.{fn}({{a}}, dim={dim}, keepdim={keep})", {"a": a})
    dims = _dims(rng, n)
    extra = ""
    if fn in ("var", "std"):
        extra = f", correction={rng.choice([0, 1, 1, 2])}"
    if fn == "sum" and rng.random() < 0.2:
        # (a float -> integer dtype would be a cast of values the target may not hold); bool and
        # narrow integer sums saturate or wrap as eager's
        extra = f", dtype=torch.{rng.choice(['float64', 'float32'] + (narrow if integral else []))}"
    if fn == "prod" and integral and rng.random() < 0.3:
        extra = f", dtype=torch.{rng.choice(narrow)}"
    if fn in ("any", "all", "prod") and (dims is None or len(dims) > 1):  # one dim or all of them
        dims = None if dims is None else dims[0]
    if dims is None:
        if fn in ("logsumexp", "any", "all", "prod") and n and rng.random() < 0.5:
            dims = list(range(n)) if fn == "logsumexp" else 0
        elif fn in ("logsumexp",):
            dims = []
        else:
            return Op(f"{{t}} = torch.{fn}({{a}}{extra})", {"a": a})
    return Op(f"{{t}} = torch.{fn}({{a}}, {dims}, keepdim={keep}{extra})", {"a": a})


def _dims(rng, n: int):
    if n == 0 or rng.random() < 0.2:
        return None
    k = rng.randint(1, n)
    return sorted(rng.sample(range(n), k))


def op_view(ctx: Context):
    rng = ctx.rng
    a = ctx.pick()
    t = ctx.t(a)
    n, shape = t.dim(), list(t.shape)
    kinds = ["unsqueeze", "reshape", "flatten"]
    if n:
        kinds += ["permute", "transpose", "slice", "select", "squeeze", "flip", "narrow", "expand", "movedim",
                  "unbind", "chunk", "as_strided", "view"]
    if n >= 2:
        kinds += ["diagonal", "t"]
    kind = rng.choice(kinds)
    d = rng.randrange(-n, n) if n else 0
    code = {
        "unsqueeze": lambda: f"{{a}}.unsqueeze({rng.randrange(-n - 1, n + 1)})",
        "flatten": lambda: "{a}.flatten()",
        "reshape": lambda: f"{{a}}.reshape({_reshape(rng, shape)})",
        "view": lambda: f"{{a}}.view({_reshape(rng, shape)})",
        "permute": lambda: f"{{a}}.permute({rng.sample(range(n), n)})",
        "transpose": lambda: f"{{a}}.transpose({d}, {rng.randrange(-n, n)})",
        "t": lambda: "{a}.t()" if n == 2 else "{a}.mT",
        "slice": lambda: f"{{a}}[{':, ' * (d % n)}{_slice(rng, shape[d])}]",
        "select": lambda: f"{{a}}.select({d}, {rng.randrange(-shape[d], shape[d]) if shape[d] else 0})",
        "squeeze": lambda: f"{{a}}.squeeze({d})" if rng.random() < 0.7 else "{a}.squeeze()",
        "flip": lambda: f"{{a}}.flip({_dims(rng, n) or [0]})",
        "narrow": lambda: _narrow(rng, d, shape[d]),
        "expand": lambda: _expand(rng, shape),
        "movedim": lambda: f"{{a}}.movedim({d}, {rng.randrange(-n, n)})",
        "unbind": lambda: f"{{a}}.unbind({d})[{rng.randrange(shape[d]) if shape[d] else 0}]",
        "chunk": lambda: f"{{a}}.chunk({rng.randint(1, 3)}, {d})[0]",
        "as_strided": lambda: _as_strided(rng, t),
        "diagonal": lambda: f"{{a}}.diagonal({rng.randrange(-2, 3)}, {rng.randrange(n)}, {rng.randrange(n)})",
    }[kind]()
    return Op(f"{{t}} = {code}", {"a": a})


def _reshape(rng, shape) -> list:
    numel = _numel(shape)
    if numel == 0 or rng.random() < 0.3:
        return [-1] if numel else [0, -1] if shape else [-1]
    dims = []
    rest = numel
    for f in (2, 3, 5, 7):
        while rest % f == 0 and rng.random() < 0.5:
            dims.append(f)
            rest //= f
    dims.append(rest)
    rng.shuffle(dims)
    if rng.random() < 0.3:
        dims[rng.randrange(len(dims))] = -1
    return dims


def _slice(rng, size: int) -> str:
    start = rng.choice([None, 0, 1, -2])
    stop = rng.choice([None, size, -1, 3])
    step = rng.choice([None, 1, 2, 3])
    fmt = lambda v: "" if v is None else str(v)
    return f"{fmt(start)}:{fmt(stop)}" + (f":{step}" if step else "")


def _narrow(rng, d: int, size: int) -> str:
    start = rng.randrange(size + 1) if size else 0
    return f"{{a}}.narrow({d}, {start}, {rng.randrange(size - start + 1)})"


def _expand(rng, shape) -> str:
    new = [rng.randint(2, 3) if s == 1 and rng.random() < 0.7 else -1 for s in shape]
    if rng.random() < 0.4:
        new = [rng.randint(1, 3)] + new
    return f"{{a}}.expand({new})"


def _as_strided(rng, t: torch.Tensor) -> str:
    """A window of the contiguous copy, within its elements."""
    numel = t.numel()
    if numel == 0:
        return "{a}.contiguous().as_strided([0], [1])"
    size = [rng.randint(1, 3) for _ in range(rng.randint(1, 3))]
    stride = [rng.randint(0, 3) for _ in size]
    span = sum((s - 1) * st for s, st in zip(size, stride))
    if span >= numel:
        size, stride, span = [numel], [1], numel - 1
    offset = rng.randrange(numel - span)
    return f"{{a}}.contiguous().as_strided({size}, {stride}, {offset})"


def op_index(ctx: Context):
    rng = ctx.rng
    a = ctx.pick(lambda t: t.dim() > 0 and t.numel() > 0)
    if a is None:
        return None
    t = ctx.t(a)
    n, shape = t.dim(), list(t.shape)
    d = rng.randrange(n)
    kind = rng.choice(["index_select", "gather", "advanced", "advanced_dim", "two", "mask", "take_along", "mask_where"])
    size = shape[d]
    if kind == "index_select":
        i = ctx.index_input([rng.randint(0, 6)], 0, size)
        return Op(f"{{t}} = torch.index_select({{a}}, {d}, {{i}})", {"a": a, "i": i})
    if kind in ("gather", "take_along"):
        ishape = [rng.randint(0, s) if k != d else rng.randint(0, 5) for k, s in enumerate(shape)]
        i = ctx.index_input(ishape, 0, size)
        fn = f"torch.gather({{a}}, {d}, {{i}})" if kind == "gather" else f"torch.take_along_dim({{a}}, {{i}}, {d})"
        return Op(f"{{t}} = {fn}", {"a": a, "i": i})
    if kind == "advanced":
        i = ctx.index_input(rand_shape(rng, 2), -shape[0], shape[0])
        return Op("{t} = {a}[{i}]", {"a": a, "i": i})
    if kind == "advanced_dim":
        i = ctx.index_input([rng.randint(1, 5)], -size, size)
        return Op(f"{{t}} = {{a}}[{':, ' * d}{{i}}]", {"a": a, "i": i})
    if kind == "two" and n >= 2:
        i = ctx.index_input([rng.randint(1, 4), 1], 0, shape[0])
        j = ctx.index_input([rng.randint(1, 4)], 0, shape[1])
        return Op("{t} = {a}[{i}, {j}]", {"a": a, "i": i, "j": j})
    if kind == "mask":
        m = ctx.add_input(shape[: rng.randint(1, n)], "bool", values="mask")
        return Op("{t} = {a}[{m}]", {"a": a, "m": m})
    return Op(f"{{t}} = torch.where({{a}} > 0, {{a}}, {{a}}.flip({d}))", {"a": a})


SCATTER_REDUCES = ("sum", "prod", "mean", "amax", "amin")


def op_scatter(ctx: Context):
    rng = ctx.rng
    a = ctx.pick(lambda t: t.dim() > 0)
    if a is None:
        return None
    t = ctx.t(a)
    n, shape = t.dim(), list(t.shape)
    d = rng.randrange(n)
    size = shape[d]
    dt = DTYPE_NAMES[t.dtype]
    kind = rng.choice(["scatter", "scatter_value", "scatter_add", "scatter_reduce", "index_add", "index_put",
                       "index_put_acc", "masked_fill", "masked_scatter", "index_fill", "index_copy"])
    if kind in ("scatter", "scatter_value", "scatter_add", "scatter_reduce"):
        ishape = [rng.randint(0, s) if k != d else rng.randint(0, size) for k, s in enumerate(shape)]
        if kind == "scatter":  # distinct targets: eager keeps the last of duplicate writes
            i = ctx.perm_input(ishape, d, size)
        else:
            i = ctx.index_input(ishape, 0, max(size, 1)) if size else ctx.perm_input(ishape, d, 0)
        src = ctx.add_input([s + rng.randint(0, 1) for s in ishape], dt)
        if kind == "scatter":
            return Op(f"{{t}} = torch.scatter({{a}}, {d}, {{i}}, {{s}})", {"a": a, "i": i, "s": src})
        if kind == "scatter_value":
            return Op(f"{{t}} = torch.scatter({{a}}, {d}, {{i}}, {_scalar(rng)})", {"a": a, "i": i})
        if kind == "scatter_add":
            return Op(f"{{t}} = torch.scatter_add({{a}}, {d}, {{i}}, {{s}})", {"a": a, "i": i, "s": src})
        red = rng.choice(SCATTER_REDUCES)
        return Op(f"{{t}} = torch.scatter_reduce({{a}}, {d}, {{i}}, {{s}}, '{red}', include_self={rng.random() < 0.5})",
                  {"a": a, "i": i, "s": src})
    if kind in ("index_add", "index_copy", "index_fill"):
        k = rng.randint(0, size)
        i = ctx.perm_input([k], 0, size) if kind == "index_copy" else ctx.index_input([k], 0, max(size, 1))
        if kind == "index_fill":
            return Op(f"{{t}} = torch.index_fill({{a}}, {d}, {{i}}, {_scalar(rng)})", {"a": a, "i": i})
        src = ctx.add_input(shape[:d] + [k] + shape[d + 1:], dt)
        alpha = f", alpha={rng.choice([1, 2])}" if kind == "index_add" and dt != "bool" else ""
        return Op(f"{{t}} = torch.{kind}({{a}}, {d}, {{i}}, {{s}}{alpha})", {"a": a, "i": i, "s": src})
    if kind in ("index_put", "index_put_acc"):
        acc = kind == "index_put_acc"
        k = rng.randint(0, shape[0])
        i = ctx.index_input([k], -shape[0], max(shape[0], 1)) if acc else ctx.perm_input([k], 0, shape[0])
        v = ctx.add_input(([k] if rng.random() < 0.5 else []) + shape[1:] if rng.random() < 0.8 else [], dt)
        return Op(f"{{t}} = torch.index_put({{a}}, ({{i}},), {{v}}, accumulate={acc})", {"a": a, "i": i, "v": v})
    m = ctx.add_input(shape[rng.randrange(n):], "bool", values="mask")
    if kind == "masked_fill":
        return Op(f"{{t}} = {{a}}.masked_fill({{m}}, {_scalar(rng)})", {"a": a, "m": m})
    src = ctx.add_input([s + rng.randint(0, 1) for s in shape], dt)
    return Op("{t} = {a}.masked_scatter({m}, {s})", {"a": a, "m": m, "s": src})


def op_mutate(ctx: Context):
    """An in-place op: on an input (the compiled graph must write it back) or on a clone."""
    rng = ctx.rng
    a = ctx.pick()
    t = ctx.t(a)
    shape = list(t.shape)
    dt = DTYPE_NAMES[t.dtype]
    sl = f"[{':, ' * rng.randrange(len(shape))}{_slice(rng, 3)}]" if shape and rng.random() < 0.5 else ""
    kind = rng.choice(["add_", "mul_", "copy_", "index_put_", "masked_fill_", "clamp_", "setitem", "div_"])
    args = {"a": a}
    if kind in ("add_", "mul_", "copy_", "div_"):
        if rng.random() < 0.7:
            args["b"] = _broadcast_partner(ctx, a)
        arg = "{b}" if "b" in args else _scalar(rng)
        stmt = f"{{x}}{sl}.{kind}({arg})" if kind != "copy_" or "b" in args else f"{{x}}{sl}.fill_({arg})"
    elif kind == "index_put_" and shape:
        acc = rng.random() < 0.5
        if acc:
            args["i"] = ctx.index_input([rng.randint(0, 4)], 0, max(shape[0], 1))
        else:
            args["i"] = ctx.perm_input([min(shape[0], 2)], 0, shape[0])
        args["v"] = ctx.add_input(shape[1:], dt)
        stmt = f"{{x}}.index_put_(({{i}},), {{v}}, accumulate={acc})"
    elif kind == "masked_fill_":
        args["m"] = ctx.add_input(shape, "bool", values="mask")
        stmt = f"{{x}}.masked_fill_({{m}}, {_scalar(rng)})"
    elif kind == "clamp_":
        stmt = f"{{x}}{sl}.clamp_(min={rng.choice([-1, 0, 0.5])})"
    else:
        stmt = f"{{x}}{sl or '[...]'} = {_scalar(rng)}"
    keep = {k: "{" + k + "}" for k in args if k != "a"}
    if rng.random() < 0.6 and a in {i.name for i in ctx.inputs}:
        return Op(stmt.format(x="{a}", **keep), args, mutates="a")
    return Op("{t} = {a}.clone()\n" + stmt.format(x="{t}", **keep), args)


def op_join(ctx: Context):
    rng = ctx.rng
    a = ctx.pick()
    t = ctx.t(a)
    shape, n = list(t.shape), t.dim()
    kind = rng.choice(["cat", "stack", "pad", "pad_mode"])
    if kind in ("cat", "stack"):
        d = rng.randrange(n + (kind == "stack")) if n or kind == "stack" else 0
        other = list(shape)
        if kind == "cat" and n:
            other[d] = rng.randint(0, 3)
        b = ctx.pick(lambda u: list(u.shape) == other and u is not t) if rng.random() < 0.4 else None
        b = b or new_input(ctx, shape=other)
        return Op(f"{{t}} = torch.{kind}([{{a}}, {{b}}, {{a}}], {d})", {"a": a, "b": b})
    pads = [rng.randint(-1, 2) for _ in range(2 * rng.randint(1, max(min(n, 3), 1)))]
    if kind == "pad" or t.dtype not in (torch.float32, torch.float64) or n not in (2, 3, 4):
        return Op(f"{{t}} = F.pad({{a}}, {pads}, value={_scalar(rng)})", {"a": a})
    mode = rng.choice(["reflect", "replicate", "circular"])
    pads = [abs(p) for p in pads[: 2 * (n - 1)]]
    return Op(f"{{t}} = F.pad({{a}}, {pads}, mode='{mode}')", {"a": a})


LONG_SIZES = (10**5, 10**5, 10**6, 10**6, 10**7)
LONG_OPS = {
    "sum": "{a}.sum()", "mean": "{a}.mean()", "var": "{a}.var()", "std": "{a}.std(-1)", "norm": "torch.linalg.vector_norm({a})",
    "logsumexp": "{a}.logsumexp(-1)", "cumsum": "{a}.cumsum(-1)", "amax": "{a}.amax()", "argmax": "{a}.argmax()",
    "softmax_sum": "torch.softmax({a}, -1).sum(-1)", "layer_norm": "F.layer_norm({a}, {a}.shape[-1:]).abs().sum()",
    "mse": "F.mse_loss({a}, {a}.flip(-1))", "sum_rows": "{a}.sum(0)", "sum_f32": "{a}.sum(dtype=torch.float32)",
}
LONG_INTEGRAL_OPS = {
    "sum": "{a}.sum()", "sum_narrow": "{a}.sum(-1, dtype=torch.{n})", "cumsum_narrow": "{a}.cumsum(-1, dtype=torch.{n})",
    "sum_bool": "{a}.sum(-1, dtype=torch.bool)", "any": "{a}.any()", "amax": "{a}.amax(-1)",
}


def op_long(ctx: Context):
    """A reduction or scan of one long input (10^5 to 10^7 elements): accumulation at size."""
    rng = ctx.rng
    n = rng.choice(LONG_SIZES)
    rows = rng.choice([1, 1, 1, 2, 16])
    dtype = rng.choice(["float32"] * 5 + ["float64", "bfloat16", "float16", "int32", "int8", "bool"])
    values = "special" if rng.random() < 0.1 and dtype != "bool" else "normal"
    x = ctx.add_input([rows, n // rows] if rows > 1 else [n], dtype, values=values)
    if dtype in FLOATS:
        name = rng.choice(list(LONG_OPS))
        code = LONG_OPS[name]
        if name == "sum_f32" and dtype not in ("bfloat16", "float16"):
            code = LONG_OPS["sum"]
    else:
        code = LONG_INTEGRAL_OPS[rng.choice(list(LONG_INTEGRAL_OPS))].replace(
            "{n}", rng.choice(["int8", "uint8", "int16", "int32", "bool"]))
    ctx.large = True
    return Op("{t} = " + code, {"a": x})


def op_overlap(ctx: Context):
    """A write into an input that overlaps another input in memory, and a read of the other
    (before or after the write): compiled graphs must see each other's writes as eager does."""
    rng = ctx.rng
    bases = [i for i in ctx.inputs if i.layout == "contiguous" and not i.base and i.dtype != "bool"
             and 2 <= _numel(i.shape) and i.values in ("normal", "special")]
    if not bases:
        return None
    base = rng.choice(bases)
    total = _numel(base.shape)
    m = rng.randint(1, total)
    offset = rng.randint(0, total - m)
    shape = [m // 2, 2] if m % 2 == 0 and rng.random() < 0.3 else [m]
    alias = ctx.add_input(shape, base.dtype, layout="alias", values=base.values)
    ctx.pending_inputs[-1].base, ctx.pending_inputs[-1].low = base.name, offset
    exec(ctx.pending_inputs[-1].build_lines()[0], ctx.ns)
    ctx.values[alias] = ctx.ns[alias]
    written, read = (base.name, alias) if rng.random() < 0.5 else (alias, base.name)
    write = rng.choice(["{w}.add_(2)", "{w}.mul_(-1)", "{w}.fill_(3)", "{w}[...] = 7", "{w}.clamp_(min=0)"])
    read_stmt = "{t} = {r} * 2 + 1"
    code = f"{write}\n{read_stmt}" if rng.random() < 0.5 else f"{read_stmt}\n{write}"
    return Op(code.replace("{w}", "{a}").replace("{r}", "{b}"), {"a": written, "b": read}, mutates="a")


def op_item(ctx: Context):
    """A result whose size is a tensor's value (`.item()`), as data-dependent programs make."""
    rng = ctx.rng
    a = ctx.pick(lambda t: t.dim() >= 1 and t.shape[0] >= 1)
    if a is None:
        return None
    t = ctx.t(a)
    k = ctx.index_input([], 0, t.shape[0] + 1)
    kinds = ["{t} = {a}[:{k}.item()] * 2", "{t} = {a}.narrow(0, 0, {k}.item()) + 1",
             "{t} = torch.zeros({k}.item()) + {a}.float().sum()", "{t} = torch.arange({k}.item()) * 3"]
    if t.dim() == 1 and t.is_floating_point():
        kinds.append("{t} = torch.topk({a}, {k}.item()).values")
    return Op(rng.choice(kinds), {"a": a, "k": k})


BUILDERS = (
    (op_unary, 3), (op_binary, 5), (op_where_clamp, 2), (op_cast, 2), (op_reduction, 3),
    (op_view, 4), (op_index, 2), (op_scatter, 2), (op_mutate, 2), (op_join, 1),
    (op_long, 0.15), (op_overlap, 0.4), (op_item, 0.3),
)
def nan_sign_guard(ctx: Context, op: Op) -> bool:
    """No sign read off a NaN (signbit, copysign's sign source): IEEE leaves a NaN's sign
    unspecified, and the math libraries differ (glibc's log of a negative number gives -NaN,
    ATen's vectorized one +NaN)."""
    if "signbit(" not in op.code and "copysign(" not in op.code:
        return True
    slot = "b" if "copysign(" in op.code and "b" in op.args else "a"
    t = ctx.t(op.args[slot])
    return not (t.is_floating_point() and bool(t.isnan().any()))


GUARDS = (cast_guard, overlap_guard, nan_sign_guard)


def _attempt(ctx: Context, build) -> bool:
    """Draws one op, runs it eagerly; keeps it if eager accepts it and its result is small."""
    ctx.pending_inputs = []
    ctx.large = False  # a long reduction's (op_long) result may exceed MAX_NUMEL
    saved = (dict(ctx.values), ctx.count)
    snapshot = {k: v.clone() for k, v in ctx.values.items()}
    op = build(ctx)
    ok = op is not None
    if ok:
        op.target = ctx.fresh() if "{t}" in op.code else ""
        ok = all(g(ctx, op) for g in GUARDS)
    if ok:
        try:
            exec(op.render(), ctx.ns)
            value = ctx.ns.get(op.target) if op.target else None
            ok = (not op.target) or (isinstance(value, torch.Tensor) and (ctx.large or value.numel() <= MAX_NUMEL))
        except Exception:
            ok = False
    if not ok:
        _restore(ctx, saved, snapshot)
        return False
    ctx.inputs += ctx.pending_inputs
    if op.target:
        ctx.values[op.target] = ctx.ns[op.target]
    ctx.ops.append(op)
    return True


def _restore(ctx: Context, saved, snapshot) -> None:
    """Undoes a rejected op, including a partial in-place write before eager raised."""
    ctx.values, ctx.count = saved
    for k, v in ctx.values.items():
        if not torch.equal(v, snapshot[k]):
            try:
                v.copy_(snapshot[k])
            except RuntimeError:  # an expanded input is never written in place
                pass
        ctx.ns[k] = v


def generate(seed: int, index: int, max_ops: int = 6) -> Program:
    rng = random.Random(f"fuzz:{seed}:{index}")
    ctx = Context(rng)
    for _ in range(rng.randint(1, 2)):
        new_input(ctx)
    ctx.inputs += ctx.pending_inputs
    ctx.pending_inputs = []
    want = rng.randint(1, max_ops)
    builders, weights = zip(*BUILDERS)
    tries = 0
    while len(ctx.ops) < want and tries < 20 * want:
        tries += 1
        _attempt(ctx, rng.choices(builders, weights)[0])
    return Program(inputs=ctx.inputs, ops=ctx.ops, outputs=_outputs(ctx), ident=f"{seed}:{index}",
                   notes=sorted(ctx.notes))


def _outputs(ctx: Context) -> list:
    """The values no later op reads, and some that are read (they must be realized too)."""
    defined = [op.target for op in ctx.ops if op.target]
    used = {v for op in ctx.ops for v in op.args.values()}
    outs = [v for v in defined if v not in used or ctx.rng.random() < 0.3]
    if not outs:  # only in-place statements on inputs: return one of them
        outs = [ctx.inputs[0].name]
    return outs
