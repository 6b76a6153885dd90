"""Triton Python-backend model ``running_sum``: a running sum per sequence (stateful)."""

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


def _control(request, name):
    return pb_utils.get_input_tensor_by_name(request, name).as_numpy().reshape(-1)[0].item()


class TritonPythonModel:
    """SUM = INPUT + the sequence's SUM so far; the sequence batcher supplies the controls."""

    def initialize(self, args):
        self._sums = {}

    def execute(self, requests):
        """Requests of one sequence arrive in order; each gets the sum including itself."""
        responses = []
        for request in requests:
            sequence = _control(request, "CORRID")
            if _control(request, "START"):
                self._sums[sequence] = 0
            values = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            total = self._sums.get(sequence, 0) + int(values.sum())
            self._sums[sequence] = total
            if _control(request, "END"):
                self._sums.pop(sequence, None)
            output = np.full(values.shape, total, dtype=np.int32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("SUM", output)]))
        return responses
