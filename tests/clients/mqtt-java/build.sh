#!/usr/bin/env bash
# Build the Java MQTT scenarios into $1: the jar and its dependencies (Eclipse Paho mqttv3 and mqttv5, pinned in
# pom.xml; Maven's download cache is ~/.m2). Maven's own build output stays in $1 too.
set -euo pipefail
out=$1
here=$(cd "$(dirname "$0")" && pwd)
mvn -q -B -f "$here/pom.xml" -DbuildDirectory="$out/target" \
  package dependency:copy-dependencies -DoutputDirectory="$out/lib" -DincludeScope=runtime
cp "$out"/target/*.jar "$out/scenarios.jar"
java=$(command -v java)
printf '["%s", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-cp", "%s/scenarios.jar:%s/lib/*", "io.lmq.mqtt.Scenarios"]\n' \
  "$java" "$out" "$out" > "$out/argv.json"
