#!/bin/sh
# On the device H200, from the repository root, while `zerod run` serves there:
#   gpu/top_screenshot.sh [SOCKET]        (default /run/zerod/control.sock)
# Installs the carried wheels (.whl/, see docs/tui.md) into /tmp/site unless textual is
# importable already, then captures the dashboard into $OUT.
set -e
cd "$(dirname "$0")/.."
if ! python3 -c 'import textual' 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    export PYTHONPATH
fi
exec python3 gpu/top_screenshot.py "${1:-/run/zerod/control.sock}" --out "${OUT:-.}"
