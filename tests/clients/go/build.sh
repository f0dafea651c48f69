#!/usr/bin/env bash
# Build the Go driver into $1 with the client pinned in go.mod/go.sum (the Go module and build caches
# stay in their defaults, outside the repo).
set -euo pipefail
out=$1
here=$(cd "$(dirname "$0")" && pwd)
(cd "$here" && go build -mod=readonly -o "$out/driver" .)
printf '["%s"]\n' "$out/driver" > "$out/argv.json"
