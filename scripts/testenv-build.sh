#!/usr/bin/env bash
# Build a real kube-apiserver and etcd from Go modules for the operator's
# integration tests (no docker, no release-tarball downloads: only the Go
# module proxy is needed).
#
# Binaries land OUTSIDE the repo in
#   ${LMQ_TESTENV_DIR:-$HOME/.cache/lmq-testenv}/bin/{kube-apiserver,etcd}
# together with bin/VERSIONS ("kube-apiserver=vX etcd=vY").
#
# Idempotent: exits immediately when both binaries exist and report the
# versions pinned below. Bump a pin -> that binary is rebuilt.
# The Go module / build caches stay in the default GOPATH / GOCACHE (outside
# the repo), so rebuilds after a bump are much faster than the first build.
#
# Usage: scripts/testenv-build.sh [--force]
# Cost of a cold build: kube-apiserver ~10-20 min and several GB of RAM on
# 2 cores; etcd ~1-2 min.
set -euo pipefail

# ---- pinned versions (bump here) -------------------------------------------
KUBE_VERSION="v1.34.4"   # k8s.io/kubernetes; staging modules use v0.34.4
ETCD_VERSION="v3.5.21"   # go.etcd.io/etcd/server/v3
# -----------------------------------------------------------------------------

DIR="${LMQ_TESTENV_DIR:-$HOME/.cache/lmq-testenv}"
BIN="$DIR/bin"
WANT="kube-apiserver=$KUBE_VERSION etcd=$ETCD_VERSION"

FORCE=0
case "${1:-}" in
  -f|--force) FORCE=1 ;;
  "") ;;
  *) echo "usage: $0 [--force]" >&2; exit 2 ;;
esac

log() { echo "testenv: $*"; }
die() { echo "testenv: ERROR: $*" >&2; exit 1; }

# A cold build prints nothing for many minutes: say once a minute that it still runs, with the Go build
# cache's growth as a sign of progress.
TICKER=""
tick_start() {
  local what=$1 began parent=$BASHPID; began=$(date +%s)
  (
    while sleep 60 && kill -0 "$parent" 2>/dev/null; do  # ends with the shell that started it, failed or not
      log "  still building $what: $(( ($(date +%s) - began) / 60 )) min so far, Go build cache $(du -sh "$(go env GOCACHE)" 2>/dev/null | cut -f1)"
    done
  ) &
  TICKER=$!
}
tick_stop() { if [[ -n "$TICKER" ]]; then kill "$TICKER" 2>/dev/null || true; wait "$TICKER" 2>/dev/null || true; TICKER=""; fi; }

etcd_ok() {
  [[ -x "$BIN/etcd" ]] || return 1
  "$BIN/etcd" --version 2>/dev/null | grep -qx "etcd Version: ${ETCD_VERSION#v}"
}

kube_ok() {
  [[ -x "$BIN/kube-apiserver" ]] || return 1
  "$BIN/kube-apiserver" --version 2>/dev/null | grep -qx "Kubernetes $KUBE_VERSION"
}

write_versions() {
  echo "$WANT" > "$BIN/VERSIONS.tmp"
  mv -f "$BIN/VERSIONS.tmp" "$BIN/VERSIONS"
}

if [[ $FORCE -eq 0 ]] && etcd_ok && kube_ok; then
  [[ -f "$BIN/VERSIONS" && "$(cat "$BIN/VERSIONS")" == "$WANT" ]] || write_versions
  log "up to date in $BIN ($WANT)"
  exit 0
fi

command -v go >/dev/null 2>&1 || die "'go' not found in PATH (need Go >= 1.24)"
mkdir -p "$BIN"

export CGO_ENABLED=0
export GOFLAGS="-mod=mod -buildvcs=false"
export GO111MODULE=on

WORK="$(mktemp -d "${TMPDIR:-/tmp}/lmq-testenv.XXXXXX")"
cleanup() { tick_stop; rm -rf "$WORK"; rm -f "$BIN/.etcd.tmp.$$" "$BIN/.kube-apiserver.tmp.$$"; }
trap cleanup EXIT

log "using $(go version), GOPATH=$(go env GOPATH), GOCACHE=$(go env GOCACHE)"

# ---- etcd ------------------------------------------------------------------
build_etcd() {
  local start=$SECONDS mod="$WORK/etcd"
  log "building etcd $ETCD_VERSION (go.etcd.io/etcd/server/v3) ..."
  mkdir -p "$mod"
  (
    cd "$mod"
    go mod init lmq-testenv/etcd >/dev/null 2>&1
    go mod edit -require="go.etcd.io/etcd/server/v3@$ETCD_VERSION"
    # etcd 3.5 pins reflect2 v1.0.1 / json-iterator v1.1.11, which are known
    # to misbehave with Go >= 1.18 runtimes; take the fixed patch releases.
    go mod edit -require="github.com/modern-go/reflect2@v1.0.2" \
                -require="github.com/json-iterator/go@v1.1.12"
    local tmp="$BIN/.etcd.tmp.$$"
    # server/v3's root package is the etcd main (server/main.go).
    tick_start "etcd (a cold build takes 1-3 min)"
    go build -trimpath \
      -ldflags "-s -w -X go.etcd.io/etcd/api/v3/version.GitSHA=$ETCD_VERSION" \
      -o "$tmp" go.etcd.io/etcd/server/v3
    tick_stop
    mv -f "$tmp" "$BIN/etcd"
  )
  etcd_ok || die "built etcd does not report version ${ETCD_VERSION#v}: $("$BIN/etcd" --version 2>&1 | head -3)"
  log "etcd $ETCD_VERSION built in $((SECONDS - start))s"
}

# ---- kube-apiserver --------------------------------------------------------
build_kube() {
  local start=$SECONDS mod="$WORK/kube"
  local minor="${KUBE_VERSION#v1.}"            # e.g. 34.4
  local staging_version="v0.$minor"           # e.g. v0.34.4
  local major=1 kminor="${minor%%.*}"
  log "building kube-apiserver $KUBE_VERSION (staging modules $staging_version) ..."
  mkdir -p "$mod"
  (
    cd "$mod"
    go mod init lmq-testenv/kube >/dev/null 2>&1
    go mod edit -require="k8s.io/kubernetes@$KUBE_VERSION"

    # k8s.io/kubernetes replaces every k8s.io/* staging module with
    # ./staging/src/...; those replaces do not apply to a dependent module, so
    # mirror them with the published v0.X.Y tags. The list is taken from
    # upstream's own go.mod so new staging modules are picked up on bumps.
    local kmod
    kmod="$(go list -m -f '{{.GoMod}}' "k8s.io/kubernetes@$KUBE_VERSION")"
    [[ -f "$kmod" ]] || die "could not fetch go.mod of k8s.io/kubernetes@$KUBE_VERSION"
    local staging
    staging="$(sed -nE 's#^[[:space:]]*(k8s\.io/[A-Za-z0-9._-]+)[[:space:]]+=>[[:space:]]+\./staging/.*#\1#p' "$kmod" | sort -u)"
    [[ -n "$staging" ]] || die "no staging replaces found in $kmod"
    local args=() m
    for m in $staging; do args+=("-replace=$m=$m@$staging_version"); done
    go mod edit "${args[@]}"
    log "  $(wc -w <<<"$staging") staging replaces -> $staging_version"

    # Same language version / godebug defaults as upstream's main module.
    local gov
    gov="$(sed -nE 's/^go[[:space:]]+([0-9.]+)[[:space:]]*$/\1/p' "$kmod" | head -1)"
    if [[ -n "$gov" ]]; then go mod edit -go="$gov"; fi
    local gd
    while read -r gd; do
      if [[ -n "$gd" ]]; then go mod edit -godebug="$gd"; fi
    done < <(sed -nE 's/^godebug[[:space:]]+([^(].*)$/\1/p' "$kmod")

    local pkgv="k8s.io/component-base/version" cgv="k8s.io/client-go/pkg/version"
    local date; date="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
    local ld="-s -w"
    local p
    for p in "$pkgv" "$cgv"; do
      ld+=" -X $p.gitVersion=$KUBE_VERSION -X $p.gitMajor=$major -X $p.gitMinor=$kminor"
      ld+=" -X $p.gitTreeState=clean -X $p.buildDate=$date"
    done
    local tmp="$BIN/.kube-apiserver.tmp.$$"
    tick_start "kube-apiserver (a cold build takes 10-35 min on 2 cores)"
    go build -trimpath -ldflags "$ld" -o "$tmp" k8s.io/kubernetes/cmd/kube-apiserver
    tick_stop
    mv -f "$tmp" "$BIN/kube-apiserver"
  )
  kube_ok || die "built kube-apiserver does not report $KUBE_VERSION: $("$BIN/kube-apiserver" --version 2>&1 | head -3)"
  log "kube-apiserver $KUBE_VERSION built in $((SECONDS - start))s"
}

if [[ $FORCE -eq 1 ]] || ! etcd_ok; then build_etcd; else log "etcd $ETCD_VERSION already present"; fi
if [[ $FORCE -eq 1 ]] || ! kube_ok; then build_kube; else log "kube-apiserver $KUBE_VERSION already present"; fi

write_versions
log "binaries in $BIN:"
log "  $("$BIN/kube-apiserver" --version 2>&1 | head -1)  ($(du -h "$BIN/kube-apiserver" | cut -f1))"
log "  $("$BIN/etcd" --version 2>&1 | head -1)  ($(du -h "$BIN/etcd" | cut -f1))"
log "VERSIONS: $(cat "$BIN/VERSIONS")"
