"""The front learns what a compiled graph is from the compiled graph (`ferrocore.artifact`, the
value Rust returns), never from its wrapper module: no marker cut out of generated text, no
module-level flag read, no kernel text recovered from a code object."""

from __future__ import annotations

import re
from pathlib import Path

FRONT = Path(__file__).resolve().parent.parent / "python" / "ferrocore"

# what reading the generated module instead of the compiled graph looks like
FORBIDDEN = {
    "a module-level name read by getattr": re.compile(r"getattr\(\s*\w*mod\w*\s*,\s*['\"][A-Z_]{3,}['\"]"),
    "an attribute in capitals read off a module": re.compile(r"\bmod(?:ule)?\.[A-Z][A-Z_]{2,}\b"),
    "a flag the module once set": re.compile(r"\b(?:KERNEL_SOURCE|TRITON_KERNELS|TRITON_LAUNCHERS|CUDAGRAPH_UNSAFE|"
                                             r"INDEX_FLAG|DONATED_WRITES)\b"),
    "a marker in generated text": re.compile(r"unit boundary|ferrocore: (?:end of )?Triton kernels"),
    "kernel text from a code object": re.compile(r"co_firstlineno|co_positions"),
    "a search in a module's source": re.compile(r"module_source\s*\.\s*(?:find|index|split|partition)\("),
}


def test_the_front_reads_nothing_out_of_generated_modules():
    found = []
    for path in sorted(FRONT.glob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for what, pattern in FORBIDDEN.items():
                if pattern.search(line):
                    found.append(f"{path.name}:{number}: {what}: {line.strip()}")
    assert not found, "\n".join(found)


def test_the_check_finds_what_it_forbids():
    # each pattern matches the code this replaced (a check that matches nothing proves nothing)
    old = [
        'getattr(module, "INDEX_FLAG", False)',
        "len(module.TRITON_KERNELS)",
        '_CPP_UNIT_MARK = "// ferrocore: unit boundary\\n"',
        "if lines and last >= code.co_firstlineno:",
        "start = module_source.find(TRITON_UNIT_BEGIN)",
    ]
    for line in old:
        assert any(p.search(line) for p in FORBIDDEN.values()), line
