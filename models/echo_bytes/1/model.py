"""Triton Python-backend model ``echo_bytes``: TEXT_UPPER = TEXT upper-cased (UTF-8)."""

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


def _upper(texts):
    flat = [text.decode("utf-8").upper().encode("utf-8") for text in texts.reshape(-1)]
    return np.array(flat, dtype=np.object_).reshape(texts.shape)


class TritonPythonModel:
    """Upper-cases strings; a request that is not valid UTF-8 gets an error of its own."""

    def execute(self, requests):
        """One response per request, in order."""
        responses = []
        for request in requests:
            texts = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy()
            try:
                upper = _upper(texts)
            except UnicodeDecodeError as exc:
                error = pb_utils.TritonError(f"echo_bytes: TEXT is not valid UTF-8: {exc}")
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            output = pb_utils.Tensor("TEXT_UPPER", upper)
            responses.append(pb_utils.InferenceResponse(output_tensors=[output]))
        return responses
