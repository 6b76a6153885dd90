"""Triton Python-backend model ``tokens``: a decoupled token stream, like an LLM backend's."""

import asyncio
import os
import sys

# The backend stub ignores PYTHONPATH and imports from the base interpreter's
# site-packages (no numpy, or numpy 2.x, which breaks outputs). The server names
# a numpy<2 site directory here; put it first before importing numpy.
_SITE_PACKAGES = os.environ.get("TRITON_MODEL_SITE_PACKAGES")
if _SITE_PACKAGES:
    sys.path.insert(0, _SITE_PACKAGES)

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402

_DEFAULT_DELAY_MS = 2
_FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _scalar(request, name, default):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return default if tensor is None else tensor.as_numpy().reshape(-1)[0]


def _tokens(text, count):
    """``count`` tokens cycling through the words of ``text``, LLM-style leading spaces."""
    words = text.split()
    if not words:
        return []
    return [(" " if i else "") + words[i % len(words)] for i in range(count)]


def _response(token):
    tensor = pb_utils.Tensor("text_output", np.array([token.encode()], dtype=np.object_))
    return pb_utils.InferenceResponse(output_tensors=[tensor])


class TritonPythonModel:
    """One response per token; every request streams concurrently (async execute)."""

    async def execute(self, requests):
        """Stream each request's tokens; returns nothing (decoupled: responses go out as sent)."""
        await asyncio.gather(*(self._stream(request) for request in requests))

    async def _stream(self, request):
        sender = request.get_response_sender()
        text = _scalar(request, "text_input", b"").decode("utf-8", errors="replace")
        tokens = _tokens(text, max(0, int(_scalar(request, "max_tokens", 0))))
        fail_after = int(_scalar(request, "fail_after", -1))
        delay_s = int(_scalar(request, "delay_ms", _DEFAULT_DELAY_MS)) / 1000.0
        separate_final = bool(_scalar(request, "separate_final", False))
        failing = 0 <= fail_after <= len(tokens)
        if failing:
            tokens = tokens[:fail_after]
        for index, token in enumerate(tokens):
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            last = index == len(tokens) - 1 and not (separate_final or failing)
            sender.send(_response(token), flags=_FINAL if last else 0)
        if failing:
            error = pb_utils.TritonError(f"tokens: failure requested after {len(tokens)} tokens")
            sender.send(pb_utils.InferenceResponse(error=error), flags=_FINAL)
        elif separate_final or not tokens:
            sender.send(flags=_FINAL)
