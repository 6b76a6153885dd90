"""The Triton edge: the stream pool, micro-batching, shared memory, auth, error mapping."""

from worker.triton.auth import TritonAuth, triton_client_kwargs
from worker.triton.batching import MicroBatcher
from worker.triton.pool import TritonPool

__all__ = ["MicroBatcher", "TritonAuth", "TritonPool", "triton_client_kwargs"]
