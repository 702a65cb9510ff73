# Shared helpers for hack/ scripts. Source it; do not run it.
set -euo pipefail

HACK_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_ROOT=$(cd "$HACK_DIR/.." && pwd)
# shellcheck source=versions.env
source "$HACK_DIR/versions.env"

export GOWORK=off
export GOFLAGS=${GOFLAGS:--buildvcs=false}
export CGO_ENABLED=0

SAVEPOINT_CACHE=${SAVEPOINT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/savepoint}
BIN_CACHE="$SAVEPOINT_CACHE/bin"

log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

# Path of a cached binary: $BIN_CACHE/<name>-<version>/<name>
cached_bin() { printf '%s/%s-%s/%s' "$BIN_CACHE" "$1" "$2" "$1"; }
