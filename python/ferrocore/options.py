"""The options JSON handed to Rust, built from the environment at each compile.

Env is read per call, not at import, so a test or notebook can change `FERROCORE_LOGS` between
compiles. `torch.compile(..., options={...})` overrides individual keys; an unknown key, or a
value of the wrong type, raises `OptionError` naming the key (as Inductor's options do).
"""

from __future__ import annotations

import functools
import json
import os
import warnings

try:
    from torch._dynamo.exc import ShortenTraceback
except ImportError:  # a torch without it: Dynamo wraps an OptionError like any other error
    ShortenTraceback = None

from . import torch_logs
from .extension import extension

# the front's own log channels, beside the compiler's (`log_channels`)
_FRONT_CHANNELS = ("graph_cache", "kernel_compile", "trace", "recompiles")
_PATH = (str, os.PathLike)
# each key `options=` may set, and the types it takes
_TYPES = {"cache_dir": _PATH, "logs": (str, list, tuple), "debug_dir": (*_PATH, type(None)), "cxx": (str,),
          "backend": (str,), "cudagraphs": (bool,), "autotune": (bool,), "conv_layout": (str,), "pad_mm": (str,),
          "gemm_template": (str,),
          "check_inputs": (bool,), "cache_max_bytes": (int, type(None)), "graph_cache": (bool,),
          "compile_workers": (int,), "progress": (str, bool), "direct_trace": (bool,), "cpp_jobs": (int,),
          # generate the module, leave its C++ uncompiled (Rust's option: a CPU training graph's
          # forward compiles its C++ on a thread; tests read generated code)
          "skip_native_compile": (bool,)}


class OptionError(ValueError):
    """An option set wrongly (an unknown key, a value of the wrong type or out of range); the
    message names the key."""


def through_dynamo(error: OptionError) -> OptionError:
    """`error` as Dynamo lets it out of a backend: Dynamo wraps what a backend raises in its
    BackendCompilerFailed, except errors of its own ShortenTraceback family, which it re-raises
    as they are; so `except OptionError` catches a wrong option at the compiled function's first
    call (torch.compile() hands a backend its options only then)."""
    cls = _option_error_through_dynamo()
    if cls is None or isinstance(error, cls):
        return error
    return cls(*error.args)


@functools.cache
def _option_error_through_dynamo():
    if ShortenTraceback is None:
        return None

    class OptionErrorThroughDynamo(OptionError, ShortenTraceback):
        def __init__(self, *args):
            ShortenTraceback.__init__(self, *args, first_useful_frame=None)

    return OptionErrorThroughDynamo


# The size the cache is trimmed to (least recently used entries first) by the compiles of a
# process: at its first compile and every CACHE_TRIM_EVERY compiles that write new entries.
DEFAULT_CACHE_MAX_BYTES = 10 << 30
# Choices among the compiler's options (`choices`): "backend": "auto" picks by the graph's device
# (CUDA -> Triton, CPU -> C++), "triton" on CPU tensors runs the Triton kernels under Triton's
# interpreter (set TRITON_INTERPRET=1); "conv_layout": the layout of convolution graphs'
# activations, "auto" (channels-last on a GPU), "channels_last", "contiguous" (eager's);
# "pad_mm": unaligned 16-bit GEMMs on padded operands, "measured" (those measured faster on the
# GPU), "always", "never"; "gemm_template": GEMMs of Triton graphs as matrix-product kernels
# whose pointwise readers fuse into them, "cached" (those an earlier "measured" compile found
# faster), "measured", "always", "never".


@functools.cache
def _schema() -> dict:
    """The compiler's options as Rust states them (`driver::option_schema`): defaults, choices,
    log channels."""
    return json.loads(extension().option_schema())


def log_channels() -> tuple:
    """Every log channel: the compiler's, then the front's."""
    return (*_schema()["log_channels"], *_FRONT_CHANNELS)


def choices(key: str) -> tuple:
    """The values compiler option `key` takes."""
    return tuple(_schema()["choices"][key])


def compiler_default(key: str):
    """The compiler's default for option `key`."""
    return _schema()["defaults"][key]


def build_options(overrides: dict | None = None) -> dict:
    debug_dir = os.environ.get("FERROCORE_DEBUG_DIR") or torch_logs.compile_debug_dir()
    opts = {
        "cache_dir": default_cache_dir(),
        "logs": parse_logs(os.environ.get("FERROCORE_LOGS", "")),
        "debug_dir": _abspath(debug_dir) if debug_dir else None,
        "cxx": os.environ.get("CXX") or compiler_default("cxx"),
        "backend": (os.environ.get("FERROCORE_BACKEND") or compiler_default("backend")).strip().lower(),
        # CUDA graphs for GPU graphs (mode="reduce-overhead"); read by the front only
        "cudagraphs": _flag(os.environ.get("FERROCORE_CUDAGRAPHS", "")),
        # time each Triton kernel's candidate configurations (mode="max-autotune"); front only
        "autotune": _flag(os.environ.get("FERROCORE_AUTOTUNE", "")),
        "conv_layout": (os.environ.get("FERROCORE_CONV_LAYOUT") or compiler_default("conv_layout")).strip().lower(),
        "pad_mm": (os.environ.get("FERROCORE_PAD_MM") or compiler_default("pad_mm")).strip().lower(),
        # GEMMs of a Triton graph as matrix-product kernels with their pointwise readers fused
        "gemm_template": (os.environ.get("FERROCORE_GEMM_TEMPLATE") or compiler_default("gemm_template")).strip().lower(),
        # compiled modules check their inputs' sizes, strides, dtypes and devices at each call
        # (measured: about 0.1 us per input); "0" turns the check off
        "check_inputs": _flag(os.environ["FERROCORE_CHECK_INPUTS"]) if os.environ.get("FERROCORE_CHECK_INPUTS")
        else compiler_default("check_inputs"),
        # bytes the cache is kept under ("unlimited": no trimming); front only
        "cache_max_bytes": _cache_limit(os.environ.get("FERROCORE_CACHE_MAX_BYTES", "")),
        # the compiled-graph cache (a warm start skips AOT autograd and compiling); front only
        "graph_cache": _flag(os.environ.get("FERROCORE_GRAPH_CACHE") or "1"),
        # processes compiling a GPU graph's Triton kernels (0: threads of this process); front only
        "compile_workers": _workers(os.environ.get("FERROCORE_COMPILE_WORKERS", "")),
        # a progress line for long compiles: "auto" (on a terminal), "on", "off"; front only
        "progress": os.environ.get("FERROCORE_PROGRESS", ""),
        # inference graphs traced to ATen in one pass where AOT autograd's machinery is not
        # needed (`direct_trace`); "0" sends every graph through AOT autograd; front only
        "direct_trace": _flag(os.environ.get("FERROCORE_DIRECT_TRACE") or "1"),
        # C++ translation units one graph's compile runs at once (0: one per CPU, at most 8); a
        # training graph's forward and backward compile side by side with half the CPUs each
        "cpp_jobs": int(os.environ.get("FERROCORE_CPP_JOBS") or compiler_default("cpp_jobs")),
    }
    for key, value in (overrides or {}).items():
        opts[key] = _checked(key, value)
    opts["logs"] += [c for c in parse_logs(",".join(torch_logs.channels())) if c not in opts["logs"]]
    opts["check_inputs"] = bool(opts["check_inputs"])
    if opts["debug_dir"] is not None:
        _writable_dir("debug_dir", opts["debug_dir"])
    opts["progress"] = _progress_mode(opts["progress"])
    for key in ("backend", "pad_mm", "conv_layout", "gemm_template"):
        allowed = choices(key)
        if opts[key] not in allowed:  # (from options= or the FERROCORE_ variable)
            raise OptionError(f"ferrocore option {key!r}: {opts[key]!r} is not one of {', '.join(allowed)}")
    return opts


def _checked(key: str, value):
    """An `options=` entry's value as the options hold it; raises OptionError naming the key."""
    expected = _TYPES.get(key)
    if expected is None:
        raise OptionError(f"ferrocore: unknown option {key!r}; the options are {', '.join(_TYPES)}")
    if not isinstance(value, expected) or (isinstance(value, bool) and bool not in expected):
        names = " or ".join("None" if t is type(None) else t.__name__ for t in expected)
        raise OptionError(f"ferrocore option {key!r}: expected {names}, got {type(value).__name__} {value!r}")
    if key == "logs":
        return parse_logs(value if isinstance(value, str) else ",".join(map(str, value)), option=True)
    if isinstance(value, os.PathLike) or (key in ("cache_dir", "debug_dir") and value is not None):
        return _abspath(os.fspath(value))
    if isinstance(value, int) and not isinstance(value, bool) and value < 0:
        raise OptionError(f"ferrocore option {key!r}: must be >= 0, got {value}")
    return value


def _writable_dir(key: str, path: str) -> None:
    """Makes `path` (0700) if it is missing; raises OptionError naming the key (and its
    variable) where it cannot be made or written into (the stage dumps would be lost without a
    word), or where it is not the current user's alone, as for the cache: another user's folder
    (or one others may write into) could hold links that send a compile's writes elsewhere."""
    where = f"ferrocore option {key!r} (FERROCORE_{key.upper()})"
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.stat(path)
    except OSError as e:
        raise OptionError(f"{where}: cannot make {path}: {e.strerror or e}") from None
    if st.st_uid != os.geteuid():
        raise OptionError(f"{where}: {path} is owned by uid {st.st_uid}, not by the current user "
                          f"(uid {os.geteuid()})")
    if st.st_mode & 0o022:
        raise OptionError(f"{where}: others may write into {path} (mode {st.st_mode & 0o7777:o}); "
                          "choose a folder of your own")
    if not os.access(path, os.W_OK | os.X_OK):
        raise OptionError(f"{where}: cannot write into {path}")


def _progress_mode(value) -> str:
    """The progress line's mode (`progress.MODES`) from FERROCORE_PROGRESS or the option: empty
    or "auto" (drawn when stderr is a terminal), "1"/"on"/"true", "0"/"off"/"false", a bool."""
    if isinstance(value, bool):
        return "on" if value else "off"
    text = str(value).strip().lower()
    if text in ("", "auto"):
        return "auto"
    if text in ("1", "on", "true", "yes"):
        return "on"
    if text in ("0", "off", "false", "no"):
        return "off"
    raise ValueError(f"FERROCORE_PROGRESS={value!r}: expected auto, on or off")


def _cache_limit(text: str) -> int | None:
    text = text.strip().lower()
    if not text:
        return DEFAULT_CACHE_MAX_BYTES
    if text == "unlimited":
        return None
    return _count("FERROCORE_CACHE_MAX_BYTES", text, "a number of bytes or 'unlimited'")


def _workers(text: str) -> int:
    text = text.strip()
    if not text:
        return min(16, max((os.cpu_count() or 1) - 1, 1))
    return _count("FERROCORE_COMPILE_WORKERS", text, "a number of processes")


def _count(variable: str, text: str, expected: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{variable}={text!r}: expected {expected}") from None
    if value < 0:
        raise ValueError(f"{variable}={value}: must be >= 0")
    return value


def default_cache_dir() -> str:
    """The cache directory as Rust's `runtime::default_cache_dir` chooses it (asked through the
    extension): one per user, never a shared one (`FERROCORE_CACHE_DIR`, else
    `$XDG_CACHE_HOME/ferrocore`, else `~/.cache/ferrocore`, else one in the temporary folder).
    Rust checks on every use that it is the user's and private."""
    return _abspath(extension().default_cache_dir())


def options_json(overrides: dict | None = None) -> str:
    return json.dumps(build_options(overrides))


_WARNED_CHANNELS: set = set()


def parse_logs(spec: str, option: bool = False) -> list:
    """`"graph, output_code"` -> `["graph", "output_code"]`; `all` names every channel. An
    unknown channel is a warning in FERROCORE_LOGS, an OptionError in `options=` (`option`)."""
    logs = []
    for name in spec.split(","):
        name = name.strip().lower().lstrip("+")  # TORCH_LOGS habit: "+name" means verbose
        if not name:
            continue
        channels = log_channels()
        if name == "all":
            return list(channels)
        if name not in channels and option:
            raise OptionError(f"ferrocore option 'logs': unknown channel {name!r}; the channels are "
                              f"{', '.join(channels)}")
        if name not in channels:
            # once per process: the variable is read again at every compile
            if name not in _WARNED_CHANNELS:
                _WARNED_CHANNELS.add(name)
                warnings.warn(f"FERROCORE_LOGS: unknown channel {name!r}; known: {channels}")
            continue
        if name not in logs:
            logs.append(name)
    return logs


def _flag(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "on")


def _abspath(path: str) -> str:
    # Rust may run the compiler from another cwd; hand it absolute paths.
    return os.path.abspath(os.path.expanduser(path))
