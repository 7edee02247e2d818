"""The progress line of long compiles: drawn only when asked (or on a terminal), after a delay,
naming the graph, its stage and the parts done; silent in tests by default."""

import io
import time

import pytest
import torch

import ferrocore
from ferrocore import _ferrocore, options, progress


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_silent_unless_asked_or_on_a_terminal():
    assert progress.start("g", "auto", stream=io.StringIO()) is progress.SILENT
    assert progress.start("g", "off", stream=FakeTerminal()) is progress.SILENT
    on = progress.start("g", "on", stream=io.StringIO(), delay=60)
    assert on is not progress.SILENT
    on.close()


def test_nothing_is_drawn_before_the_delay():
    out = io.StringIO()
    r = progress.start("graph 0/0", "on", stream=out, delay=60)
    r.stage("Triton kernels", 3)
    r.close()
    assert out.getvalue() == ""


def test_a_line_per_stage_off_a_terminal_and_a_closing_line():
    out = io.StringIO()
    r = progress.start("graph 0/0", "on", stream=out, delay=0)
    time.sleep(progress.REFRESH_S * 2)
    r.stage("Triton kernels", 3)
    r.advance()
    time.sleep(progress.REFRESH_S * 2)
    r.advance()
    time.sleep(progress.REFRESH_S * 2)
    r.close()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("[ferrocore] compiling graph 0/0: AOT autograd (")
    assert any(line.startswith("[ferrocore] compiling graph 0/0: Triton kernels 1/3 (") for line in lines), lines
    assert any(line.startswith("[ferrocore] compiling graph 0/0: Triton kernels 2/3 (") for line in lines), lines
    assert len(lines) == 4, lines  # one line per change, however long each stage lasts
    assert lines[-1].startswith("[ferrocore] compiled graph 0/0 in ") and lines[-1].endswith(" s")


def test_a_terminal_line_is_redrawn_in_place():
    out = FakeTerminal()
    r = progress.start("graph 1/0", "on", stream=out, delay=0)
    time.sleep(progress.REFRESH_S * 3)
    r.close()
    text = out.getvalue()
    assert text.count("\r[ferrocore] compiling graph 1/0: AOT autograd") >= 2
    assert text.endswith("\x1b[K\n") and "\r[ferrocore] compiled graph 1/0 in " in text


def test_rust_stages_and_cpp_units_are_read_from_the_compile(tmp_path, monkeypatch):
    # the line of a real compile, with the delay at zero: it sees the Rust stages
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    monkeypatch.setattr(progress, "REFRESH_S", 0.005)
    seen = []
    original = progress.Reporter.line

    def spy(self):
        text = original(self)
        seen.append(text)
        return text

    monkeypatch.setattr(progress.Reporter, "line", spy)
    # on the CPU whatever the suite's device: the C++ compile's units are what is counted
    layers = [torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.LayerNorm(32)) for _ in range(8)]
    model = torch.nn.Sequential(*layers).eval().to("cpu")
    x = torch.randn(4, 32, device="cpu")
    compiled = torch.compile(model, backend="ferrocore", options={"progress": "on", "graph_cache": False,
                                                                  "cache_dir": str(tmp_path)})
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    stages = {line.split(": ", 1)[1].rsplit(" (", 1)[0] for line in seen}
    assert "AOT autograd" in stages, stages
    assert any(s.startswith("C++ compile of ") for s in stages), stages


def test_a_compile_inside_another_continues_its_line():
    with progress.compiling("graph 0/0", "on") as outer:
        with progress.compiling("graph 0/0 (backward)", "on") as inner:
            assert inner is outer is progress.current()
    assert progress.current() is progress.SILENT


def test_the_native_progress_counts():
    p = _ferrocore.CompileProgress()
    assert p.snapshot() == ("", 0, 0)


def test_progress_option_values():
    assert options.build_options({"progress": True})["progress"] == "on"
    assert options.build_options({"progress": "0"})["progress"] == "off"
    assert options.build_options({})["progress"] == "off"  # conftest: off in tests
    with pytest.raises(ValueError, match="FERROCORE_PROGRESS='sometimes'"):
        options.build_options({"progress": "sometimes"})
