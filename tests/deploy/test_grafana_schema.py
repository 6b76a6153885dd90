"""The Grafana dashboard and provisioning, checked as far as a library allows (no Grafana runs).

No Grafana server can run here, and no package ships a JSON Schema of its dashboard
model. Grafana does publish that model's types for each release: the npm package
``@grafana/schema`` (generated from its CUE schema). The dashboard JSON is checked
against the types of the release docker-compose.yml pins by the TypeScript compiler:
the dashboard, each panel's options and field config against its panel plugin's
types. Unknown fields and wrong types or values fail; fields Grafana defaults when it
loads a dashboard may be left out of panel options. The provisioning files have no
published schema: their fields are checked against Grafana's documented ones.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from devtools.devstack.paths import cache_dir

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "worker.json"
PROVISIONING = ROOT / "deploy" / "grafana" / "provisioning"
TYPESCRIPT = "5.8.3"
_RAW = "./node_modules/@grafana/schema/dist/esm/raw"
#: Panel plugin id → (folder under raw/composable, prefix of its types module).
_PANEL_TYPES = {
    "stat": ("stat", "Stat"),
    "timeseries": ("timeseries", "TimeSeries"),
    "state-timeline": ("statetimeline", "StateTimeline"),
    "table": ("table", "Table"),
}
#: Panels whose plugin has no custom field config of its own (the stat panel).
_NO_FIELD_CONFIG = {"stat"}
# JSON has no enums: a field of a TypeScript string enum takes the enum's values.
_JSON_TYPES = """\
type Json<T> = T extends string ? `${T}` : T extends (infer U)[] ? Json<U>[]
  : T extends object ? { [K in keyof T]: Json<T[K]> } : T;
type Loose<T> = T extends string ? `${T}` : T extends (infer U)[] ? Loose<U>[]
  : T extends object ? { [K in keyof T]?: Loose<T[K]> } : T;
"""


def grafana_version() -> str:
    """The Grafana release docker-compose.yml pins."""
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    image = str(services["grafana"]["image"])
    assert image.startswith("grafana/grafana:"), image
    return image.rpartition(":")[2]


@pytest.fixture(scope="module")
def schema_dir() -> Path:
    """@grafana/schema of the pinned release and TypeScript, installed from npm once."""
    folder = cache_dir() / f"grafana-schema-{grafana_version()}-ts-{TYPESCRIPT}"
    if not (folder / ".complete").exists():
        npm = shutil.which("npm")
        assert npm, "npm is needed (Debian's npm, or Node.js's)"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "package.json").write_text('{"private": true}\n')
        packages = [f"typescript@{TYPESCRIPT}", f"@grafana/schema@{grafana_version()}"]
        argv = [npm, "install", "--no-audit", "--no-fund", "--no-package-lock", *packages]
        done = subprocess.run(argv, cwd=folder, capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        (folder / ".complete").touch()
    return folder


def _check_source(doc: dict[str, Any]) -> str:
    """TypeScript that compiles only if ``doc`` fits Grafana's dashboard and panel types."""
    lines = [f'import type {{ Dashboard }} from "{_RAW}/dashboard/x/dashboard_types.gen";']
    for folder, name in _PANEL_TYPES.values():
        module = f"{_RAW}/composable/{folder}/panelcfg/x/{name}PanelCfg_types.gen"
        lines.append(f'import type * as {name} from "{module}";')
    lines += [_JSON_TYPES, f"export const dashboard: Json<Dashboard> = {json.dumps(doc)};"]
    for panel in doc["panels"]:
        if panel["type"] == "row":
            continue
        name = _PANEL_TYPES[panel["type"]][1]
        options = json.dumps(panel.get("options", {}))
        lines.append(f"export const options{panel['id']}: Loose<{name}.Options> = {options};")
        custom = panel.get("fieldConfig", {}).get("defaults", {}).get("custom")
        if panel["type"] in _NO_FIELD_CONFIG:
            assert custom is None, f"panel {panel['id']}: a stat panel has no custom field config"
            continue
        custom = json.dumps(custom or {})
        lines.append(f"export const custom{panel['id']}: Loose<{name}.FieldConfig> = {custom};")
    return "\n".join(lines) + "\n"


def _compile_errors(folder: Path, doc: dict[str, Any]) -> list[str]:
    (folder / "check.ts").write_text(_check_source(doc))
    argv = ["node", "node_modules/typescript/bin/tsc", "--noEmit", "--strict", "--skipLibCheck"]
    argv += ["--target", "es2022", "--module", "esnext", "--moduleResolution", "bundler"]
    done = subprocess.run([*argv, "check.ts"], cwd=folder, capture_output=True, text=True)
    return [line for line in done.stdout.splitlines() if "error TS" in line]


def test_dashboard_fits_the_pinned_grafana_schema(schema_dir: Path) -> None:
    """worker.json compiles against @grafana/schema of the pinned Grafana: no unknown field."""
    doc = json.loads(DASHBOARD.read_text())
    assert {p["type"] for p in doc["panels"]} <= {"row", *_PANEL_TYPES}
    assert _compile_errors(schema_dir, doc) == []


def test_the_schema_check_refuses_what_grafana_does_not_know(schema_dir: Path) -> None:
    """The check can fail: a misspelt panel field, option and mode are each reported."""
    doc = json.loads(DASHBOARD.read_text())
    stat = next(p for p in doc["panels"] if p["type"] == "stat")
    stat["gridPoss"] = stat.pop("gridPos")
    stat["options"]["colorMode"] = "rainbow"
    series = next(p for p in doc["panels"] if p["type"] == "timeseries")
    series["options"]["legendd"] = series["options"].pop("legend")
    errors = _compile_errors(schema_dir, doc)
    assert len(errors) == 3, errors
    assert any("gridPoss" in e for e in errors) and any("legendd" in e for e in errors)
    assert any("rainbow" in e for e in errors)


def _closed(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(required),
        "additionalProperties": False,
    }


# The fields of Grafana's provisioning documentation ("Provision Grafana": data sources,
# dashboards), for the keys these files may use.
_DATASOURCE = _closed(
    {
        **{k: {"type": "string"} for k in ("name", "type", "access", "uid", "url", "user")},
        **{k: {"type": "string"} for k in ("database", "basicAuthUser")},
        **{k: {"type": "boolean"} for k in ("isDefault", "editable", "basicAuth")},
        "withCredentials": {"type": "boolean"},
        "orgId": {"type": "integer"},
        "version": {"type": "integer"},
        "jsonData": {"type": "object"},
        "secureJsonData": {"type": "object"},
    },
    ("name", "type"),
)
DATASOURCES_SCHEMA = _closed(
    {
        "apiVersion": {"const": 1},
        "datasources": {"type": "array", "items": _DATASOURCE},
        "deleteDatasources": {"type": "array"},
        "prune": {"type": "boolean"},
    },
    ("apiVersion",),
)
_PROVIDER = _closed(
    {
        **{k: {"type": "string"} for k in ("name", "folder", "folderUid")},
        "type": {"const": "file"},
        "orgId": {"type": "integer"},
        "disableDeletion": {"type": "boolean"},
        "allowUiUpdates": {"type": "boolean"},
        "updateIntervalSeconds": {"type": "integer"},
        "options": _closed(
            {"path": {"type": "string"}, "foldersFromFilesStructure": {"type": "boolean"}},
            ("path",),
        ),
    },
    ("name", "type", "options"),
)
DASHBOARDS_SCHEMA = _closed(
    {"apiVersion": {"const": 1}, "providers": {"type": "array", "items": _PROVIDER}},
    ("apiVersion", "providers"),
)


def test_provisioning_uses_grafanas_documented_fields() -> None:
    """The datasource and dashboard provider files have only documented fields and types."""
    datasources = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())
    jsonschema.validate(datasources, DATASOURCES_SCHEMA)
    providers = yaml.safe_load((PROVISIONING / "dashboards" / "worker.yml").read_text())
    jsonschema.validate(providers, DASHBOARDS_SCHEMA)
    doc = json.loads(DASHBOARD.read_text())
    chooser = next(v for v in doc["templating"]["list"] if v["type"] == "datasource")
    assert {s["type"] for s in datasources["datasources"]} == {chooser["query"]}
