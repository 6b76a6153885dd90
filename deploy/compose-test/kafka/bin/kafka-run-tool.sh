#!/bin/sh
# Runs one of Kafka's command-line tools (a class name, then its arguments) with a small,
# quickly started JVM: the healthcheck runs one every few seconds.
exec java -Xmx256m -XX:TieredStopAtLevel=1 -XX:+UseSerialGC \
  -Dlog4j2.configurationFile=/opt/kafka/config/tools-log4j2.xml -cp '/opt/kafka/libs/*' "$@"
