"""Triton Python-backend model ``faulty``: copies INPUT0, fails or answers late on request."""

import os
import sys
import time

# The backend stub ignores PYTHONPATH and imports from the base interpreter's
# site-packages (no numpy, or numpy 2.x, which breaks outputs). The server names
# a numpy<2 site directory here; put it first before importing numpy.
_SITE_PACKAGES = os.environ.get("TRITON_MODEL_SITE_PACKAGES")
if _SITE_PACKAGES:
    sys.path.insert(0, _SITE_PACKAGES)

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402


def _flag(request, name, default):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return default if tensor is None else tensor.as_numpy().reshape(-1)[0].item()


class TritonPythonModel:
    """OUTPUT0 = INPUT0; FAIL=true answers with an error, DELAY_MS delays the answer."""

    def execute(self, requests):
        """Errors go into the request's own response, never raised, so others succeed."""
        # The responses of one call leave together, so one sleep for the longest
        # delay is enough (the model is not batched: a call holds one request).
        delay_ms = max(int(_flag(request, "DELAY_MS", 0)) for request in requests)
        if delay_ms > 0:
            time.sleep(delay_ms / 1000.0)
        responses = []
        for request in requests:
            if bool(_flag(request, "FAIL", False)):
                error = pb_utils.TritonError("faulty: failure requested")
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            values = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            output = pb_utils.Tensor("OUTPUT0", values.astype(np.float32))
            responses.append(pb_utils.InferenceResponse(output_tensors=[output]))
        return responses
