#!/usr/bin/env bash
# Scores the summarizer on the report with planted facts (examples/data/tidal-barrier-review.md):
# for the default settings and for each setting changed alone, one line with the facts recalled,
# the numbers and names invented, and the time.
#
# Usage:
#   scripts/summary-facts.sh                      # the default settings and the variants below
#   scripts/summary-facts.sh --chunk-tokens 128   # the default settings with these options only
#
# Runs on the CPU with the default model (fetched on first use), one variant after the other.
set -euo pipefail
cd "$(dirname "$0")/.."

cargo build --release -p summarize
binary="${CARGO_TARGET_DIR:-target}/release/summarize"
document=examples/data/tidal-barrier-review.md
facts=examples/data/tidal-barrier-review.facts.json

# One variant: its options, then the summarizer's statistics line.
score() {
  local stats
  # A failing variant shows its error line instead.
  stats=$("$binary" "$document" --facts "$facts" --device cpu --json "$@" 2>&1 >/dev/null | tail -n1) || true
  printf '%-28s %s\n' "${*:-defaults}" "$stats"
}

if [ "$#" -gt 0 ]; then
  score "$@"
  exit 0
fi
score
score --keep-ungrounded
score --reduce summarize
score --max-new-tokens 200
score --max-new-tokens 300
score --chunk-tokens 128
score --chunk-tokens 256
score --chunk-tokens 1024
score --select-tokens 0
