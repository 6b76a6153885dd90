#!/bin/sh
exec /opt/kafka/bin/kafka-run-tool.sh org.apache.kafka.tools.TopicCommand "$@"
