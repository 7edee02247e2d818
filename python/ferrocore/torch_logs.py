"""torch's debugging switches, applied to ferrocore's output.

- `TORCH_LOGS` / `torch._logging.set_logs`: the artifacts Inductor has of the same meaning
  (`output_code`, `fusion`, ...) turn on ferrocore's channels of those names. The `ferrocore`
  component (torch takes any importable module's name) turns on the channels a user should
  see without asking for code (`TORCH_LOGS=ferrocore`), or every channel (`+ferrocore`).
- `TORCH_COMPILE_DEBUG=1`: the stage dumps go into torch's debug folder for the run
  (`torch_compile_debug/run_.../ferrocore/`), unless a debug_dir is set.
- `TORCH_TRACE`: each compiled graph's imported graph, loop IR, fusion decisions and module are
  structured-trace artifacts (`ferrocore_<graph>_<stage>`), which tlparse lists under the
  compile that made them.
"""

from __future__ import annotations

import logging
import os

from torch._dynamo import config as dynamo_config
from torch._dynamo.utils import get_debug_dir

try:
    from torch._logging import _internal, trace_structured
except ImportError:  # a torch without structured logging: no artifacts turned on, no trace
    _internal = trace_structured = None

# ferrocore's channels that torch's logging names too
ARTIFACTS = ("output_code", "fusion", "ir_pre_fusion", "ir_post_fusion", "recompiles")
# `TORCH_LOGS=ferrocore` (INFO): what went wrong or was redone, no code
INFO_CHANNELS = ("fallback", "recompiles", "graph_cache")
# what a structured trace records of each graph (the channels that produce it)
TRACED = ("graph", "ir_pre_fusion", "fusion", "ir_post_fusion", "output_code")


def channels() -> list:
    """The ferrocore channels torch's logging turns on now; "all" for `+ferrocore`."""
    log_state = getattr(_internal, "log_state", None)
    if log_state is None:
        return []
    level = logging.getLogger("ferrocore").level  # NOTSET (0) unless someone set it
    if level and level <= logging.DEBUG:
        return ["all"]
    enabled = getattr(log_state, "is_artifact_enabled", None)
    on = [c for c in ARTIFACTS if enabled is not None and enabled(c)]
    if level and level <= logging.INFO:
        on += [c for c in INFO_CHANNELS if c not in on]
    return on


# torch's debug root -> this process's run folder in it (torch names a new one at each call)
_run_dirs: dict = {}


def compile_debug_dir() -> str | None:
    """Where TORCH_COMPILE_DEBUG=1 puts ferrocore's dumps: `<run>/ferrocore` in torch's debug
    folder (`torch._dynamo.config.debug_dir_root`), one run folder per process; None when off."""
    if os.environ.get("TORCH_COMPILE_DEBUG", "0") != "1":
        return None
    run = _run_dirs.setdefault(dynamo_config.debug_dir_root, get_debug_dir())
    return os.path.join(run, "ferrocore")


def tracing() -> bool:
    """Whether torch's structured trace is written (TORCH_TRACE, or TORCH_COMPILE_DEBUG's tlparse
    folder). Only torch's own trace handler counts: its lazy form without a folder drops itself at
    the first record, and pytest's capture handlers sit on every logger."""
    if _internal is None:
        return False
    handler = getattr(_internal, "LOG_TRACE_HANDLER", None)
    return (handler is not None and handler in _internal.trace_log.handlers
            and (getattr(handler, "root_dir", None) is not None or getattr(handler, "stream", None) is not None))


def trace_graph(name: str, module_path: str, logs, note: str | None = None) -> None:
    """Records graph `name`'s stages (`logs`: the compile's channel texts) as structured-trace
    artifacts, one per stage, and where its module was written; `note` (a cache hit's) as
    `ferrocore_<name>_graph_cache`."""
    def artifact(what: str, text: str) -> None:
        trace_structured("artifact", metadata_fn=lambda: {"name": f"ferrocore_{name}_{what}", "encoding": "string"},
                         payload_fn=lambda: text)

    texts: dict = {}
    for log in logs:
        if log["channel"] in TRACED:
            texts[log["channel"]] = texts.get(log["channel"], "") + log["text"]
    for channel in TRACED:
        if channel in texts:
            artifact(channel, texts[channel])
    if module_path:
        artifact("module_path", module_path + "\n")
    if note:
        artifact("graph_cache", note + "\n")
