#!/bin/sh
# The compat worker behind --no-python: proves it ran as a shell script by writing its own
# marker, then runs tests/scripts/compat_worker.py with $COMPAT_PYTHON.
set -e
echo "shell $0 rank=$RANK" > "$COMPAT_OUT/shell-rank$RANK.txt"
exec "$COMPAT_PYTHON" "$(dirname "$0")/compat_worker.py" "$@"
