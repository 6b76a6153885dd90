"""Every command and request example of the docs and the README holds.

What runs, and where: the quickstart block runs for real against a local Kafka and
Triton (tests/integration/test_quickstart.py), and so do the pages' JSON requests and the
runbook's replay commands (tests/integration/test_docs_examples.py). Here, with no
server: every ``--help`` command runs (in process); every other command of the worker
and of ``python -m devtools`` is parsed by its own argument parser (and ``run``'s flags
and ``export`` lines by the settings loader); ``make`` targets, ``pip`` extras, compose
services and the Kubernetes overrides are checked against the files they name; each JSON
request decodes and validates with the worker's own decoder against the model in
``models/``, each JSON result against the result schema, the audit record against
the audit writer's fields. A command of any other program fails the test until this
file learns to check it.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from aiokafka.structs import ConsumerRecord
from google.protobuf import text_format  # type: ignore[import-untyped, unused-ignore]
from tritonclient.grpc import model_config_pb2, service_pb2

from devtools.__main__ import build_parser as devtools_parser
from tests.contract.examples import (
    blocks,
    documented_result,
    is_request,
    is_result,
    json_examples,
    name,
    read_script,
)
from worker import wire
from worker.audit import audit_record
from worker.cli import build_parser as worker_parser
from worker.cli import main as worker_main
from worker.errors import InvalidRequest
from worker.settings import ConfigError, load_settings, settings_env_names
from worker.wire.validation import ModelSpec, check_request

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "models"
#: Shell builtins the quickstart uses around the worker's own commands.
BUILTINS = {"cat", "kill", "wait"}
#: Values of the settings a run command needs, where its block does not export them.
REQUIRED = {
    "WORKER_INPUT_TOPICS": "requests",
    "WORKER_OUTPUT_TOPIC": "results",
    "WORKER_DLQ_TOPIC": "dead-letters",
}


def _commands() -> list[tuple[str, list[str], dict[str, str]]]:
    """(document, argv, the block's exported variables) of every command of every sh block."""
    found = []
    for path, block in blocks("sh"):
        script = read_script(block)
        exported: dict[str, str] = {}
        for argv in script.commands:
            if argv[0] == "export":
                exported.update(arg.split("=", 1) for arg in argv[1:])  # type: ignore[misc]
            found.append((name(path), argv, exported))
    return found


def _worker(args: list[str], exported: dict[str, str]) -> None:
    """The worker's command line, as ``main`` reads it: ``run`` flags by the settings loader."""
    if "--help" in args:
        # Run for real, in process: the help is printed and the command ends with 0.
        with contextlib.redirect_stdout(io.StringIO()) as out:
            try:
                code = worker_main(args)
            except SystemExit as exit:
                code = exit.code  # type: ignore[assignment]
        assert code == 0 and "usage: kafka-triton-worker" in out.getvalue()
        return
    parsed, extra = worker_parser().parse_known_args(args)
    if parsed.command == "run":
        load_settings({**REQUIRED, **exported}, extra)
    else:
        assert extra == [], extra


def _devtools(args: list[str]) -> None:
    parsed = devtools_parser().parse_args(args)
    assert parsed.handler is not None


def _make(args: list[str]) -> None:
    makefile = (ROOT / "Makefile").read_text()
    for target in args:
        assert re.search(rf"^{re.escape(target)}:", makefile, re.M), f"make {target}"


def _pip(args: list[str]) -> None:
    assert args[0] == "install"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for spec in args[1:]:
        found = re.fullmatch(r"([\w-]+)(?:\[([\w,]+)\])?", spec)
        assert found and found.group(1) == project["name"], spec
        extras = set(filter(None, (found.group(2) or "").split(",")))
        assert extras <= set(project["optional-dependencies"]), spec


def _compose(args: list[str], exported: dict[str, str]) -> None:
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    command, rest = args[0], args[1:]
    assert command in {"up", "down", "run", "stop", "ps", "logs", "build"}, command
    for i, arg in enumerate(rest):
        if arg == "--scale":
            assert rest[i + 1].split("=")[0] in services
    if command == "run":
        options = [a for a in rest if a.startswith("-")]
        assert options == ["--rm"], options
        service, *worker_args = [a for a in rest if not a.startswith("-")]
        assert service == "worker"
        _worker(worker_args, exported)


def _kubectl(args: list[str], exported: dict[str, str]) -> None:
    configmap = yaml.safe_load((ROOT / "deploy" / "k8s" / "configmap.yaml").read_text())
    if args[0] == "apply":
        assert (ROOT / args[args.index("-k") + 1]).is_dir()
        return
    assert args[0] == "run"
    overrides = json.loads(next(a for a in args if a.startswith("--overrides=")).split("=", 1)[1])
    (container,) = overrides["spec"]["containers"]
    (source,) = container["envFrom"]
    assert source["configMapRef"]["name"] == configmap["metadata"]["name"]
    _worker(container["args"], {**exported, **configmap["data"]})


def check_command(argv: list[str], exported: dict[str, str]) -> None:
    """Check one command of a page against the program it runs (see the module docstring)."""
    program, args = argv[0], argv[1:]
    if program == "export":
        for assignment in args:
            variable, _, value = assignment.partition("=")
            assert variable in settings_env_names(), variable
            assert value, variable
        load_settings({**REQUIRED, **exported})
    elif program == "kafka-triton-worker":
        _worker(args, exported)
    elif argv[:3] == ["python", "-m", "worker"]:
        _worker(argv[3:], exported)
    elif argv[:3] == ["python", "-m", "devtools"]:
        _devtools(argv[3:])
    elif program == "make":
        _make(args)
    elif program == "pip":
        _pip(args)
    elif argv[:2] == ["docker", "compose"]:
        _compose(argv[2:], exported)
    elif program == "kubectl":
        _kubectl(args, exported)
    else:
        assert program in BUILTINS, f"a command this test does not know how to check: {argv}"


@pytest.mark.parametrize(
    ("document", "argv", "exported"),
    _commands(),
    ids=[f"{doc}:{' '.join(argv)[:60]}" for doc, argv, _ in _commands()],
)
def test_every_command_of_the_pages_parses(
    document: str, argv: list[str], exported: dict[str, str]
) -> None:
    """Each command of an sh block is one its program accepts, as written."""
    check_command(argv, exported)


def test_the_command_checks_refuse_what_the_programs_refuse() -> None:
    """The checks can fail: a misspelt flag, setting, target, extra or program each fails."""
    for argv in (
        ["kafka-triton-worker", "tail", "results", "--tail", "1"],
        ["kafka-triton-worker", "run", "--max-in-flights", "5"],
        ["export", "WORKER_MAX_INFLIGHT=5"],
        ["make", "deploy"],
        ["pip", "install", "kafka-triton-worker[gpu]"],
        ["docker", "compose", "up", "--scale", "workers=2"],
        ["rm", "-rf", "/"],
    ):
        with pytest.raises((AssertionError, SystemExit, ConfigError)):
            with contextlib.redirect_stderr(io.StringIO()):
                check_command(argv, {})


def model_spec(model: str) -> ModelSpec:
    """What the worker would learn from Triton about a model of ``models/``, from its config."""
    config = text_format.Parse(
        (MODELS / model / "config.pbtxt").read_text(), model_config_pb2.ModelConfig()
    )
    batch = [-1] if config.max_batch_size > 0 else []

    def tensors(specs: Any) -> list[Any]:
        return [
            service_pb2.ModelMetadataResponse.TensorMetadata(
                name=t.name,
                datatype=model_config_pb2.DataType.Name(t.data_type)
                .removeprefix("TYPE_")
                .replace("STRING", "BYTES"),
                shape=batch + list(t.dims),
            )
            for t in specs
        ]

    metadata = service_pb2.ModelMetadataResponse(
        name=model, versions=["1"], inputs=tensors(config.input), outputs=tensors(config.output)
    )
    return ModelSpec.from_triton(metadata, service_pb2.ModelConfigResponse(config=config))


def decode_and_check(value: bytes) -> wire.DecodedRequest:
    """Decode a request value as the worker does, and check it against its model."""
    decoded = wire.decode_request(
        value, (), source=wire.Source("docs", 0, 0), limits=wire.DecodeLimits(8 << 20)
    )
    check_request(model_spec(decoded.model_name), decoded)
    return decoded


def _requests() -> list[tuple[str, dict[str, Any]]]:
    return [(name(p), ex) for p, ex in json_examples() if is_request(ex)]


@pytest.mark.parametrize(("document", "request_"), _requests(), ids=lambda x: str(x)[:40])
def test_every_json_request_of_the_pages_decodes_and_fits_its_model(
    document: str, request_: dict[str, Any]
) -> None:
    """A request shown on a page is one the worker decodes and validates for its model."""
    decoded = decode_and_check(json.dumps(request_).encode())
    assert decoded.model_name == request_["model_name"]


def test_the_quickstarts_requests_are_one_good_and_one_bad_as_its_comments_say() -> None:
    """good-1 decodes and fits `double`; bad-1 is INVALID_REQUEST with the message shown."""
    (_path, block), *_ = [(p, b) for p, b in blocks("sh") if "requests.ndjson" in b]
    (body,) = read_script(block).heredocs
    good, bad = (line.encode() for line in body.splitlines())
    decode_and_check(good)
    with pytest.raises(InvalidRequest, match=re.escape("2 elements, shape [1, 4] needs 4")):
        decode_and_check(bad)


def test_every_json_result_of_the_pages_fits_the_result_schema_and_answers_a_request() -> None:
    """A result shown on a page validates against schemas/result.schema.json and answers a
    request shown on the same page, for the same model."""
    schema = json.loads((ROOT / "schemas" / "result.schema.json").read_text())
    results = [(p, ex) for p, ex in json_examples() if is_result(ex)]
    assert len(results) >= 2
    requests = {(p, ex["id"]): ex for p, ex in json_examples() if is_request(ex)}
    for path, result in results:
        jsonschema.validate(result, schema)
        assert requests[(path, result["id"])]["model_name"] == result["model_name"]
        assert documented_result(path, result["id"]) == result


def test_the_audit_record_example_has_the_audit_writers_fields() -> None:
    """The Security page's audit record has exactly the fields the worker writes."""
    (example,) = [ex for p, ex in json_examples() if "payload_sha256" in ex]
    record = ConsumerRecord("t", 0, 1, 0, 0, b"k", b"v", None, 1, 1, ())
    written = audit_record(
        record,
        worker_id="w",
        request_id="r",
        model_name="m",
        model_version="1",
        outcome="result",
        error_code=None,
        latency_s=0.1,
    )
    assert list(example) == list(written)


def test_every_json_block_is_a_request_a_result_or_the_audit_record() -> None:
    """No JSON block of the pages goes unchecked."""
    for _path, example in json_examples():
        assert is_request(example) or is_result(example) or "payload_sha256" in example
