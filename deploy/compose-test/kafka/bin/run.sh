#!/bin/sh
# Entry point: server.properties from the KAFKA_* variables (KAFKA_NODE_ID -> node.id;
# `__` stands for `_` and `___` for `-`, as in the official image), storage formatted once.
set -eu
data=/var/lib/kafka/data
conf=/var/lib/kafka/server.properties
mkdir -p "$data"
: > "$conf"
env | while IFS='=' read -r name value; do
  case "$name" in
    KAFKA_HEAP_OPTS | KAFKA_OPTS) ;;
    KAFKA_*)
      key=$(printf '%s' "${name#KAFKA_}" | sed -e 's/___/-/g' -e 's/__/@/g' -e 's/_/./g' -e 's/@/_/g' | tr 'A-Z' 'a-z')
      printf '%s=%s\n' "$key" "$value" >> "$conf" ;;
  esac
done
printf 'log.dirs=%s\n' "$data" >> "$conf"
if [ ! -f "$data/meta.properties" ]; then
  java -Dlog4j2.configurationFile=/opt/kafka/config/tools-log4j2.xml -cp '/opt/kafka/libs/*' \
    kafka.tools.StorageTool format --ignore-formatted -t "${CLUSTER_ID:-5L6g3nShT-eMCtK--X86sw}" -c "$conf"
fi
exec java ${KAFKA_HEAP_OPTS:--Xmx512m -Xms512m} ${KAFKA_OPTS:-} \
  -Dlog4j2.configurationFile=/opt/kafka/config/log4j2.xml -cp '/opt/kafka/libs/*' kafka.Kafka "$conf"
