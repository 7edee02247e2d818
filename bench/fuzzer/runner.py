"""Worker processes, batches, attribution of a batch's failure to its programs, totals.

A batch of programs is compiled as one graph in a worker process. A program that fails inside
a batch is run again alone, and a failure of the whole batch (compile error, crash, timeout,
graph fallback) is bisected, so that every failure is attributed to one program; one that
passes alone is `batch_only:<class>` (an interaction between programs in one graph).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .program import Program

BENCH = Path(__file__).resolve().parent.parent
# classes that say nothing about one program of a batch: the batch is bisected
BATCH_WIDE = ("compile_error", "runtime_error", "dynamo", "crash", "timeout", "graph_fallback", "harness_error")
OK = ("pass", "invalid")
# not ferrocore's failures: documented deviations, and failures torch's own pipeline makes
# without ferrocore (check._torch_fails_alike)
EXCUSED = ("deviation:", "torch:")


def is_failure(cls: str) -> bool:
    return cls not in OK and cls != "graph_fallback" and not cls.startswith(EXCUSED)


class WorkerDied(Exception):
    def __init__(self, cls: str, detail: str):
        super().__init__(detail)
        self.cls, self.detail = cls, detail


class Worker:
    """One worker process, restarted after a crash or a timeout."""

    def __init__(self, backend: str, device: str, threads: int, timeout: float, reference: bool = False):
        self.spec = (backend, device, threads)
        self.args = ["--backend", backend, "--device", device, "--threads", str(threads)]
        if reference:
            self.args.append("--reference")
        self.timeout = timeout
        self.proc = None
        self.log = None
        self.reference = None  # a worker running torch's pipeline without ferrocore (`crashes_alike`)

    def _start(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(BENCH), env.get("PYTHONPATH", "")])
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-m", "fuzzer.worker", *self.args], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)

    def run(self, programs: list) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        request = json.dumps({"programs": [p.to_dict() for p in programs]}) + "\n"
        try:
            self.proc.stdin.write(request)
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout * len(programs) ** 0.5)
        line = self.proc.stdout.readline() if ready else ""
        if line:
            reply = json.loads(line)
            if reply.get("restart"):  # the worker's device broke; it exits
                self.proc.wait(timeout=60)
                self.proc = None
            return reply
        return self._died(bool(ready))

    def _died(self, exited: bool):
        if not exited:
            self.proc.kill()
        code = self.proc.wait()
        self.log.seek(0)
        tail = self.log.read()[-2500:].decode(errors="replace")
        self.proc = None
        if not exited:
            raise WorkerDied("timeout", f"no result after {self.timeout:.0f} s\n{tail}")
        name = signal.Signals(-code).name if code < 0 else f"exit status {code}"
        raise WorkerDied("crash", f"worker died ({name})\n{tail}")

    def crashes_alike(self, programs: list) -> bool:
        """Whether torch's pipeline without ferrocore (check._torch_reference) crashes the process
        on `programs` too: a crash inside torch's own code is torch's."""
        if self.reference is None:
            self.reference = Worker(*self.spec, self.timeout, reference=True)
        try:
            self.reference.run(programs)
        except WorkerDied as died:
            return died.cls == "crash"
        return False

    def close(self) -> None:
        if self.reference is not None:
            self.reference.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def run_group(worker: Worker, programs: list) -> list:
    """Results per program, each failure attributed to one program (see the module doc)."""
    try:
        reply = worker.run(programs)
        results, seconds = reply["results"], reply["seconds"]
    except WorkerDied as died:
        results, seconds = [{"class": died.cls, "detail": died.detail}] * len(programs), 0.0
    for r in results:
        r.setdefault("fallback_ops", [])
        r["seconds"] = seconds / len(programs)
    if len(programs) == 1:
        if results[0]["class"] == "crash" and worker.crashes_alike(programs):
            results = [dict(results[0], **{"class": "torch:crash"})]
        return results
    wide = [r for r in results if r["class"] in BATCH_WIDE or r["class"].startswith("torch:")]
    if wide:
        half = len(programs) // 2
        parts = run_group(worker, programs[:half]) + run_group(worker, programs[half:])
        if all(r["class"] in OK for r in parts):  # only the whole batch fails
            if wide[0]["class"].startswith("torch:"):
                # torch's own pipeline fails this graph alike: its programs, each checked in
                # a smaller graph, keep those results, and the batch is counted
                parts[0] = dict(parts[0], torch_batch=wide[0]["detail"])
                return parts
            return [dict(wide[0], **{"class": f"batch_only:{wide[0]['class']}"}) for _ in programs]
        return parts
    alone = {k: run_group(worker, [programs[k]])[0] for k, r in enumerate(results) if r["class"] not in OK}
    return _mark(results, [alone.get(k, r) for k, r in enumerate(results)])


def _mark(batch: list, alone: list) -> list:
    """A program that failed in the batch but passes alone: `batch_only:<class>`."""
    out = []
    for b, a in zip(batch, alone):
        if b["class"] not in OK and a["class"] == "pass" and b["class"] not in BATCH_WIDE:
            a = dict(b, **{"class": f"batch_only:{b['class']}"})
        out.append(a)
    return out


class Totals:
    def __init__(self):
        self.programs = 0
        self.ops = 0
        self.classes: Counter = Counter()
        self.fallback_ops: Counter = Counter()
        self.graph_fallbacks: Counter = Counter()  # reason -> programs
        self.failures: list = []  # (program, result)
        self.excused: list = []  # (program, result) of the EXCUSED classes
        self.seconds = 0.0
        self.skipped = 0  # programs not run: the time budget ran out first
        self.torch_batches: list = []  # (program, detail) of batches torch's pipeline fails as a whole
        self.last = -1  # the highest program index run
        self.lock = threading.Lock()

    def add(self, programs: list, results: list) -> None:
        with self.lock:
            for p, r in zip(programs, results):
                self.programs += 1
                self.last = max(self.last, int(p.ident.split(":")[1]))
                self.ops += len(p.ops)
                self.classes[r["class"]] += 1
                self.fallback_ops.update(r.get("fallback_ops") or [])
                if r.get("torch_batch"):
                    self.torch_batches.append((p, r["torch_batch"]))
                if r["class"] == "graph_fallback":  # coverage lost, not a wrong result
                    self.graph_fallbacks[r["detail"][:200]] += 1
                elif is_failure(r["class"]):
                    self.failures.append((p, r))
                elif r["class"].startswith(EXCUSED):
                    self.excused.append((p, r))

    def passed(self) -> int:
        return self.classes["pass"]


def run_fuzz(programs_iter, *, backend: str, device: str, jobs: int, batch: int, threads: int = 1,
             timeout: float = 300.0, progress=None, budget: float | None = None) -> Totals:
    """Runs every program (an iterable of Program) in batches over `jobs` workers. `budget`:
    seconds after which no new batch starts (the batches running finish)."""
    totals = Totals()
    local = threading.local()
    workers: list = []
    start = time.perf_counter()

    def work(group: list) -> None:
        if budget is not None and time.perf_counter() - start > budget:
            with totals.lock:
                totals.skipped += len(group)
            return
        if not hasattr(local, "worker"):
            local.worker = Worker(backend, device, threads, timeout)
            workers.append(local.worker)
        totals.add(group, run_group(local.worker, group))
        if progress:
            progress(totals)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(work, g) for g in _chunks(programs_iter, batch)]
        for f in futures:
            f.result()
    for w in workers:
        w.close()
    totals.seconds = time.perf_counter() - start
    return totals


def _chunks(it, n: int):
    group = []
    for p in it:
        group.append(p)
        if len(group) == n:
            yield group
            group = []
    if group:
        yield group


def check_one(worker: Worker, program: Program) -> dict:
    return run_group(worker, [program])[0]
