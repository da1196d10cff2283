"""Renders deploy/k8s overlays without a kustomize binary, for the offline tests.

No registry package ships kustomize for Python, so this renders the subset the
shipped kustomizations use, and refuses anything else: `resources` (files, or
folders holding a kustomization.yaml) and `patches` given as a file of RFC 6902
JSON-patch operations with a {kind, name} target (applied with the `jsonpatch`
library). Where `kubectl kustomize` exists, tests compare this rendering with
its output.
"""

from __future__ import annotations

from pathlib import Path

import jsonpatch
import yaml

SUPPORTED_KEYS = {"apiVersion", "kind", "resources", "patches"}


class UnsupportedKustomization(ValueError):
    """A kustomization using a feature this renderer does not implement."""


def render(folder: Path) -> list[dict]:
    folder = Path(folder)
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unsupported = set(kustomization) - SUPPORTED_KEYS
    if unsupported:
        raise UnsupportedKustomization(f"{folder}/kustomization.yaml: {sorted(unsupported)}")
    documents: list[dict] = []
    for entry in kustomization.get("resources", []):
        path = folder / entry
        if path.is_dir():
            documents += render(path)
        else:
            documents += [d for d in yaml.safe_load_all(path.read_text()) if d]
    for patch in kustomization.get("patches", []):
        if set(patch) != {"path", "target"} or set(patch["target"]) != {"kind", "name"}:
            raise UnsupportedKustomization(f"{folder}: patch {patch} (need path and a kind/name target)")
        operations = yaml.safe_load((folder / patch["path"]).read_text())
        targets = [
            i for i, d in enumerate(documents)
            if d["kind"] == patch["target"]["kind"] and d["metadata"]["name"] == patch["target"]["name"]
        ]
        if len(targets) != 1:
            raise UnsupportedKustomization(f"{folder}: patch target {patch['target']} matches {len(targets)}")
        documents[targets[0]] = jsonpatch.apply_patch(documents[targets[0]], operations)
    return documents
