"""The Kafka edge on aiokafka (the default client): its intake and aiokafka's private parts.

Modules are imported by name (``worker.kafka.aiokafka.intake``); the library itself stays
``aiokafka`` (imports are absolute).
"""
