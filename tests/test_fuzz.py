"""The differential fuzzer (`bench/fuzz.py`, `bench/fuzzer/`, docs/fuzzing.md): programs are the
same in every process, they cover the op families, dtypes and layouts they claim, the comparison
names planted bugs by class, the minimizer shrinks a planted failure, and a short fixed-seed run
of the C++ backend and of the Triton backend under the interpreter finds no failure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

from fuzzer import compare  # noqa: E402
from fuzzer.check import run_programs  # noqa: E402
from fuzzer.generate import generate  # noqa: E402
from fuzzer.minimize import fewest_partners, minimize  # noqa: E402
from fuzzer.program import DTYPES, Input, Op, Program, batch_repro  # noqa: E402
from fuzzer.runner import is_failure, run_fuzz  # noqa: E402

CI_SEED = 20
CPP_COUNT = 96
TRITON_COUNT = 24


# the fuzzer makes its programs' inputs on the CPU (bench/fuzz.py --device cuda runs them on a GPU)
pytestmark = pytest.mark.cpu_only("the fuzzer's programs make CPU tensors")


def test_program_i_of_seed_s_is_the_same_in_every_process():
    here = [generate(5, i).repro() for i in range(25)]
    assert here == [generate(5, i).repro() for i in range(25)]
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); from fuzzer.generate import generate; "
            "print(json.dumps([generate(5, i).repro() for i in range(25)]))")
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code, str(BENCH)], env=env,
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == here
    assert len(set(here)) == len(here)


def test_programs_cover_the_op_families_dtypes_and_layouts():
    programs = [generate(CI_SEED, i) for i in range(300)]
    text = "".join(p.function_source() for p in programs)
    for needle in ("torch.floor_divide", "torch.remainder", "torch.bitwise_left_shift", "torch.bitwise_xor",
                   "torch.where", "torch.clamp", ".to(torch.", "torch.sum", "torch.mean", "torch.amax",
                   "torch.argmax", "torch.prod", "torch.var", "torch.std", "torch.logsumexp", "torch.cumsum",
                   "keepdim=True", ".permute(", ".transpose(", ".reshape(", ".expand(", "::", ".select(",
                   ".unsqueeze(", ".squeeze(", ".flip(", ".narrow(", ".diagonal(", ".as_strided(",
                   "torch.index_select", "torch.gather", "torch.take_along_dim", "torch.scatter(",
                   "torch.scatter_add", "torch.scatter_reduce", "torch.index_add", "accumulate=True",
                   ".masked_fill(", ".masked_scatter(", "torch.cat", "torch.stack", "F.pad", ".clone()"):
        assert needle in text, needle
    inputs = [i for p in programs for i in p.inputs]
    assert {i.dtype for i in inputs} == set(DTYPES)
    assert {i.layout for i in inputs} == {"contiguous", "transposed", "sliced", "expanded", "alias"}
    # at size and at the edges (a few programs in a hundred each): long reductions, writes into
    # overlapping inputs, .item() sizes, pow's special exponents, narrow-integer accumulation
    more = programs + [generate(CI_SEED, i) for i in range(300, 1200)]
    text = "".join(p.function_source() for p in more)
    inputs = [i for p in more for i in p.inputs]
    assert any(i.base for i in inputs) and any(max(i.shape, default=0) >= 10**5 for i in inputs)
    for needle in (".item()", ", -0.5)", "dtype=torch.int8", "dtype=torch.bool", "F.silu"):
        assert needle in text, needle
    assert any(0 in i.shape for i in inputs) and any(1 in i.shape for i in inputs)
    assert any(i.values == "special" for i in inputs)
    assert any(op.mutates for p in programs for op in p.ops), "no in-place op on an input"
    assert any("[{m}]" in op.code for p in programs for op in p.ops), "no boolean-mask indexing"


# ------------------------------------------------------------------------------------------------
# Planted bugs: dynamo backends that run the captured graph wrongly, one way each.


def _planted(rewrite=None, outputs=None, clone_inputs=False):
    def backend(gm, example_inputs):
        if rewrite:
            for node in gm.graph.nodes:
                rewrite(node)
            gm.recompile()

        def run(*args):
            args = [a.clone() if clone_inputs and isinstance(a, torch.Tensor) else a for a in args]
            out = gm(*args)
            return type(out)(outputs(o) for o in out) if outputs else out

        return run

    return backend


def _sin_to_cos(node):
    if node.target is torch.sin:
        node.target = torch.cos


def _program(ops, outputs, shape=(3, 4), dtype="float32", layout="contiguous"):
    return Program(inputs=[Input("x0", list(shape), dtype, seed=1, layout=layout)], ops=ops, outputs=outputs)


SIN = Op("{t} = torch.sin({a})", {"a": "x0"}, target="v1")
PLANTED = {
    "mismatch:value": (_program([SIN], ["v1"]), _planted(rewrite=_sin_to_cos)),
    "mismatch:dtype": (_program([SIN], ["v1"]), _planted(outputs=lambda o: o.double())),
    "mismatch:stride": (_program([SIN], ["v1"]), _planted(outputs=lambda o: o.t().contiguous().t())),
    "mismatch:shape": (_program([SIN], ["v1"]), _planted(outputs=lambda o: o[:2])),
    "mismatch:mutation": (
        _program([Op("{a}.mul_(3)", {"a": "x0"}, mutates="a"), Op("{t} = {a} + 1", {"a": "x0"}, target="v1")], ["v1"]),
        _planted(clone_inputs=True),
    ),
}


@pytest.mark.parametrize("cls", sorted(PLANTED))
def test_a_planted_bug_is_named_by_its_class(cls):
    program, backend = PLANTED[cls]
    assert run_programs([program], "cpp", "cpu", compiler=backend)[0]["class"] == cls
    assert run_programs([program], "cpp", "cpu", compiler="aot_eager")[0]["class"] == "pass"


# a mask's data-dependent size (1 here) meets an empty tensor: eager broadcasts, torch's trace
# asserts the size is 0
TORCH_FAILS = Program(
    inputs=[Input("x0", [1], "int32", seed=1), Input("x1", [0], "int32", seed=2),
            Input("x2", [1], "bool", seed=3, values="mask")],
    ops=[Op("{t} = {a}[{m}]", {"a": "x0", "m": "x2"}, target="v1"),
         Op("{t} = torch.remainder({a}, {b})", {"a": "x1", "b": "v1"}, target="v2")],
    outputs=["x0"])


@pytest.mark.ferrocore_only
def test_an_error_torch_raises_without_ferrocore_is_torchs():
    result = run_programs([TORCH_FAILS], "cpp", "cpu")[0]
    assert result["class"] == "torch:runtime_error", result
    assert is_failure("compile_error") and not is_failure(result["class"])


@pytest.mark.ferrocore_only
def test_a_batch_torch_fails_as_a_whole_is_checked_in_halves():
    # the whole graph raises as torch's pipeline does without ferrocore: torch's; the runner
    # then checks each program in a smaller graph (on the GPU, torch 2.11 fails some batches
    # only as a whole: a copy_ into a fresh tensor left in the functional graph)
    from fuzzer.runner import Totals, run_group

    fine = _program([SIN], ["v1"])
    assert [r["class"] for r in run_programs([TORCH_FAILS, fine], "cpp", "cpu")] == ["torch:runtime_error"] * 2

    class WholeBatchFails:  # a worker whose graph of all four programs torch fails
        def run(self, programs):
            cls = "torch:compile_error" if len(programs) == 4 else "pass"
            return {"results": [{"class": cls, "detail": "first call: AssertionError"} for _ in programs], "seconds": 0.0}

    programs = [Program.from_dict(dict(fine.to_dict(), ident=f"0:{i}")) for i in range(4)]
    results = run_group(WholeBatchFails(), programs)
    assert [r["class"] for r in results] == ["pass"] * 4
    totals = Totals()
    totals.add(programs, results)
    assert totals.passed() == 4 and len(totals.torch_batches) == 1 and not totals.failures


def test_a_crash_torch_makes_without_ferrocore_is_torchs():
    # a process crash inside torch's runtime (torch 2.11 on CUDA replays a view out of its
    # base's bounds and segfaults, as aot_eager does) is torch's when the same program under
    # torch's pipeline alone, in a fresh process, crashes alike
    from fuzzer.runner import Worker, WorkerDied, run_group

    class Crashing:
        def __init__(self, alike):
            self.alike = alike

        def run(self, programs):
            raise WorkerDied("crash", "worker died (SIGSEGV)")

        def crashes_alike(self, programs):
            return self.alike

    program = _program([SIN], ["v1"])
    assert [r["class"] for r in run_group(Crashing(True), [program])] == ["torch:crash"]
    assert [r["class"] for r in run_group(Crashing(False), [program])] == ["crash"]
    reference = Worker("cpp", "cpu", 1, 120.0, reference=True)  # torch's pipeline runs it
    try:
        assert not reference.crashes_alike([program])
        assert reference.run([program])["results"][0]["class"] == "pass"
    finally:
        reference.close()


def test_a_dtype_from_torchs_meta_function_is_a_documented_deviation():
    # bool ** True: the meta function says int64, the kernel keeps bool
    program = _program([Op("{t} = torch.pow({a}, True)", {"a": "x0"}, target="v1")], ["v1"], dtype="bool")
    meta_dtype = _planted(outputs=lambda o: o.to(torch.int64))
    assert run_programs([program], "cpp", "cpu", compiler=meta_dtype)[0]["class"] == "deviation:meta_dtype"


def test_cancelling_huge_terms_bound_the_rounding_by_their_magnitude():
    # float64 absorbs the small terms next to 2**63 as float32 does: any summation order is right
    ref = torch.tensor([0.0], dtype=torch.float64)
    eager, compiled = torch.tensor([0.0]), torch.tensor([-1.88])
    assert compare.explained_by_rounding(eager, compiled, ref) is None
    magnitude = torch.tensor([1.1e18], dtype=torch.float64)
    assert compare.explained_by_rounding(eager, compiled, ref, magnitude, 16) == "deviation:rounding"
    assert compare.explained_by_rounding(eager, compiled, ref, torch.tensor([20.0], dtype=torch.float64), 16) is None


def test_the_float64_reference_starts_from_the_values_eager_holds():
    # a float16 input's values are rounded before widening: the reference differs from eager by
    # the program's rounding, not the inputs' (atan of an unrounded input was a false mismatch)
    from fuzzer.check import Prepared, _widened

    program = _program([Op("{t} = torch.atan({a})", {"a": "x0"}, target="v1")], ["v1"], dtype="float16")
    widened = _widened(program)
    assert widened.inputs[0].dtype == "float64" and widened.inputs[0].rounded == "float16"
    eager_in = Prepared(program, "cpu").make_inputs("cpu")[0]
    assert torch.equal(Prepared(widened, "cpu").make_inputs("cpu")[0], eager_in.double())


def test_a_float64_result_of_float32_work_has_float32_tolerance():
    # three float32 atomic adds in another order, then .to(float64): one float32 ulp apart
    eager, compiled = torch.tensor([4.129880905151367], dtype=torch.float64), torch.tensor([4.129879951477051], dtype=torch.float64)
    ref = torch.tensor([4.1298809051513], dtype=torch.float64)
    assert compare.explained_by_rounding(eager, compiled, ref) is None
    assert compare.explained_by_rounding(eager, compiled, ref, precision=torch.float32) == "deviation:rounding"
    assert compare.explained_by_rounding(eager, compiled + 1e-3, ref, precision=torch.float32) is None


def test_rounding_deviations_need_eager_to_be_as_far_from_float64():
    ref = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    eager = torch.tensor([1.0, 2.1, 3.0])
    assert compare.explained_by_rounding(eager, torch.tensor([1.0, 1.8, 3.0]), ref) == "deviation:rounding"
    assert compare.explained_by_rounding(eager, torch.tensor([1.0, 2.5, 3.0]), ref) is None
    assert compare.explained_by_rounding(eager, torch.tensor([1.0, 2.1, 3.1]), ref) is None
    # a comparison flips only where eager itself disagrees with float64
    ref_b, eager_b = torch.tensor([True, False, True]), torch.tensor([True, True, True])
    assert compare.explained_by_rounding(eager_b, torch.tensor([True, False, True]), ref_b) == "deviation:rounding_sensitive"
    assert compare.explained_by_rounding(eager_b, torch.tensor([False, True, True]), ref_b) is None


def test_the_minimizer_shrinks_a_planted_failure_to_the_op_that_fails():
    base = next(p for p in (generate(CI_SEED, i) for i in range(100)) if len(p.ops) >= 5 and len(p.inputs) >= 2)
    planted = Program.from_dict(base.to_dict())
    planted.inputs.append(Input("x99", [5, 6], "float16", seed=7, layout="transposed"))
    planted.ops.insert(2, Op("{t} = torch.sin({a})", {"a": "x99"}, target="v99"))
    planted.ops.append(Op("{t} = {a} * 2", {"a": "v99"}, target="v100"))
    planted.outputs.append("v100")
    backend = _planted(rewrite=_sin_to_cos)
    fails = lambda p: run_programs([p], "cpp", "cpu", compiler=backend)[0]["class"] == "mismatch:value"
    assert fails(planted)
    small = minimize(planted, fails, max_checks=300)
    assert fails(small)
    assert [op.code for op in small.ops] == ["{t} = torch.sin({a})"], small.function_source()
    assert len(small.inputs) == 1 and small.outputs == ["v99"]
    assert small.inputs[0].layout == "contiguous" and sum(small.inputs[0].shape) <= len(small.inputs[0].shape) + 1
    assert "torch.sin(x" in small.repro()


def test_a_batch_only_failure_keeps_the_fewest_partners_and_runs_as_one_script():
    programs = [generate(CI_SEED, i) for i in range(3)]
    kept, checks = fewest_partners(programs[1:], lambda ps: programs[2] in ps)
    assert kept == [programs[2]] and checks <= 2
    script = batch_repro(programs[:2])
    assert f"# fuzz programs {programs[0].ident}, {programs[1].ident}" in script
    torch._dynamo.reset()
    exec(compile(script, "<batch repro>", "exec"), {})  # compiles both as one graph and compares


# ------------------------------------------------------------------------------------------------
# Short runs (the long ones: bench/fuzz.py --count 10000).


def _short_run(backend: str, count: int):
    programs = (generate(CI_SEED, i) for i in range(count))
    totals = run_fuzz(programs, backend=backend, device="cpu", jobs=2, batch=16, timeout=600)
    failures = [f"{p.ident} {r['class']}: {r['detail'][:600]}\n{p.function_source()}" for p, r in totals.failures]
    assert totals.programs == count
    assert not failures, "\n".join(failures)
    assert totals.classes["pass"] >= count * 0.9, totals.classes


def test_a_spent_time_budget_starts_no_batch():
    programs = [generate(0, i) for i in range(40)]
    totals = run_fuzz(iter(programs), backend="cpp", device="cpu", jobs=2, batch=16, budget=0.0)
    assert (totals.programs, totals.skipped, totals.last) == (0, 40, -1)


def test_short_run_cpp_backend():
    _short_run("cpp", CPP_COUNT)


def test_short_run_triton_backend_under_the_interpreter():
    pytest.importorskip("triton")
    _short_run("triton", TRITON_COUNT)
