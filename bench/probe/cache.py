"""Probe: can the cache be trusted? Each check runs in fresh processes against a fresh cache
directory, as a warm start would: a planted kernel library that carries its own checksum, an
edited and a truncated wrapper module, the file modes under `umask 000`, eight processes
compiling the same graphs at once. `python bench/probe/cache.py` prints the lines `run()`
returns; `--rss N` also measures the memory kept by N distinct graphs compiled and dropped.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# A child process: compiles `f` with ferrocore, checks it against eager, prints OK.
CHILD = """
import sys, torch
import ferrocore
def f(x):
    return torch.sin(x) * {scale} + 1
x = torch.arange(16, dtype=torch.float32)
got = torch.compile(f, backend="ferrocore")(x)
assert torch.allclose(got, f(x)), (got, f(x))
print("OK", ferrocore.metrics.last["module_path"])
"""


def _env(cache: Path) -> dict:
    env = dict(os.environ, FERROCORE_CACHE_DIR=str(cache))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "python"), env.get("PYTHONPATH")) if p)
    env.pop("FERROCORE_LOGS", None)
    return env


def _child(cache: Path, scale: int = 2, prelude: str = "") -> subprocess.CompletedProcess:
    code = prelude + CHILD.format(scale=scale)
    return subprocess.run([sys.executable, "-c", code], env=_env(cache), capture_output=True, text=True,
                          timeout=300)


def _ok(r: subprocess.CompletedProcess) -> bool:
    return r.returncode == 0 and r.stdout.startswith("OK")


def _why(r: subprocess.CompletedProcess) -> str:
    lines = (r.stderr or r.stdout).strip().splitlines()
    errors = [line for line in lines if "Error" in line or "error" in line]
    return (errors or lines or [f"exit {r.returncode}"])[-1][:160]


def _outcome(rebuilt: bool, again: subprocess.CompletedProcess) -> str:
    """How the run after a tampering went: the entry rebuilt or not, the result right or not."""
    result = "correct" if _ok(again) else "WRONG: " + _why(again)
    return f"{'rebuilt' if rebuilt else 'NOT rebuilt'}; result {result}"


def _libraries(cache: Path) -> list:
    return sorted(p for p in cache.rglob("*.so") if not p.name.startswith("."))


def planted_library(tmp: Path) -> str:
    cache = tmp / "planted"
    first = _child(cache)
    if not _ok(first):
        return f"planted library: setup failed: {_why(first)}"
    marker = tmp / "planted-ran"
    src = tmp / "planted.cpp"
    src.write_text(f'#include <cstdio>\n__attribute__((constructor)) static void planted() {{ '
                   f'FILE* f = std::fopen("{marker}", "w"); if (f) {{ std::fputs("ran", f); std::fclose(f); }} }}\n')
    evil = tmp / "planted.so"
    subprocess.run(["g++", "-shared", "-fPIC", "-o", str(evil), str(src)], check=True)
    data = evil.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    for lib in _libraries(cache):
        lib.write_bytes(data)
        # its own checksum, in the old cache's format and in the place of the manifest
        Path(str(lib) + ".sha256").write_text(digest)
        Path(str(lib) + ".hmac").write_text(digest)
    again = _child(cache)
    ran = marker.exists()
    rebuilt = all(lib.read_bytes() != data for lib in _libraries(cache))
    verdict = "not loaded" if not ran else "LOADED (its constructor ran)"
    return f"planted library with its own sha256: {verdict}; {_outcome(rebuilt, again)}"


def edited_wrapper(tmp: Path) -> str:
    cache = tmp / "edited"
    first = _child(cache)
    if not _ok(first):
        return f"edited wrapper: setup failed: {_why(first)}"
    module = Path(first.stdout.split()[1])
    marker = tmp / "wrapper-ran"
    honest = module.read_text()
    module.write_text(f"open({str(marker)!r}, 'w').write('ran')\n" + honest)
    again = _child(cache)
    ran = marker.exists()
    rebuilt = module.read_text() == honest
    return f"edited wrapper module: planted code {'RAN' if ran else 'not run'}; {_outcome(rebuilt, again)}"


def truncated_wrapper(tmp: Path) -> str:
    cache = tmp / "truncated"
    first = _child(cache)
    if not _ok(first):
        return f"truncated wrapper: setup failed: {_why(first)}"
    module = Path(first.stdout.split()[1])
    honest = module.read_text()
    module.write_text(honest[: len(honest) // 2])
    results = [_child(cache) for _ in range(2)]
    rebuilt = module.read_text() == honest
    ok = sum(_ok(r) for r in results)
    return (f"truncated wrapper module: {'rebuilt' if rebuilt else 'NOT rebuilt'}; "
            f"{ok}/2 later runs succeed" + ("" if ok == 2 else f" ({_why(results[-1])})"))


def umask_modes(tmp: Path) -> str:
    cache = tmp / "umask"
    r = _child(cache, prelude="import os\nos.umask(0)\n")
    if not _ok(r):
        return f"umask 000: compile failed: {_why(r)}"
    files, dirs = {}, {}
    for p in [cache, *cache.rglob("*")]:
        table = dirs if p.is_dir() else files
        mode = oct(p.lstat().st_mode & 0o777)
        table[mode] = table.get(mode, 0) + 1
    good = set(files) == {"0o600"} and set(dirs) == {"0o700"}
    return f"umask 000: file modes {files}, directory modes {dirs}: {'private' if good else 'NOT PRIVATE'}"


def concurrent(tmp: Path, processes: int = 8) -> str:
    cache = tmp / "concurrent"
    out = []
    for phase in ("fresh", "warm"):
        code = "".join(CHILD.format(scale=s).replace("print(", "pass  # ") for s in (3, 4)) + CHILD.format(scale=5)
        procs = [subprocess.Popen([sys.executable, "-c", code], env=_env(cache), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(processes)]
        results = [p.communicate(timeout=600) + (p.returncode,) for p in procs]
        ok = sum(rc == 0 and so.startswith("OK") for so, _, rc in results)
        failure = next((se.strip().splitlines()[-1][:160] for so, se, rc in results if rc != 0 and se.strip()), "")
        out.append(f"{phase} cache {ok}/{processes} succeed" + (f" ({failure})" if failure else ""))
    return f"{processes} processes compiling the same 3 graphs into one cache: " + "; ".join(out)


def run() -> list[str]:
    with tempfile.TemporaryDirectory(prefix="ferrocore-probe-cache-") as d:
        tmp = Path(d)
        os.chmod(tmp, 0o700)
        lines = []
        for check in (planted_library, edited_wrapper, truncated_wrapper, umask_modes, concurrent):
            try:
                lines.append(check(tmp))
            except Exception as e:  # noqa: BLE001  (a probe reports, it does not stop)
                lines.append(f"{check.__name__}: probe error {type(e).__name__}: {e}")
        return ["cache: " + line for line in lines]


# Memory ferrocore itself keeps for graphs compiled and dropped: through `compile_graph`, since
# dynamo and AOT autograd keep about as much again of their own per graph (as `aot_eager` does).
RSS_CHILD = """
import gc, sys, torch
from torch.fx.experimental.proxy_tensor import make_fx
import ferrocore
def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
def compile_and_drop(n, offset):
    for i in range(n):
        c = float(i + offset)
        f = lambda x: (torch.sin(x * c) + c,)
        x = torch.randn(8)
        fn = ferrocore.compile_graph(make_fx(f)(x))
        assert torch.allclose(fn(x)[0], f(x)[0])
        del fn
compile_and_drop(5, 10000)  # warm-up: imports, first compile
gc.collect()
before = rss_mb()
compile_and_drop(N, 0)
gc.collect()
after = rss_mb()
maps = sum(1 for line in open("/proc/self/maps") if "/cpp/" in line or ".load-" in line)
modules = sum(1 for m in sys.modules if m.startswith("ferrocore_output_code"))
print(f"RSS {before:.0f} MB -> {after:.0f} MB (+{after - before:.1f} MB) after N distinct graphs compiled, run "
      f"and dropped; kernel library mappings left: {maps}; wrapper modules kept: {modules}")
"""


def rss_growth(graphs: int, cache: Path, python_dir: Path = REPO / "python") -> str:
    env = _env(cache)
    env["PYTHONPATH"] = str(python_dir)
    r = subprocess.run([sys.executable, "-c", RSS_CHILD.replace("N", str(graphs))], env=env,
                       capture_output=True, text=True, timeout=3600)
    return r.stdout.strip() if r.returncode == 0 else f"rss probe failed: {_why(r)}"


if __name__ == "__main__":
    for line in run():
        print(line)
    if "--rss" in sys.argv:
        n = int(sys.argv[sys.argv.index("--rss") + 1])
        with tempfile.TemporaryDirectory(prefix="ferrocore-probe-rss-") as d:
            os.chmod(d, 0o700)
            print("cache: " + rss_growth(n, Path(d) / "cache"))
