"""The environment, backend folder and command line of the local tritonserver."""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path

import pytest

from devtools.devstack.triton import (
    MODEL_PYTHON_VERSIONS,
    SITE_PACKAGES_ENV,
    TritonInstall,
    TritonPorts,
    model_python,
    prepare_backend_dir,
    server_argv,
    triton_env,
)

LIBDIR = "/pythons/3.11/lib"
INSTALL = TritonInstall.at(Path("/cache/triton/cp311"), LIBDIR)
SYSTEM_LIBS = "/system/lib"


def _library_path(env: dict[str, str]) -> list[str]:
    return env["LD_LIBRARY_PATH"].split(os.pathsep)


def test_interpreter_libdir_comes_first_on_library_path() -> None:
    """Pitfall 1: the models' interpreter's libpython folder precedes any system library folder."""
    env = triton_env(INSTALL, {"LD_LIBRARY_PATH": SYSTEM_LIBS})

    assert _library_path(env)[0] == LIBDIR
    assert _library_path(env).index(SYSTEM_LIBS) > 0


def test_wheel_libs_are_on_library_path() -> None:
    """Pitfall 2: nvidia_pytriton.libs is on the library path for the backend and stub."""
    env = triton_env(INSTALL, {})

    assert _library_path(env)[:2] == [LIBDIR, str(INSTALL.libs_dir)]


def test_the_models_numpy_runs_one_blas_thread_unless_told_otherwise() -> None:
    """OpenBLAS's thread per core spins between a model's calls: one thread by default."""
    assert triton_env(INSTALL, {})["OPENBLAS_NUM_THREADS"] == "1"
    assert triton_env(INSTALL, {"OPENBLAS_NUM_THREADS": "4"})["OPENBLAS_NUM_THREADS"] == "4"


def test_the_models_run_on_a_python_with_a_numpy_below_2() -> None:
    """This interpreter when numpy<2 exists for it (3.11, 3.12), else one found beside it."""
    python = model_python()
    assert python.version in MODEL_PYTHON_VERSIONS
    assert (Path(python.libdir) / f"libpython{python.version}.so.1.0").exists()
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if here in MODEL_PYTHON_VERSIONS:
        assert python.executable == sys.executable
        assert python.libdir == sysconfig.get_config_var("LIBDIR")
    else:
        assert python.executable != sys.executable


def test_models_are_told_the_numpy_site_dir() -> None:
    """Pitfall 3: the models learn the numpy<2 site directory from the environment."""
    env = triton_env(INSTALL, {"PYTHONPATH": "/elsewhere"})

    assert env[SITE_PACKAGES_ENV] == str(INSTALL.site_dir)
    assert env["PYTHONPATH"] == "/elsewhere"


def test_existing_environment_is_kept_and_not_mutated() -> None:
    """Other variables pass through; the caller's mapping is left as it was."""
    base = {"HOME": "/home/u", "LD_LIBRARY_PATH": f"{SYSTEM_LIBS}:/more"}

    env = triton_env(INSTALL, base)

    assert env["HOME"] == "/home/u"
    assert _library_path(env)[2:] == [SYSTEM_LIBS, "/more"]
    assert base == {"HOME": "/home/u", "LD_LIBRARY_PATH": f"{SYSTEM_LIBS}:/more"}


@pytest.mark.parametrize("existing", [None, "", ":"])
def test_library_path_has_no_empty_entry(existing: str | None) -> None:
    """An empty or missing LD_LIBRARY_PATH adds no empty entry (the loader reads it as cwd)."""
    base = {} if existing is None else {"LD_LIBRARY_PATH": existing}

    assert "" not in _library_path(triton_env(INSTALL, base))


def _fake_wheel(site: Path, python_version: str) -> None:
    server = site / "pytriton" / "tritonserver"
    for relative in (
        "backends/python/libtriton_python.so",
        "backends/python/triton_python_backend_utils.py",
        f"python_backend_stubs/{python_version}/triton_python_backend_stub",
    ):
        (server / relative).parent.mkdir(parents=True, exist_ok=True)
        (server / relative).write_text(relative)


def test_backend_dir_links_the_stub_rather_than_copying_it(tmp_path: Path) -> None:
    """Pitfall 2: the stub is a link to the wheel's file, so its relative RPATH still resolves."""
    _fake_wheel(tmp_path / "site", "3.11")

    prepare_backend_dir(tmp_path / "site", tmp_path / "backends", "3.11")

    stub = tmp_path / "backends" / "python" / "triton_python_backend_stub"
    wheel_stub = tmp_path / "site/pytriton/tritonserver/python_backend_stubs/3.11"
    assert stub.is_symlink()
    assert stub.resolve() == (wheel_stub / "triton_python_backend_stub").resolve()
    assert {path.name for path in stub.parent.iterdir()} == {
        "libtriton_python.so",
        "triton_python_backend_stub",
        "triton_python_backend_utils.py",
    }


def test_backend_dir_survives_renaming_the_install(tmp_path: Path) -> None:
    """Links are relative: the install is built aside and renamed into place."""
    _fake_wheel(tmp_path / "partial" / "site", "3.11")
    prepare_backend_dir(tmp_path / "partial" / "site", tmp_path / "partial" / "backends", "3.11")

    (tmp_path / "partial").rename(tmp_path / "final")

    install = TritonInstall.at(tmp_path / "final", LIBDIR)
    utils = install.backend_dir / "python" / "triton_python_backend_utils.py"
    assert utils.read_text() == "backends/python/triton_python_backend_utils.py"


def test_backend_dir_refuses_a_missing_stub(tmp_path: Path) -> None:
    """A Python version without a stub in the wheel fails with the missing path named."""
    _fake_wheel(tmp_path / "site", "3.11")

    with pytest.raises(RuntimeError, match=r"python_backend_stubs/3\.99"):
        prepare_backend_dir(tmp_path / "site", tmp_path / "backends", "3.99")


def test_argv_loads_only_the_requested_models() -> None:
    """Explicit model control loads the named models on the chosen ports."""
    ports = TritonPorts(grpc=1001, http=1002, metrics=1003)

    argv = server_argv(INSTALL, Path("/repo"), ports, models=["double", "mlp"])

    assert argv[0] == str(INSTALL.server_binary)
    assert "--model-control-mode=explicit" in argv
    assert [arg for arg in argv if arg.startswith("--load-model")] == [
        "--load-model=double",
        "--load-model=mlp",
    ]
    assert {"--grpc-port=1001", "--http-port=1002", "--metrics-port=1003"} <= set(argv)


def test_argv_loads_every_model_by_default() -> None:
    """Without a model list the server loads all models; extra arguments come last."""
    ports = TritonPorts(grpc=1, http=2, metrics=3)

    argv = server_argv(INSTALL, Path("/repo"), ports, extra_args=["--log-verbose=1"])

    assert [arg for arg in argv if arg.startswith("--load-model")] == ["--load-model=*"]
    assert argv[-1] == "--log-verbose=1"


def test_picked_ports_are_distinct() -> None:
    """The three endpoints never share a port."""
    ports = TritonPorts.pick()

    assert len({ports.grpc, ports.http, ports.metrics}) == 3
