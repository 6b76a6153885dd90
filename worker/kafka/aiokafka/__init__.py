"""The Kafka edge on aiokafka (the default client): clients, intake, transactions, probes.

Modules are imported by name (``worker.kafka.aiokafka.intake``); the library itself stays
``aiokafka`` (imports are absolute).
"""
