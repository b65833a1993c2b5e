"""Writes the Kubernetes JSON schemas tests/unit/test_k8s.py validates deploy/k8s/ against.

    pip install kubernetes-validate==1.37.0   # only to vendor: the tests need just jsonschema
    python tests/data/kubernetes/vendor.py

kubernetes-validate (Apache-2.0, see LICENSE) ships the OpenAPI definitions of each Kubernetes
release as JSON Schema, "strict" (no property beyond the API's). All of one release's definitions
are 1.3 MB; this keeps those reachable from the kinds the manifests use, without descriptions
(about 90 kB a release). A manifest of another kind fails the test until KINDS names it here.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

# The oldest release the manifests claim (native gRPC probes are GA since 1.27) and the newest
# kubernetes-validate 1.37.0 ships.
VERSIONS = ("1.30.0", "1.37.0")
KINDS = ("apps/v1/Deployment", "apps/v1/StatefulSet", "v1/Service")
OUT = Path(__file__).resolve().parent


def _refs(node: Any, found: set[str]) -> set[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                found.add(value.rpartition("/")[2])
            else:
                _refs(value, found)
    elif isinstance(node, list):
        for value in node:
            _refs(value, found)
    return found


def _strip(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _strip(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [_strip(v) for v in node]
    return node


def kind_of(definition: dict[str, Any]) -> str | None:
    """ "apps/v1/Deployment" for the definition that is that kind's top-level object."""
    gvks = definition.get("x-kubernetes-group-version-kind", [])
    if len(gvks) != 1:
        return None
    gvk = gvks[0]
    group = f"{gvk['group']}/" if gvk["group"] else ""
    return f"{group}{gvk['version']}/{gvk['kind']}"


def vendor(version: str) -> dict[str, Any]:
    spec = importlib.util.find_spec("kubernetes_validate")  # found, not imported
    if spec is None or not spec.submodule_search_locations:
        sys.exit("pip install kubernetes-validate==1.37.0 first")
    root = Path(spec.submodule_search_locations[0]) / "kubernetes-json-schema"
    defs = json.loads((root / f"v{version}-local-strict" / "_definitions.json").read_text())
    defs = defs["$defs"]
    kinds = {kind_of(d): name for name, d in defs.items() if kind_of(d) in KINDS}
    missing = set(KINDS) - set(kinds)
    if missing:
        sys.exit(f"v{version} defines no {sorted(missing)}")
    todo, kept = set(kinds.values()), set()
    while todo:
        name = todo.pop()
        if name not in kept:
            kept.add(name)
            _refs(defs[name], todo)
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "x-source": f"kubernetes-validate 1.37.0, v{version}-local-strict, descriptions removed",
        "x-kinds": dict(sorted(kinds.items())),  # "apps/v1/Deployment" → its definition
        "$defs": {name: _strip(defs[name]) for name in sorted(kept)},
    }


def main() -> None:
    for version in VERSIONS:
        path = OUT / f"v{version.rpartition('.')[0]}.json"
        text = json.dumps(vendor(version), indent=1, sort_keys=True) + "\n"
        path.write_text(text)
        print(f"{path}: {len(text)} bytes")


if __name__ == "__main__":
    main()
