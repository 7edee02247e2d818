"""The on-disk cache can be trusted and does not grow a process without bound: entries that do
not verify are rebuilt and never run or loaded, the directory is private whatever the umask and
refused when others may write into it, graphs share identical kernels and release them when
dropped, and processes compiling into one cache at once all succeed."""

from __future__ import annotations

import gc
import hashlib
import itertools
import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import ferrocore
from ferrocore import dispatch, graph_names, options, static_compile
from ferrocore.runtime import cache as runtime_cache
from ferrocore.runtime import cpp_library

pytestmark = pytest.mark.cpu_only("the C++ kernel cache")


def _f(x):
    return (torch.sin(x) * 3 + 1,)


X = torch.arange(16, dtype=torch.float32)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("FERROCORE_CACHE_DIR", str(d))
    monkeypatch.setattr(graph_names, "_counter", itertools.count())
    return d


def _compile(f=_f):
    """The graph's boxed call (its `__globals__` are the wrapper module's), named as in a fresh
    process (the name is part of the wrapper's text and file name)."""
    graph_names._counter = itertools.count()
    return dispatch.compile_request(static_compile.CompileRequest(make_fx(f)(X), {}, {}))


def _check(call, f=_f):
    torch.testing.assert_close(call([X.clone()])[0], f(X)[0])


def _entries(cache: Path, pattern: str) -> list:
    return sorted(p for p in cache.rglob(pattern) if not p.name.startswith("."))


def test_edited_wrapper_is_rebuilt_and_its_code_never_runs(cache, tmp_path):
    _check(_compile())
    module = Path(ferrocore.metrics.last["module_path"])
    honest = module.read_text()
    marker = tmp_path / "planted-ran"
    module.write_text(f"open({str(marker)!r}, 'w').write('ran')\n" + honest)
    _check(_compile())
    assert not marker.exists(), "code planted in the cached wrapper ran"
    assert module.read_text() == honest


def test_truncated_wrapper_is_rebuilt(cache):
    _check(_compile())
    module = Path(ferrocore.metrics.last["module_path"])
    honest = module.read_text()
    module.write_text(honest[: len(honest) // 2])
    _check(_compile())
    assert module.read_text() == honest


def test_planted_library_with_its_own_checksum_is_rebuilt_not_loaded(cache, tmp_path):
    call = _compile()
    _check(call)
    del call
    gc.collect()
    marker = tmp_path / "constructor-ran"
    src = tmp_path / "planted.cpp"
    src.write_text(f'#include <cstdio>\n__attribute__((constructor)) static void planted() {{ '
                   f'std::FILE* f = std::fopen("{marker}", "w"); if (f) std::fclose(f); }}\n')
    planted = tmp_path / "planted.so"
    subprocess.run(["g++", "-shared", "-fPIC", "-o", str(planted), str(src)], check=True)
    evil = planted.read_bytes()
    (lib,) = _entries(cache, "*.so")
    lib.write_bytes(evil)
    digest = hashlib.sha256(evil).hexdigest()
    Path(f"{lib}.sha256").write_text(digest)  # what the old cache checked
    Path(f"{lib}.hmac").write_text(digest)  # a manifest made without the key
    _check(_compile())
    assert not marker.exists(), "the planted library was loaded"
    assert ferrocore.metrics.last["cpp_cache_hit"] is False
    assert lib.read_bytes() != evil


def test_cache_files_are_private_under_umask_000(cache):
    saved = os.umask(0)
    try:
        _check(_compile())
        runtime_cache.write_cached_json(cache, "autotune/00/k.json", {"best": [1]})
    finally:
        os.umask(saved)
    files = {oct(p.stat().st_mode & 0o777) for p in cache.rglob("*") if p.is_file()}
    dirs = {oct(p.stat().st_mode & 0o777) for p in [cache, *cache.rglob("*")] if p.is_dir()}
    assert files == {"0o600"} and dirs == {"0o700"}, (files, dirs)


def test_cache_directory_others_may_write_is_refused(cache):
    _check(_compile())
    cache.chmod(0o770)
    with pytest.raises(ferrocore.FerrocoreError, match="refusing to use cache directory .* writable by group"):
        _compile()
    cache.chmod(0o700)
    (lib,) = _entries(cache, "*.so")
    lib.parent.chmod(0o777)  # e.g. made by an older ferrocore under umask 000
    with pytest.raises(ferrocore.FerrocoreError, match="refusing to use cache directory"):
        _compile()


def test_cache_of_an_older_ferrocore_is_rebuilt(cache):
    """No key, no manifests (and the old per-entry library directories): rebuilt, not loaded."""
    _check(_compile())
    (cache / "secret.key").unlink()
    for m in cache.rglob("*.hmac"):
        m.unlink()
    old = cache / "cpp" / "ab" / ("ab" + "0" * 62)
    old.mkdir(parents=True)
    (old / "kernels.so").write_bytes(b"\x7fELF old")
    (old / "kernels.so.sha256").write_text(hashlib.sha256(b"\x7fELF old").hexdigest())
    _check(_compile())
    assert ferrocore.metrics.last["cpp_cache_hit"] is False
    assert len(_entries(cache, "*.so.hmac")) == 1 and len(_entries(cache, "*.py.hmac")) == 1
    _check(_compile())
    assert ferrocore.metrics.last["cpp_cache_hit"] is True
    # eviction takes the unsigned leftovers first
    runtime_cache.evict(10**12, str(cache), stale_after_s=0)
    assert not old.exists()


def test_identical_kernels_share_one_library_released_with_its_last_graph(cache):
    first, second = _compile(), _compile()
    lib = first.__globals__["_lib"]
    assert second.__globals__["_lib"] is lib
    path = next(p for p, v in cpp_library._libraries.items() if v is lib)
    alive = weakref.ref(lib)
    del first, lib
    gc.collect()
    assert alive() is not None  # the second graph still calls into it
    _check(second)
    del second
    gc.collect()
    assert alive() is None and path not in cpp_library._libraries
    maps = Path("/proc/self/maps").read_text()
    assert Path(path).name not in maps and ".load-" not in maps


def test_signed_json_entries_reject_edits(cache):
    runtime_cache.write_cached_json(cache, "pad_mm/ab/k.json", {"plain_ms": 1.0})
    assert runtime_cache.read_cached_json(cache, "pad_mm/ab/k.json") == {"plain_ms": 1.0}
    entry = cache / "pad_mm" / "ab" / "k.json"
    entry.write_text(json.dumps({"plain_ms": 9.0}))
    assert runtime_cache.read_cached_json(cache, "pad_mm/ab/k.json") is None
    with pytest.raises(ferrocore.FerrocoreError, match="invalid cache entry name"):
        runtime_cache.write_cached_json(cache, "../k.json", {})


def test_eviction_keeps_loaded_graphs_working(cache):
    call = _compile()
    stats = runtime_cache.evict(0, str(cache))
    assert stats["removed_entries"] >= 3 and not _entries(cache, "*.so")
    _check(call)  # its library stays mapped
    _check(_compile())  # rebuilt


def test_evicting_everything_leaves_only_the_key(cache):
    # compiled-graph entries and module bytecode were neither counted nor removed: after
    # evict(0), 400 files stayed while the report said the cache was empty
    torch._dynamo.reset()
    f = torch.compile(lambda x, w: torch.nn.functional.conv2d(x, w).relu().sum(1), backend="ferrocore")
    f(torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3))
    files = [p.relative_to(cache) for p in cache.rglob("*") if p.is_file()]
    assert {"cpp", "graphs", "compiled", "bytecode"} <= {p.parts[0] for p in files if len(p.parts) > 1}, files
    stats = runtime_cache.evict(0, str(cache))
    assert [p.relative_to(cache) for p in cache.rglob("*") if p.is_file()] == [Path("secret.key")]
    assert stats["removed_bytes"] == stats["total_bytes"] > 0


READ_ONLY_CHILD = """
import torch, ferrocore
f = torch.compile(lambda x: (x.sin() + 1).sum(1), backend="ferrocore", options={"logs": "graph_cache"})
print(f(torch.ones(3, 4)).tolist())
"""


def test_a_warm_cache_on_a_read_only_file_system_is_used(cache):
    # loading a verified library made a file in the cache directory: on a read-only mount the
    # first call raised
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    # a read-only bind mount of the cache over itself, in a user and mount namespace of its own
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"no user and mount namespace here (unshare: {probe.stderr.strip()})")
    warm = subprocess.run([sys.executable, "-c", READ_ONLY_CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert warm.returncode == 0, warm.stderr
    script = (f"mount --bind {cache} {cache} && mount -o remount,bind,ro {cache} && "
              f"! touch {cache}/probe 2>/dev/null && exec {sys.executable} -c \"$0\"")
    ro = subprocess.run(["unshare", "-rm", "sh", "-c", script, READ_ONLY_CHILD], env=env, capture_output=True,
                        text=True, timeout=300)
    assert ro.returncode == 0, ro.stderr[-2000:]
    assert ro.stdout == warm.stdout and "hit" in ro.stderr, ro.stderr[-2000:]


def test_compiles_keep_the_cache_under_its_size_limit(cache, monkeypatch):
    monkeypatch.setattr(static_compile, "_cache_trimmer", runtime_cache.Trimmer(every=2))
    monkeypatch.setenv("FERROCORE_CACHE_MAX_BYTES", "unlimited")
    _check(_compile())
    assert _entries(cache, "*.so")
    monkeypatch.setenv("FERROCORE_CACHE_MAX_BYTES", "0")
    call = _compile(lambda x: (torch.cos(x) - 2,))  # the first trim of this cache: all of it goes
    assert not _entries(cache, "*.so")
    _check(call, lambda x: (torch.cos(x) - 2,))
    monkeypatch.setenv("FERROCORE_CACHE_MAX_BYTES", "lots")
    with pytest.raises(ValueError, match="FERROCORE_CACHE_MAX_BYTES"):
        options.build_options({})
    monkeypatch.setenv("FERROCORE_CACHE_MAX_BYTES", "-1")
    with pytest.raises(ValueError, match="FERROCORE_CACHE_MAX_BYTES"):
        options.build_options({})
    monkeypatch.delenv("FERROCORE_CACHE_MAX_BYTES")
    assert options.build_options({})["cache_max_bytes"] == options.DEFAULT_CACHE_MAX_BYTES


def test_default_cache_directory_is_per_user_and_the_same_in_rust(monkeypatch, tmp_path):
    from ferrocore import _ferrocore

    monkeypatch.delenv("FERROCORE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert options.default_cache_dir() == _ferrocore.default_cache_dir() == str(tmp_path / "xdg" / "ferrocore")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert options.default_cache_dir() == _ferrocore.default_cache_dir() == str(tmp_path / "home/.cache/ferrocore")
    monkeypatch.setenv("FERROCORE_CACHE_DIR", str(tmp_path / "mine"))
    assert options.default_cache_dir() == _ferrocore.default_cache_dir() == str(tmp_path / "mine")


CHILD = """
import sys, torch, torch._dynamo
from torch.fx.experimental.proxy_tensor import make_fx
import ferrocore
x = torch.arange(16, dtype=torch.float32)
for scale in (2, 3, 2):  # the third compile finds the first one's entries (warm)
    f = lambda t: (torch.cos(t) * scale - t,)
    (got,) = ferrocore.compile_graph(make_fx(f)(x))(x)
    assert torch.allclose(got, f(x)[0]), scale
print("OK")
"""


def test_eight_processes_compiling_the_same_graphs_into_one_cache(cache):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    procs = [subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(8)]
    results = [(p.communicate(timeout=600), p.returncode) for p in procs]
    failed = [err[-800:] for (out, err), rc in results if rc != 0 or not out.startswith("OK")]
    assert not failed, failed[0]
    assert len(_entries(cache, "*.so")) == 2 and len(_entries(cache, "*.so.hmac")) == 2
    assert not [p for p in cache.rglob(".*") if p.is_file()], "temporary files left behind"


def test_module_bytecode_is_cached_and_a_bad_entry_rebuilt(cache, monkeypatch):
    """A wrapper module's code object is compiled once, then read from the cache; an entry that
    does not verify is compiled again and rewritten."""
    compiles = []
    monkeypatch.setitem(static_compile.__dict__, "compile", lambda *a: compiles.append(a) or compile(*a))
    source = "x = 40 + 2\n"
    static_compile._module_code(source, "/graphs/m.py", str(cache))
    entries = list(Path(cache, "bytecode").rglob("*.marshal"))
    assert len(entries) == 1 and len(compiles) == 1
    namespace: dict = {}
    exec(static_compile._module_code(source, "/graphs/m.py", str(cache)), namespace)
    assert namespace["x"] == 42 and len(compiles) == 1  # read back, not compiled
    static_compile._module_code(source, "/graphs/other.py", str(cache))  # another file name: another entry
    assert len(compiles) == 2
    entries[0].write_bytes(b"\x00" * 8)  # edited behind the cache's back
    namespace = {}
    exec(static_compile._module_code(source, "/graphs/m.py", str(cache)), namespace)
    assert namespace["x"] == 42 and len(compiles) == 3
    exec(static_compile._module_code(source, "/graphs/m.py", str(cache)), namespace)
    assert len(compiles) == 3  # rewritten whole
