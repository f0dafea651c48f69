#!/usr/bin/env bash
# Install Debian's mosquitto-clients (mosquitto_pub, mosquitto_sub) for the MQTT suites (tests/e2e/test_mqtt.py).
#
# Idempotent: exits at once when both programs are on PATH. Otherwise installs the Debian package with apt-get
# (as root, or through sudo when it is there). A failed install fails this script (and `make test`): the suites
# that use the programs fail without them, they never skip.
#
# Usage: scripts/mqtt-clients-install.sh
set -euo pipefail

have() { command -v mosquitto_pub >/dev/null && command -v mosquitto_sub >/dev/null; }
have && exit 0

if [[ $(id -u) -eq 0 ]]; then
  as_root=()
elif command -v sudo >/dev/null; then
  as_root=(sudo -n)
else
  echo "mqtt-clients: mosquitto_pub/mosquitto_sub missing and not root (no sudo): apt-get install mosquitto-clients" >&2
  exit 1
fi
command -v apt-get >/dev/null || { echo "mqtt-clients: no apt-get here: install mosquitto-clients by hand" >&2; exit 1; }

echo "mqtt-clients: installing Debian's mosquitto-clients"
export DEBIAN_FRONTEND=noninteractive
if ! "${as_root[@]}" apt-get install -y -q --no-install-recommends mosquitto-clients; then
  "${as_root[@]}" apt-get update -q  # an image without package lists, or stale ones
  "${as_root[@]}" apt-get install -y -q --no-install-recommends mosquitto-clients
fi
have || { echo "mqtt-clients: installed, yet mosquitto_pub/mosquitto_sub are not on PATH" >&2; exit 1; }
echo "mqtt-clients: installed $(command -v mosquitto_pub) and $(command -v mosquitto_sub)"
