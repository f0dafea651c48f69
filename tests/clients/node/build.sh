#!/usr/bin/env bash
# Build the Node driver into $1: the pinned rocketmq-client-nodejs from package-lock.json (npm ci, npm's
# own download cache in ~/.npm) beside driver.js. Install scripts are not run: the client ships compiled.
set -euo pipefail
out=$1
here=$(cd "$(dirname "$0")" && pwd)
cp "$here/package.json" "$here/package-lock.json" "$here/driver.js" "$out/"
(cd "$out" && npm ci --no-audit --no-fund --ignore-scripts --loglevel=error)
printf '["%s", "%s"]\n' "$(command -v node)" "$out/driver.js" > "$out/argv.json"
