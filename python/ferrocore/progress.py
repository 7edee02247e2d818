"""A progress line for compiles that take longer than a couple of seconds.

`compiling(label, mode)` reports one Dynamo graph's compile (`current()` inside it): the backend
tells it the stage it enters (AOT autograd, the Rust stages through `watch`, Triton kernels with
`stage(name, total)` and `advance`), and a daemon thread draws one line on stderr once `DELAY_S`
have passed:

    [ferrocore] compiling model.forward: C++ compile of 94 kernels in 2 units 1/2 (2.4 s)

On a terminal the line is redrawn in place; elsewhere (mode "on" with stderr redirected) each
new stage is one line. It ends with the compile's total time. Mode "auto" (the default) draws
only on a terminal, so tests and logs see nothing; "off" never draws.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import threading
import time

DELAY_S = 2.0
REFRESH_S = 0.25
MODES = ("auto", "on", "off")


class Reporter:
    def __init__(self, label: str, stream, in_place: bool, delay: float):
        self.label = label
        self._stream = stream
        self._in_place = in_place
        self._delay = delay
        self._start = time.perf_counter()
        self._stage = ("AOT autograd", 0, 0)
        self._native = None  # a `_ferrocore.CompileProgress` the Rust stages fill in
        self._drawn = ""
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ferrocore-progress", daemon=True)
        self._thread.start()

    def stage(self, name: str, total: int = 0) -> None:
        with self._lock:
            self._native = None
            self._stage = (name, 0, total)

    def advance(self) -> None:
        with self._lock:
            name, done, total = self._stage
            self._stage = (name, done + 1, total)

    def watch(self, native) -> None:
        """Reads the stage from `native` (a `_ferrocore.CompileProgress`) until the next `stage`."""
        with self._lock:
            self._native = native

    def line(self) -> str:
        with self._lock:
            name, done, total = self._native.snapshot() if self._native is not None else self._stage
        count = f" {min(done, total)}/{total}" if total else ""
        return f"[ferrocore] compiling {self.label}: {name}{count} ({time.perf_counter() - self._start:.1f} s)"

    def close(self) -> None:
        self._done.set()
        self._thread.join()
        if self._drawn:
            elapsed = time.perf_counter() - self._start
            self._write(f"[ferrocore] compiled {self.label} in {elapsed:.1f} s", final=True)

    def _run(self) -> None:
        if self._done.wait(self._delay):
            return
        while not self._done.is_set():
            text = self.line()
            # off a terminal, a line per stage (not per tick of its clock)
            if self._in_place or text.rsplit(" (", 1)[0] != self._drawn.rsplit(" (", 1)[0]:
                self._write(text)
            self._done.wait(REFRESH_S)

    def _write(self, text: str, final: bool = False) -> None:
        try:
            if self._in_place:
                self._stream.write("\r" + text + "\x1b[K" + ("\n" if final else ""))
            else:
                self._stream.write(text + "\n")
            self._stream.flush()
        except (OSError, ValueError):  # a closed stream: the line is not worth an error
            pass
        self._drawn = text


class _Silent:
    """The reporter of a compile that draws nothing."""

    label = ""

    def stage(self, name: str, total: int = 0) -> None:
        pass

    def advance(self) -> None:
        pass

    def watch(self, native) -> None:
        pass

    def close(self) -> None:
        pass


SILENT = _Silent()
_current: contextvars.ContextVar = contextvars.ContextVar("ferrocore_progress", default=SILENT)


def current():
    """The reporter of the compile in progress here (`SILENT` outside one)."""
    return _current.get()


@contextlib.contextmanager
def compiling(label: str, mode: str):
    """Reports the compile run inside this block (see `start`); ends its line at the exit. Inside
    another compile's block (AOT autograd compiling a backward with its forward), that one's line
    goes on."""
    if _current.get() is not SILENT:
        yield _current.get()
        return
    reporter = start(label, mode)
    token = _current.set(reporter)
    try:
        yield reporter
    finally:
        _current.reset(token)
        reporter.close()


def start(label: str, mode: str, stream=None, delay: float | None = None):
    """A reporter for one compile (`SILENT` when `mode` says not to draw); it draws once
    `delay` (default `DELAY_S`) has passed."""
    stream = stream if stream is not None else sys.stderr
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        tty = False
    if mode == "off" or (mode == "auto" and not tty):
        return SILENT
    return Reporter(label, stream, in_place=tty, delay=DELAY_S if delay is None else delay)
