"""The Python front's own imports: `python/ferrocore` imports its modules at module level only,
and their graph has no cycle (issue 46, item 4). Read from the source with `ast`; nothing is
imported.

What these checks caught on the code before the modules were layered (commit 643475a):
`test_no_function_imports_a_ferrocore_module` listed 25 imports of ferrocore modules inside
functions (in backend, cache, compile_worker, graph_cache, joint_split, kernel_binaries and
runtime), and `test_the_graph_with_function_level_imports_has_no_cycle` the two circles they
dodged:

- ferrocore.backend -> ferrocore.cudagraphs -> ferrocore.backend (`is_dense`), one circle with
  ferrocore.backend -> ferrocore.joint_split -> ferrocore.backend (`_extension`);
- ferrocore.graph_cache -> ferrocore.runtime -> ferrocore.kernel_binaries -> ferrocore.graph_cache
  (`read_cached_json`, `write_cached_json`, `versions`), with kernel_binaries -> runtime.

(The module-level graph alone had no cycle then: the imports inside functions hid them.)

`test_no_function_imports_anything` holds every other import to module level too (stdlib, torch,
Triton): 45 sat inside functions before. Triton, optional, is imported in one module,
`runtime/triton_support`, and nowhere else (`test_only_triton_support_imports_triton`).

The modules are layered (`LAYERS`): entry -> tracing -> dynamic-shape dispatch -> static compile
-> runtime, above the shared modules every layer uses; a module imports its own layer and those
below, never one above (`test_no_module_imports_a_layer_above_its_own`), and every module is in
one layer (`test_every_module_is_in_a_layer`).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = "ferrocore"
FRONT = Path(__file__).resolve().parent.parent / "python" / PACKAGE

# (file, function, module imported): the imports of ferrocore modules allowed inside a function,
# each for a reason written where it is
LAZY = {
    # importing ferrocore must not import torch (the package's docstring); the backend does
    ("__init__.py", "compile_graph", "ferrocore.backend"),
}


def _module_name(filename: str) -> str:
    """`runtime/cache.py` -> `ferrocore.runtime.cache`; a package's `__init__.py` is the package."""
    parts = filename.removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([PACKAGE, *parts])


def _targets(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool, modules: set) -> list:
    """The ferrocore modules an import statement in module `importer` imports (relative imports
    resolved; `from package import name` is the module `package.name` when there is one)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name == PACKAGE or a.name.startswith(PACKAGE + ".")]
    if node.level:
        # a module's package is its name less the last part; a package's own __init__ is the package
        package = importer if is_package else importer.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{node.module}" if node.module else package
    else:
        base = node.module or ""
    if base != PACKAGE and not base.startswith(PACKAGE + "."):
        return []
    found = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
    return found or [base]


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def imports(sources: dict) -> list:
    """(importer, module imported, file, line, the function it is in or None) for every import of
    a ferrocore module in `sources` (file path under python/ferrocore -> text). Imports under `if
    TYPE_CHECKING:` are never run and are left out."""
    modules = {_module_name(f) for f in sources} | {f"{PACKAGE}._ferrocore"}  # (the extension)
    found = []

    def walk(node: ast.AST, filename: str, importer: str, function: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            if _is_type_checking(child):
                for sub in child.orelse:
                    walk(ast.Module(body=[sub], type_ignores=[]), filename, importer, function)
                continue
            inner = function
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = child.name if function is None else f"{function}.{child.name}"
            elif isinstance(child, ast.Lambda):
                inner = "<lambda>" if function is None else function
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for target in _targets(child, importer, filename.endswith("__init__.py"), modules):
                    found.append((importer, target, filename, child.lineno, function))
            walk(child, filename, importer, inner)

    for filename, text in sorted(sources.items()):
        walk(ast.parse(text, filename), filename, _module_name(filename), None)
    return found


def _graph(edges: list) -> dict:
    graph: dict = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    return graph


def circles(edges: list) -> list:
    """The strongly connected parts of the graph `edges` (pairs importer -> imported) that hold
    a cycle: sets of modules each of which imports, through the others, every other one."""
    graph = _graph(edges)
    index: dict = {}
    low: dict = {}
    stack: list = []
    on_stack: set = set()
    parts: list = []

    def connect(v) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                part.add(w)
                if w == v:
                    break
            if len(part) > 1 or v in graph[v]:
                parts.append(part)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return parts


def cycles(edges: list) -> list:
    """One cycle (a list of modules, the first repeated at the end) through each of `circles`."""
    graph = _graph(edges)
    found = []
    for part in circles(edges):
        start = min(part)
        # the shortest way back to `start` inside the part
        paths = {start: [start]}
        queue = [start]
        while queue:
            v = queue.pop(0)
            for w in sorted(graph[v] & part):
                if w == start:
                    queue = []
                    found.append(paths[v] + [start])
                    break
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    queue.append(w)
    return sorted(found)


def _front() -> dict:
    """The front's sources: path under python/ferrocore (`runtime/cache.py`) -> text."""
    return {p.relative_to(FRONT).as_posix(): p.read_text() for p in sorted(FRONT.rglob("*.py"))}


def _describe(found: list, edges: list) -> str:
    """Each cycle, and every import inside the circle it belongs to."""
    lines = []
    for cycle in found:
        lines.append(" -> ".join(cycle))
        members = next(part for part in circles(edges) if cycle[0] in part)
        lines += [f"    {a} imports {b}" for a, b in sorted(set(edges)) if a in members and b in members]
    return "\n".join(lines)


def test_the_module_level_import_graph_has_no_cycle():
    edges = [(a, b) for a, b, _, _, function in imports(_front()) if function is None]
    found = cycles(edges)
    assert not found, f"import cycles among ferrocore's modules:\n{_describe(found, edges)}"


def test_no_function_imports_a_ferrocore_module():
    found = [f"python/ferrocore/{filename}:{line}: in {function}(): imports {target}"
             for _, target, filename, line, function in imports(_front())
             if function is not None and (filename, function, target) not in LAZY]
    assert not found, ("ferrocore modules imported inside functions (import them at the top of the "
                       "module; a cycle that forces this means a shared piece belongs lower):\n" + "\n".join(found))


def test_the_graph_with_function_level_imports_has_no_cycle():
    # an allowed lazy import closes no circle either
    edges = [(a, b) for a, b, *_ in imports(_front())]
    found = cycles(edges)
    assert not found, f"import cycles among ferrocore's modules:\n{_describe(found, edges)}"


def test_the_check_finds_what_it_forbids():
    # the shapes of the imports this replaced (a check that finds nothing proves nothing)
    old = {
        "__init__.py": "from .metrics import metrics\n",
        "backend.py": "import torch\nfrom . import joint_split, runtime\n"
                      "def _compile():\n    from . import cudagraphs  # (it imports this module)\n",
        "cudagraphs.py": "from . import artifact\nfrom .backend import is_dense\n",
        "joint_split.py": "def _saved_values():\n    from . import backend\n",
        "runtime.py": "def bind_binary():\n    from . import kernel_binaries\n"
                      "def read_cached_json():\n    from . import _ferrocore\n",
        "kernel_binaries.py": "def key():\n    from .graph_cache import versions\n"
                              "def load():\n    from .runtime import read_cached_json\n",
        "graph_cache.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import backend\n"
                          "def load():\n    import ferrocore.runtime as r\n",
        "compile_worker.py": "def compile_kernel():\n    from ferrocore.kernel_binaries import describe\n"
                             "    import triton\n",
        "artifact.py": "", "metrics.py": "",
    }
    found = imports(old)
    lazy = {(filename, line, function, target) for _, target, filename, line, function in found if function}
    assert lazy == {
        ("backend.py", 4, "_compile", "ferrocore.cudagraphs"),
        ("joint_split.py", 2, "_saved_values", "ferrocore.backend"),
        ("runtime.py", 2, "bind_binary", "ferrocore.kernel_binaries"),
        ("runtime.py", 4, "read_cached_json", "ferrocore._ferrocore"),
        ("kernel_binaries.py", 2, "key", "ferrocore.graph_cache"),
        ("kernel_binaries.py", 4, "load", "ferrocore.runtime"),
        ("graph_cache.py", 5, "load", "ferrocore.runtime"),
        ("compile_worker.py", 2, "compile_kernel", "ferrocore.kernel_binaries"),
    }, lazy
    assert cycles([(a, b) for a, b, _, _, function in found if function is None]) == []
    assert cycles([(a, b) for a, b, *_ in found]) == [
        ["ferrocore.backend", "ferrocore.cudagraphs", "ferrocore.backend"],
        ["ferrocore.graph_cache", "ferrocore.runtime", "ferrocore.kernel_binaries", "ferrocore.graph_cache"],
    ]
    # an import under `if TYPE_CHECKING:` is never run
    assert ("ferrocore.graph_cache", "ferrocore.backend") not in {(a, b) for a, b, *_ in found}


# (file, function): the only functions that may import anything; the package's lazy backend
FUNCTION_IMPORTS = {(filename, function) for filename, function, _ in LAZY}


def function_imports(sources: dict) -> list:
    """(file, line, function, statement) for every import statement inside a function (those
    under `if TYPE_CHECKING:` included: they are never run, but nothing here needs one)."""
    found = []
    for filename, text in sorted(sources.items()):
        for fn in ast.walk(ast.parse(text, filename)):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    if isinstance(node, (ast.Import, ast.ImportFrom)):
                        found.append((filename, node.lineno, fn.name, ast.unparse(node)))
    return found


def test_no_function_imports_anything():
    found = [f"python/ferrocore/{filename}:{line}: in {function}(): {statement}"
             for filename, line, function, statement in function_imports(_front())
             if (filename, function) not in FUNCTION_IMPORTS]
    assert not found, "imports inside functions (import at the top of the module):\n" + "\n".join(found)


def _imports_triton(node: ast.AST) -> bool:
    if isinstance(node, ast.Import):
        return any(a.name.split(".")[0] == "triton" for a in node.names)
    return isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "triton"


def test_only_triton_support_imports_triton():
    found = [f"python/ferrocore/{filename}:{node.lineno}: {ast.unparse(node)}"
             for filename, text in _front().items() if filename != "runtime/triton_support.py"
             for node in ast.walk(ast.parse(text, filename)) if _imports_triton(node)]
    assert not found, "Triton imported outside runtime/triton_support.py:\n" + "\n".join(found)


def test_the_function_import_check_finds_what_it_forbids():
    old = {"metrics.py": "import itertools\ndef seconds():\n    import sys\n",
           "runtime.py": "class A:\n    def key(self):\n        import triton\n",
           "__init__.py": "def compile_graph():\n    from .backend import compile_graph\n"}
    assert function_imports(old) == [("__init__.py", 2, "compile_graph", "from .backend import compile_graph"),
                                     ("metrics.py", 3, "seconds", "import sys"),
                                     ("runtime.py", 3, "key", "import triton")]
    assert not any(_imports_triton(n) for n in ast.walk(ast.parse(old["metrics.py"])))
    assert any(_imports_triton(n) for n in ast.walk(ast.parse(old["runtime.py"])))


# The front's layers, lowest first: each may import its own and those below it, never one above.
# Modules by name under python/ferrocore ("" is the package itself; "runtime.*" every module of
# the runtime package).
LAYERS = (
    # what every layer uses: the extension, options and logs, names, metrics, layouts, the
    # exchange format's encoder, the compiled graph read as data, the progress line
    ("shared", ("_ferrocore", "extension", "options", "torch_logs", "graph_names", "metrics", "progress", "strides",
                "serialize", "artifact")),
    # loading, launching, caching and running compiled graphs
    ("runtime", ("runtime", "runtime.*")),
    # one graph of static sizes (one CompileRequest), prepared and compiled by Rust, then loaded
    ("compile", ("static_compile", "prepare", "padding", "gemm_choice", "conv_layout")),
    # graphs with data-dependent or symbolic sizes, cut or specialized into static compiles
    ("dispatch", ("dispatch", "partition")),
    # Dynamo's graph to ATen graphs: the direct trace or AOT autograd, the joint split
    ("tracing", ("tracing", "decompositions", "direct_trace", "traced_attention", "attention_hook", "fake_calls",
                 "joint_split", "foreach")),
    # the Dynamo backend: modes, options, the compiled-graph cache's lookup
    ("entry", ("", "backend")),
)


def layer(module: str, layers: tuple = LAYERS) -> int | None:
    """The position in `layers` of ferrocore module `module` (a dotted name), or None."""
    name = module.removeprefix(PACKAGE).removeprefix(".")
    for i, (_, members) in enumerate(layers):
        for member in members:
            if name == member or (member.endswith(".*") and name.startswith(member[:-1])):
                return i
    return None


def breaches(edges: list, layers: tuple = LAYERS) -> list:
    """"importer (layer) imports imported (layer)" for each import of a module from a layer above
    the importer's."""
    found = []
    for a, b in sorted(set(edges)):
        la, lb = layer(a, layers), layer(b, layers)
        if la is not None and lb is not None and lb > la:
            found.append(f"{a} ({layers[la][0]}) imports {b} ({layers[lb][0]})")
    return found


def test_every_module_is_in_a_layer():
    modules = {_module_name(f) for f in _front()}
    missing = sorted(m for m in modules if layer(m) is None)
    assert not missing, f"modules in no layer of LAYERS (tests/test_front_imports.py): {missing}"


def test_no_module_imports_a_layer_above_its_own():
    # imports inside functions count too: a lazy import is still a dependency
    found = breaches([(a, b) for a, b, *_ in imports(_front())])
    assert not found, "imports from a layer above the importer's:\n" + "\n".join(found)


def test_the_layer_check_finds_what_it_forbids():
    layers = (("shared", ("metrics",)), ("runtime", ("runtime", "runtime.*")), ("compile", ("static_compile",)),
              ("tracing", ("tracing",)), ("entry", ("", "backend")))
    assert [layer(m, layers) for m in ("ferrocore", "ferrocore.runtime", "ferrocore.runtime.cache",
                                        "ferrocore.runtime_x", "ferrocore.metrics")] == [4, 1, 1, None, 0]
    wrong = {
        "runtime/__init__.py": "",
        "runtime/report.py": "from .. import metrics\nfrom ..static_compile import CompileRequest\n",
        "runtime/cache.py": "def trim():\n    from ferrocore import backend\n",
        "static_compile.py": "from .runtime import cache\nfrom .tracing import decompositions\n",
        "tracing.py": "from . import static_compile\nfrom .backend import _collector_spared\n",
        "backend.py": "from . import tracing\nfrom .runtime import report\n",
        "metrics.py": "import ferrocore.runtime\n",
        "__init__.py": "from .metrics import metrics\n",
    }
    assert breaches([(a, b) for a, b, *_ in imports(wrong)], layers) == [
        "ferrocore.metrics (shared) imports ferrocore.runtime (runtime)",
        "ferrocore.runtime.cache (runtime) imports ferrocore.backend (entry)",
        "ferrocore.runtime.report (runtime) imports ferrocore.static_compile (compile)",
        "ferrocore.static_compile (compile) imports ferrocore.tracing (tracing)",
        "ferrocore.tracing (tracing) imports ferrocore.backend (entry)",
    ]


def test_the_compile_worker_imports_no_torch():
    # the worker processes start while the parent traces: torch would cost them seconds each
    code = "import sys, ferrocore.runtime.compile_worker; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out
