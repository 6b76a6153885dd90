"""The Kafka edge on librdkafka (``WORKER_KAFKA_CLIENT=confluent``), imported only on its path.

Its configuration, intake, publisher, transactions, admin, logs and threads.

confluent-kafka is an extra, absent from the base install: this package imports nothing,
and only the code path of ``WORKER_KAFKA_CLIENT=confluent`` imports its modules that need it.
"""
