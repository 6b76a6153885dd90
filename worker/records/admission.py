"""Whether a decoded request fits its model and may share a batch, remembered per signature.

``check_request`` (the request against the model's inputs and outputs) and ``batchable``
(whether it may travel with others) read only what a request's signature holds: each
input's name, datatype, shape and parameter count, the number of raw contents, the
requested outputs' names, the request's parameter names. The records of a stream of
requests mostly share one signature, so the batch path asks once per (model spec,
signature) and remembers a yes; a new spec (the model reloaded) asks again, and a no is
asked again each time (the record goes to the per-record path, which says why).

The memory is bounded: at most ``MAX_SIGNATURES`` answers (the oldest forgotten first: a
producer can send any number of distinct shapes), each as large as its model's inputs and
outputs allow (a yes names only the model's inputs, each once; a request asking for more
outputs than the model has, or with parameters of its own, is not remembered).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from worker.triton.batching import batchable
from worker.wire import DecodedRequest
from worker.wire.validation import ModelSpec

__all__ = ["MAX_SIGNATURES", "Admissions", "signature_of"]

#: How many (model, signature) answers are kept.
MAX_SIGNATURES: Final = 1024

#: What a request's signature is made of (see the module docstring).
_Signature = tuple[Any, ...]


def signature(infer: Any) -> _Signature:
    """What ``check_request`` and ``batchable`` read of a ``ModelInferRequest``."""
    return (
        tuple((t.name, t.datatype, tuple(t.shape), len(t.parameters)) for t in infer.inputs),
        len(infer.raw_input_contents),
        tuple(o.name for o in infer.outputs),
        tuple(sorted(infer.parameters.keys())) if len(infer.parameters) else (),
    )


def signature_of(request: DecodedRequest) -> _Signature:
    """``signature`` of the request, read from its pending tensors if it has them (the same
    as its built request's: no parameters, one raw content per input)."""
    pending = request.pending
    if request.infer_request is not None or pending is None:
        return signature(request.infer_request)
    return (
        tuple((p.name, p.datatype, p.shape, 0) for p in pending),
        len(pending),
        request.output_names,
        (),
    )


class Admissions:
    """``admits(spec, request)``: True when the request passes ``check`` and ``batchable``."""

    def __init__(self, check: Callable[[ModelSpec, DecodedRequest], None]) -> None:
        """``check``: raises when the request does not fit the model (``check_request``)."""
        self._check = check
        #: (model, version, signature) -> the spec it was admitted for
        self._answers: dict[tuple[str, str, _Signature], ModelSpec] = {}

    def __len__(self) -> int:
        return len(self._answers)

    def admits(self, spec: ModelSpec, request: DecodedRequest) -> bool:
        """True when ``request`` fits ``spec`` and may share a batch (a yes asked once per
        spec and signature; a request with pending tensors is built to be asked)."""
        key = (spec.name, spec.version, signature_of(request))
        if self._answers.get(key) is spec:
            return True
        try:
            infer = request.packed()
            self._check(spec, request)
            if not batchable(spec, request):
                return False
        except Exception:
            return False  # the per-record path checks it again and says why
        if len(infer.outputs) <= len(spec.outputs) and not len(infer.parameters):
            if key not in self._answers and len(self._answers) >= MAX_SIGNATURES:
                del self._answers[next(iter(self._answers))]
            self._answers[key] = spec
        return True
