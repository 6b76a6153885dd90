"""The local Schema Registry is a real one: Confluent's API, Confluent's own serializers."""

from __future__ import annotations

from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext

from devtools.devstack.registry import SchemaRegistry

PAYMENT = """{"type": "record", "name": "Payment", "namespace": "com.example",
  "fields": [{"name": "payment_id", "type": "string"}, {"name": "amount", "type": "double"}]}"""


def test_registry_serves_confluent_api_and_keeps_schemas_across_a_restart(
    schema_registry: SchemaRegistry,
) -> None:
    """confluent-kafka's AvroSerializer registers a schema and frames a record (magic byte,
    schema id); AvroDeserializer reads it back; the schema is still served by id after a
    restart of the registry."""
    assert set(schema_registry.get("/schemas/types")) >= {"AVRO", "JSON", "PROTOBUF"}
    context = SerializationContext("devstack-payments", MessageField.VALUE)
    with SchemaRegistryClient({"url": schema_registry.url}) as client:
        value = AvroSerializer(client, PAYMENT)({"payment_id": "p-1", "amount": 12.5}, context)
        assert value is not None and value[0] == 0
        schema_id = int.from_bytes(value[1:5], "big")
        latest = schema_registry.get("/subjects/devstack-payments-value/versions/latest")
        assert latest["id"] == schema_id
        assert AvroDeserializer(client)(value, context) == {"payment_id": "p-1", "amount": 12.5}

    schema_registry.restart()

    served = schema_registry.get(f"/schemas/ids/{schema_id}")
    assert served is not None and '"Payment"' in served["schema"]
    with SchemaRegistryClient({"url": schema_registry.url}) as fresh:  # nothing cached
        assert AvroDeserializer(fresh)(value, context) == {"payment_id": "p-1", "amount": 12.5}
