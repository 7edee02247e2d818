"""The hardening probe in one command: hostile names in every graph field (bench/probe/names.py)
and the cache's trust and concurrency checks (bench/probe/cache.py), each section's lines as its
`run()` returns them, then a summary line per section. Exit status 1 if any line reports an
outcome the probe exists to catch.

    .venv/bin/python bench/hardening_probe.py
"""

import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from probe import cache, names  # noqa: E402

# what a section's lines say of an outcome the probe exists to catch
_BAD = {
    names: re.compile(r"EXECUTED|WROTE OUTSIDE|STRING CHANGED"),
    cache: re.compile(r"NOT rebuilt|code RAN|WRONG|NOT PRIVATE|LOADED|failed|probe error|\b(?!8/8)\d+/8 succeed"),
}


def main() -> int:
    bad_total = 0
    for section in (names, cache):
        start = time.perf_counter()
        lines = section.run()
        bad = [line for line in lines if _BAD[section].search(line)]
        bad_total += len(bad)
        print(f"## {section.__name__}")
        print("\n".join(lines))
        print(f"## {section.__name__}: {len(lines)} lines, {len(bad)} bad, {time.perf_counter() - start:.1f} s\n")
    return 1 if bad_total else 0


if __name__ == "__main__":
    sys.exit(main())
