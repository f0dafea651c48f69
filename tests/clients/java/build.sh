#!/usr/bin/env bash
# Build the Java driver into $1: the driver jar and its dependencies (rocketmq-client-java pinned in
# pom.xml; Maven's download cache is ~/.m2). Maven's own build output stays in $1 too.
set -euo pipefail
out=$1
here=$(cd "$(dirname "$0")" && pwd)
mvn -q -B -f "$here/pom.xml" -DbuildDirectory="$out/target" \
  package dependency:copy-dependencies -DoutputDirectory="$out/lib" -DincludeScope=runtime
cp "$out"/target/*.jar "$out/driver.jar"
java=$(command -v java)
printf '["%s", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-Xss512k", "-Drocketmq.log.root=%s/logs", "-cp", "%s/driver.jar:%s/lib/*", "io.lmq.clients.Driver"]\n' \
  "$java" "$out" "$out" "$out" > "$out/argv.json"
