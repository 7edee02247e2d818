#!/usr/bin/env bash
# Builds ferrocore (see setup.sh) and runs the demo.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$REPO/scripts/setup.sh"
cd "$REPO"
exec .venv/bin/python examples/demo.py "$@"
