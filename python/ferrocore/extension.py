"""The Rust extension, `ferrocore._ferrocore`, as the rest of the front reaches it.

Each call into Rust looks the extension up at the call, as the package's `_ferrocore` attribute
(`extension()`): the package imports it (`ferrocore/__init__.py`), and a test may put a stand-in
there (tests/test_front.py). Without a built extension, importing ferrocore still works; the
first call into Rust (serializing a graph is one: the dtype table is the compiler's) raises an
ImportError that says how to build it.
"""

from __future__ import annotations

import sys

try:
    from . import _ferrocore  # noqa: F401 - (the package's attribute from now on)

    _UNAVAILABLE: ImportError | None = None
except ImportError as e:  # not built
    _UNAVAILABLE = e

# ferrocore itself: imported before any of its modules
_package = sys.modules[__package__]


def extension():
    """The extension module, or the stand-in a test put in its place."""
    try:
        return _package._ferrocore
    except AttributeError:
        raise ImportError(
            f"ferrocore's Rust extension cannot be imported ({_UNAVAILABLE}); "
            "build it with `bash scripts/setup.sh` or `maturin develop --release`"
        ) from _UNAVAILABLE
