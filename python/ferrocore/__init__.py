"""ferrocore: a deep-learning compiler in Rust, used as `torch.compile(model, backend="ferrocore")`.

Importing this package stays cheap (no torch import): the backend is registered through the
`torch_dynamo_backends` entry point and loaded by dynamo on first use.
"""

from __future__ import annotations

from importlib import metadata as _metadata

from .metrics import metrics

try:
    from ._ferrocore import FerrocoreError
except ImportError:  # extension not built: serialization still works, compiling says what to do

    class FerrocoreError(RuntimeError):
        """Raised by ferrocore's Rust core on malformed input or an internal bug."""


try:
    __version__ = _metadata.version("ferrocore")
except _metadata.PackageNotFoundError:  # running from a source checkout
    __version__ = "0+unknown"


def compile_graph(gm, example_inputs=None, options=None):
    """Compiles an ATen-level `torch.fx.GraphModule` (e.g. from `make_fx`) without dynamo.

    Returns `f(*args) -> list of outputs`. See `ferrocore.backend.compile_graph`.
    """
    # imported at the call, the one import of a ferrocore module inside a function: the backend
    # imports torch, and importing this package must not (tests/test_front_imports.py allows it)
    from .backend import compile_graph as _compile_graph

    return _compile_graph(gm, example_inputs, options)


__all__ = ["FerrocoreError", "compile_graph", "metrics", "__version__"]
