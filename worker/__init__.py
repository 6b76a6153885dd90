"""Kafka stream-processing inference worker for NVIDIA Triton Inference Server."""

__version__ = "0.1.0"
