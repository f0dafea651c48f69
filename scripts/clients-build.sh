#!/usr/bin/env bash
# Build the official-client drivers of tests/clients (see tests/clients/README.md).
#
# Each language folder tests/clients/<lang>/ holds a build.sh that takes an output directory, builds the
# driver there with the official client at the version it pins, and writes <out>/argv.json (the command
# that starts the driver, a JSON list). Outputs live OUTSIDE the repo, keyed by a hash of the driver's
# sources, in ${LMQ_CLIENTS_CACHE:-$HOME/.cache/lmq-clients}/<lang>-<hash>/; Maven, Go and npm keep their
# own download caches (~/.m2, the Go module cache, ~/.npm). The repo only gets build/clients/<lang>.json,
# a copy of the argv the suite reads. Python needs no build: the venv already has the official client.
#
# A build that fails fails this script (and `make test`): a client that cannot install is a CI failure,
# never a skipped suite.
#
# Usage: scripts/clients-build.sh [lang ...]     (default: python java go node mqtt-java)
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cache=${LMQ_CLIENTS_CACHE:-$HOME/.cache/lmq-clients}
pointers=$root/build/clients
python=${PYTHON:-$root/.venv/bin/python}
mkdir -p "$cache" "$pointers"

sources_hash() {  # every tracked-or-not source file of a driver folder, not its build leftovers
  (cd "$1" && find . -type f ! -path './node_modules/*' ! -path './target/*' ! -name '*.pyc' -print0 \
    | sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16)
}

for lang in ${@:-python java go node mqtt-java}; do
  src=$root/tests/clients/$lang
  [[ -d $src ]] || { echo "clients: no driver folder $src" >&2; exit 1; }
  if [[ $lang == python ]]; then
    printf '["%s", "%s"]\n' "$python" "$src/driver.py" > "$pointers/python.json"
    continue
  fi
  out=$cache/$lang-$(sources_hash "$src")
  if [[ ! -f $out/.built ]]; then
    echo "clients: building the $lang driver into $out"
    rm -rf "$out" && mkdir -p "$out"
    start=$SECONDS
    bash "$src/build.sh" "$out"
    [[ -s $out/argv.json ]] || { echo "clients: $lang build wrote no argv.json" >&2; exit 1; }
    touch "$out/.built"
    echo "clients: $lang driver built in $((SECONDS - start)) s"
  fi
  cp "$out/argv.json" "$pointers/$lang.json"
done
