"""Security settings turned into client options: Kafka TLS/SASL, Triton TLS and tokens, limits."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from worker import errors
from worker.config import Settings


def kafka_client_kwargs(settings: Settings) -> dict[str, Any]:
    """Keyword arguments for every aiokafka client (consumer, producers, admin)."""
    return {"security_protocol": settings.security_protocol}


def triton_client_kwargs(settings: Settings) -> dict[str, Any]:
    """Keyword arguments for ``tritonclient.grpc.aio.InferenceServerClient``."""
    return {}


class TritonAuth:
    """gRPC metadata sent with every Triton call (for example ``authorization: Bearer …``)."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings

    def headers(self) -> Mapping[str, str]:
        return {}


def check_model_allowed(settings: Settings, topic: str, model: str) -> None:
    """Raise Forbidden when the input topic may not use ``model``."""
    for rule_topic, models in settings.model_allowlist:
        if rule_topic == topic and "*" not in models and model not in models:
            raise errors.Forbidden(f"model {model!r} is not allowed for topic {topic!r}")
