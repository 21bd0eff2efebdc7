#!/usr/bin/env bash
# Set up everything the test suite needs and run it (what CI runs).
#   bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The Web-UI tests drive Debian's Chromium through Playwright (Playwright's own browser
# download is not reachable offline).
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) || echo "chromium install failed"
  else
    echo "chromium is missing: sudo apt-get install -y chromium (the browser tests will fail)"
  fi
fi
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 GRADIO_ANALYTICS_ENABLED=False
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 "$@"
