#!/usr/bin/env bash
# Sets everything up, then draws 64 samples of a code prompt on the default model and prints the
# best few by mean log-probability with a stats line.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/forklm sample -n 64 --max-tokens 96 --temperature 0.8 --top-p 0.95 --seed 0 --show 3 \
  'def fibonacci(n):
    """Return the n-th Fibonacci number."""
'
