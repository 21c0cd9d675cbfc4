"""A small kustomize: what `kubectl kustomize` does with our manifests, for tests without the
binary. Resources (files and kustomization folders, recursively), `namespace`, `labels`, and
`patches` given inline as JSON 6902 operations on a target kind and name. Anything else in a
kustomization.yaml is refused, so the files never grow features this does not render."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

KNOWN_KEYS = {"apiVersion", "kind", "namespace", "labels", "resources", "patches"}


def render(folder: Path) -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(kustomization) - KNOWN_KEYS
    assert not unknown, f"{folder}: kustomization keys this renderer does not know: {unknown}"
    objects: list[dict[str, Any]] = []
    for resource in kustomization.get("resources", []):
        path = (folder / resource).resolve()
        if path.is_dir():
            objects += render(path)
        else:
            objects += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    for patch in kustomization.get("patches", []):
        target = patch["target"]
        matches = [
            o
            for o in objects
            if o["kind"] == target["kind"] and o["metadata"]["name"] == target["name"]
        ]
        assert len(matches) == 1, f"{folder}: patch target {target} matched {len(matches)}"
        for operation in yaml.safe_load(patch["patch"]):
            apply_operation(matches[0], operation)
    for obj in objects:
        if "namespace" in kustomization and obj["kind"] != "Namespace":
            obj["metadata"]["namespace"] = kustomization["namespace"]
        for entry in kustomization.get("labels", []):
            obj["metadata"].setdefault("labels", {}).update(entry["pairs"])
    return objects


def _pointer(path: str) -> list[str]:
    return [part.replace("~1", "/").replace("~0", "~") for part in path.split("/")[1:]]


def apply_operation(document: dict[str, Any], operation: dict[str, Any]) -> None:
    *parents, last = _pointer(operation["path"])
    node: Any = document
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    op, value = operation["op"], copy.deepcopy(operation.get("value"))
    key: Any = last if isinstance(node, dict) else (len(node) if last == "-" else int(last))
    if op == "test":
        assert node[key] == value, f"patch test failed at {operation['path']}: {node[key]!r}"
    elif op == "replace":
        assert (key in node) if isinstance(node, dict) else key < len(node), operation["path"]
        node[key] = value
    elif op == "add":
        if isinstance(node, list):
            node.insert(key, value)
        else:
            node[key] = value
    elif op == "remove":
        del node[key]
    else:
        raise AssertionError(f"unsupported patch op {op}")
