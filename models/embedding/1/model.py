"""Triton Python-backend model ``embedding``: a fixed 768 -> 4 softmax head, and the L2 norm."""

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

SEED = 4321


def head_weights(seed=SEED):
    """The head's weights and biases, drawn from a fixed seed (tests recompute them)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((768, 4)) / np.sqrt(768.0)).astype(np.float32)
    b = (rng.standard_normal(4) * 0.1).astype(np.float32)
    return w, b


class TritonPythonModel:
    """Class probabilities and the norm of rows of 768 floats."""

    def initialize(self, args):
        """Draw the weights once per instance."""
        self.w, self.b = head_weights()

    def execute(self, requests):
        """All requests' rows in one matrix product, split back per request."""
        inputs = [
            pb_utils.get_input_tensor_by_name(request, "EMBEDDING").as_numpy()
            for request in requests
        ]
        rows = np.concatenate(inputs).astype(np.float32, copy=False)
        logits = rows @ self.w + self.b
        logits -= logits.max(axis=1, keepdims=True)  # numerically stable softmax
        exp = np.exp(logits)
        probs = (exp / exp.sum(axis=1, keepdims=True)).astype(np.float32)
        norms = np.linalg.norm(rows, axis=1, keepdims=True).astype(np.float32)
        bounds = np.cumsum([len(part) for part in inputs])[:-1]
        return [
            pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("PROBS", p), pb_utils.Tensor("NORM", n)]
            )
            for p, n in zip(np.split(probs, bounds), np.split(norms, bounds))
        ]
