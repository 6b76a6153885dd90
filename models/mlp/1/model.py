"""Triton Python-backend model ``mlp``: softmax of a fixed 64 -> 128 (relu) -> 10 MLP."""

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

SEED = 1234


def mlp_weights(seed=SEED):
    """The layers' weights and biases, drawn from a fixed seed (tests recompute them)."""
    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((64, 128)) / 8.0).astype(np.float32)
    b1 = (rng.standard_normal(128) * 0.1).astype(np.float32)
    w2 = (rng.standard_normal((128, 10)) / np.sqrt(128.0)).astype(np.float32)
    b2 = (rng.standard_normal(10) * 0.1).astype(np.float32)
    return w1, b1, w2, b2


class TritonPythonModel:
    """Class probabilities for rows of 64 features."""

    def initialize(self, args):
        """Draw the weights once per instance."""
        self.w1, self.b1, self.w2, self.b2 = mlp_weights()

    def _forward(self, rows):
        hidden = np.maximum(rows @ self.w1 + self.b1, 0.0)
        logits = hidden @ self.w2 + self.b2
        logits -= logits.max(axis=1, keepdims=True)  # numerically stable softmax
        exp = np.exp(logits)
        return (exp / exp.sum(axis=1, keepdims=True)).astype(np.float32)

    def execute(self, requests):
        """All requests' rows in one matrix product, split back per request."""
        inputs = [
            pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy() for request in requests
        ]
        probs = self._forward(np.concatenate(inputs).astype(np.float32, copy=False))
        bounds = np.cumsum([len(rows) for rows in inputs])[:-1]
        return [
            pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("PROBS", part)])
            for part in np.split(probs, bounds)
        ]
