"""A compile worker of `kernel_binaries.CompilePool`: `python -m ferrocore.runtime.compile_worker`.

Reads jobs from stdin and writes results to the pipe that was stdout (each a little-endian
8-byte length, then a pickle); stdout itself goes to stderr, so nothing a library prints can
garble a result. The first message, once the worker has warmed up, is ("ready", None). A job
("compile", Triton unit, kernel name, signature, constexprs, num_warps, num_stages, arch, warp
size) runs the compiled graph's Triton unit (`artifact.unit_source`, cached by its hash;
it imports no torch) and compiles the kernel with Triton for that GPU target, without touching
the GPU; the result is `triton_support.describe` of the compiled kernel. The worker exits when
stdin closes.
"""

from __future__ import annotations

import hashlib
import linecache
import os
import pickle
import struct
import sys
import types

from .triton_support import describe, jit_function, triton, triton_options


def compile_kernel(message: tuple, modules: dict) -> dict:
    _, source, name, signature, constexprs, num_warps, num_stages, arch, warp_size = message
    fn = jit_function(_module(source, modules)[name])
    target = triton.backends.compiler.GPUTarget("cuda", arch, warp_size)
    backend = triton.compiler.make_backend(target)
    names = list(fn.arg_names)
    full_signature = {n: signature.get(n, "constexpr") for n in names}
    constants = {(names.index(k),): v for k, v in constexprs.items()}
    aligned = backend.parse_attr("D")  # 16-byte aligned buffers, as the JIT specializes them
    attrs = {(i,): aligned for i, n in enumerate(names) if full_signature[n].startswith("*")}
    compiled = triton.compiler.compile(triton.compiler.ASTSource(fn, full_signature, constants, attrs), target=target,
                              options={"num_warps": num_warps, "num_stages": num_stages, **triton_options()})
    return describe(compiled, len(signature))


def _module(source: str, modules: dict) -> dict:
    """The globals of the Triton unit `source` (run once per distinct source)."""
    digest = hashlib.sha256(source.encode()).hexdigest()
    if digest not in modules:
        path = f"<ferrocore wrapper {digest[:16]}>"
        linecache.cache[path] = (len(source), None, source.splitlines(True), path)  # Triton reads it
        module = types.ModuleType(f"ferrocore_worker_{digest[:16]}")
        module.__file__ = path
        sys.modules[module.__name__] = module
        exec(compile(source, path, "exec"), module.__dict__)
        modules[digest] = module.__dict__
    return modules[digest]


def _warm_up() -> None:
    """What every compile needs, done while the parent is still tracing (the imports: with this
    module's, through `triton_support`)."""
    triton.runtime.cache.triton_key()  # hashes Triton's installation once
    arch = os.environ.get("FERROCORE_COMPILE_ARCH")
    if arch:  # a first compile loads the backend's libraries and asks ptxas its version
        compile_kernel(("compile", _WARM_UP_SOURCE, "ferrocore_warm_up", {"out": "*fp32"}, {"XBLOCK": 128}, 4, 1,
                        int(arch), 32), {})


_WARM_UP_SOURCE = """
import triton
import triton.language as tl


@triton.jit
def ferrocore_warm_up(out, XBLOCK: tl.constexpr):
    i = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)
    tl.store(out + i, i.to(tl.float32))
"""


def main() -> int:
    results = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    jobs = sys.stdin.buffer
    try:
        _warm_up()
    except Exception:  # noqa: BLE001 - each job then reports what is missing
        pass
    modules: dict = {}
    _send(results, ("ready", None))
    while True:
        head = jobs.read(8)
        if len(head) < 8:
            return 0
        message = pickle.loads(jobs.read(struct.unpack("<Q", head)[0]))
        try:
            reply = ("ok", compile_kernel(message, modules))
        except BaseException as e:  # noqa: BLE001 - reported to the parent, which compiles it itself
            reply = ("error", f"{type(e).__name__}: {str(e)[:2000]}")
        _send(results, reply)


def _send(results, reply: tuple) -> None:
    data = pickle.dumps(reply)
    results.write(struct.pack("<Q", len(data)) + data)
    results.flush()


if __name__ == "__main__":
    sys.exit(main())
