"""The Kafka edge on aiokafka (the default client): intake, transactions, private parts used.

Modules are imported by name (``worker.kafka.aiokafka.intake``); the library itself stays
``aiokafka`` (imports are absolute).
"""
