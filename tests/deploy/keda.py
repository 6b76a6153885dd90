"""KEDA's CustomResourceDefinitions, as KEDA publishes them in its Go module.

The module's zip is downloaded once from the Go module proxy (``GOPROXY``, else
proxy.golang.org) into the dev stack's cache, checked against the module sum KEDA's
release has in the Go checksum database, and the CRDs are read from it
(``config/crd/bases/``). Nothing of KEDA is kept in this repository.
"""

from __future__ import annotations

import base64
import hashlib
import os
import urllib.request
import zipfile
from pathlib import Path

from devtools.devstack.paths import cache_dir

MODULE = "github.com/kedacore/keda/v2"
VERSION = "v2.21.1"
#: The module's hash (Go's "h1" dirhash), as sum.golang.org records it.
MODULE_SUM = "h1:AoPpnkEeuSYUb1dAqQO5Pud9BpCPiOqurnKtnKobl6Q="
#: The CRDs the deploy/k8s objects use.
CRDS = ("keda.sh_scaledobjects.yaml", "keda.sh_triggerauthentications.yaml")


def _proxy() -> str:
    for entry in os.environ.get("GOPROXY", "").replace("|", ",").split(","):
        if entry.startswith(("https://", "http://")):
            return entry.rstrip("/")
    return "https://proxy.golang.org"


def module_hash(archive: zipfile.ZipFile) -> str:
    """Go's h1 hash of a module zip: SHA-256 over the sorted "sha256  name" lines."""
    lines = "".join(
        f"{hashlib.sha256(archive.read(name)).hexdigest()}  {name}\n"
        for name in sorted(archive.namelist())
    )
    return "h1:" + base64.b64encode(hashlib.sha256(lines.encode()).digest()).decode()


def _module_zip() -> Path:
    path = cache_dir() / "keda" / f"keda-{VERSION}.zip"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    url = f"{_proxy()}/{MODULE}/@v/{VERSION}.zip"
    partial = path.with_suffix(".part")
    with urllib.request.urlopen(url, timeout=120) as response:
        partial.write_bytes(response.read())
    with zipfile.ZipFile(partial) as archive:
        found = module_hash(archive)
    if found != MODULE_SUM:
        partial.unlink()
        raise AssertionError(f"{url}: module hash {found}, expected {MODULE_SUM}")
    partial.rename(path)
    return path


def crd_texts() -> dict[str, str]:
    """File name → YAML text of each CRD of ``CRDS``, from the verified module."""
    with zipfile.ZipFile(_module_zip()) as archive:
        prefix = f"{MODULE}@{VERSION}/config/crd/bases/"
        return {name: archive.read(prefix + name).decode() for name in CRDS}
