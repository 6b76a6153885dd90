"""The quixstreams peer: the worker's job as a quixstreams application, as its docs show it.

Consume the JSON request, call Triton's model, produce the result JSON to the output
topic: a synchronous function in ``sdf.apply(...)`` calling tritonclient's synchronous
gRPC client's ``infer`` once per message, then ``sdf.to_topic(...)``; quixstreams'
defaults otherwise (at-least-once, commits every 5 s). The result keeps the request's
key, as the worker's does.

Run by the interpreter of the virtualenv ``devtools.bench.quix`` builds: it imports
only what that virtualenv has (quixstreams, tritonclient, numpy), nothing of the project.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from quixstreams import Application
from tritonclient.utils import triton_to_np_dtype


def _inputs(doc: dict[str, Any]) -> list[Any]:
    """OIP JSON inputs → tritonclient inputs (a numpy array per tensor)."""
    inputs = []
    for spec in doc["inputs"]:
        if spec["datatype"] == "BYTES":
            array = np.asarray([str(v).encode() for v in spec["data"]], dtype=object)
        else:
            array = np.asarray(spec["data"], dtype=triton_to_np_dtype(spec["datatype"]))
        array = array.reshape(spec["shape"])
        tensor = grpcclient.InferInput(spec["name"], list(array.shape), spec["datatype"])
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _outputs(response: Any) -> list[dict[str, Any]]:
    """The response's outputs as OIP JSON outputs."""
    outputs = []
    for out in response.get_response().outputs:
        array = response.as_numpy(out.name)
        flat = array.reshape(-1)
        data = [v.decode() for v in flat] if out.datatype == "BYTES" else flat.tolist()
        outputs.append(
            {"name": out.name, "datatype": out.datatype, "shape": list(array.shape), "data": data}
        )
    return outputs


def main() -> None:
    """Run the application until SIGTERM (quixstreams stops, flushes and commits)."""
    parser = argparse.ArgumentParser(prog="quix_app.py")
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--triton", required=True)
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--group", required=True)
    parser.add_argument("--state-dir", required=True)
    args = parser.parse_args()

    app = Application(
        broker_address=args.bootstrap,
        consumer_group=args.group,
        auto_offset_reset="earliest",
        state_dir=args.state_dir,
        loglevel="WARNING",
    )
    requests = app.topic(args.input, value_deserializer="json")
    results = app.topic(args.output, value_serializer="json")
    client = grpcclient.InferenceServerClient(args.triton)

    def infer(doc: dict[str, Any]) -> dict[str, Any]:
        response = client.infer(doc["model_name"], _inputs(doc))
        return {
            "id": doc.get("id", ""),
            "model_name": doc["model_name"],
            "outputs": _outputs(response),
        }

    sdf = app.dataframe(requests)
    sdf = sdf.apply(infer)
    sdf.to_topic(results)
    app.run()


if __name__ == "__main__":
    main()
