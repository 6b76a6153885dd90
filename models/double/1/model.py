"""Triton Python-backend model ``double``: OUTPUT0 = 2 * INPUT0, element-wise."""

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


class TritonPythonModel:
    """Doubles each request's tensor."""

    def execute(self, requests):
        """One response per request, in order (requests may differ in shape)."""
        responses = []
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            doubled = pb_utils.Tensor("OUTPUT0", (values * 2).astype(np.float32))
            responses.append(pb_utils.InferenceResponse(output_tensors=[doubled]))
        return responses
