#!/usr/bin/env python3
"""Render a kustomization of deploy/k8s without kubectl: the subset of kustomize these manifests
use, for machines with Python and PyYAML only (the test suite renders every overlay with it, and
checks it against `kubectl kustomize` wherever kubectl is installed).

    python deploy/k8s/kustomize.py deploy/k8s/overlays/cpu-dev > cpu-dev.yaml

An overlay made from a settings.yaml (deploy/k8s/settings.py) is refused when its files are stale.

Supported: `resources` (files and kustomization directories), `components`, `namespace`,
`configMapGenerator` / `secretGenerator` (`files`, `literals`; `behavior` create, merge or
replace), `generatorOptions` (`disableNameSuffixHash: true` only, which these manifests set),
`patches` (a file or inline; strategic merge, or JSON 6902 with a `target`) and `images`. Any other
field is refused by name rather than ignored, so a kustomization this cannot render fails loudly.
"""
from __future__ import annotations

import base64
import copy
import os
import sys
from typing import Any

import yaml

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
KNOWN_FIELDS = {"apiVersion", "kind", "resources", "components", "namespace", "configMapGenerator",
                "secretGenerator", "generatorOptions", "patches", "images"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "PersistentVolume",
                  "StorageClass", "PriorityClass", "ValidatingWebhookConfiguration", "MutatingWebhookConfiguration"}
# Strategic-merge keys of the lists these manifests patch (everything else is replaced whole).
MERGE_KEYS = {"containers": "name", "initContainers": "name", "volumes": "name", "env": "name",
              "volumeMounts": "mountPath", "imagePullSecrets": "name", "volumeClaimTemplates": None}


class KustomizeError(Exception):
    pass


def _read_yaml_docs(path: str) -> list[dict]:
    with open(path) as f:
        return [doc for doc in yaml.safe_load_all(f) if doc]


def _kustomization_file(folder: str) -> str:
    for name in KUSTOMIZATION_FILES:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            return path
    raise KustomizeError(f"{folder}: no kustomization.yaml")


def _inside(root: str, path: str) -> str:
    """`path` (relative to `root`), refused when it leaves `root` (kustomize's load restrictor)."""
    full = os.path.realpath(os.path.join(root, path))
    if os.path.commonpath([full, os.path.realpath(root)]) != os.path.realpath(root):
        raise KustomizeError(f"{root}: {path} is outside the kustomization's directory")
    return full


def _key(obj: dict) -> tuple[str, str, str]:
    meta = obj.get("metadata") or {}
    return obj.get("kind", ""), meta.get("namespace") or "", meta.get("name", "")


def _find(objects: list[dict], kind: str | None, name: str | None) -> list[dict]:
    return [o for o in objects if (kind is None or o.get("kind") == kind)
            and (name is None or (o.get("metadata") or {}).get("name") == name)]


# --- generators -----------------------------------------------------------------------------------

def _generated(root: str, spec: dict, kind: str) -> dict:
    unknown = set(spec) - {"name", "files", "literals", "behavior", "options", "type"}
    if unknown:
        raise KustomizeError(f"{root}: {kind} generator fields not supported here: {sorted(unknown)}")
    data: dict[str, str] = {}
    for entry in spec.get("files") or []:
        key, _, path = entry.rpartition("=") if "=" in entry else ("", "", entry)
        key = key or os.path.basename(path)
        with open(_inside(root, path), "rb") as f:
            raw = f.read()
        data[key] = base64.b64encode(raw).decode() if kind == "Secret" else raw.decode()
    for entry in spec.get("literals") or []:
        key, _, value = entry.partition("=")
        data[key] = base64.b64encode(value.encode()).decode() if kind == "Secret" else value
    obj: dict[str, Any] = {"apiVersion": "v1", "kind": kind, "metadata": {"name": spec["name"]}, "data": data}
    if kind == "Secret":
        obj["type"] = spec.get("type", "Opaque")
    options = spec.get("options") or {}
    if set(options) - {"labels", "annotations"}:
        raise KustomizeError(f"{root}: generator options not supported here: {sorted(options)}")
    for field in ("labels", "annotations"):
        if options.get(field):
            obj["metadata"][field] = dict(options[field])
    return obj


def _run_generators(root: str, kust: dict, objects: list[dict]) -> None:
    options = kust.get("generatorOptions") or {}
    if (kust.get("configMapGenerator") or kust.get("secretGenerator")) and options != {"disableNameSuffixHash": True}:
        raise KustomizeError(f"{root}: generators need generatorOptions: {{disableNameSuffixHash: true}} here "
                             "(name hashes are not computed by this renderer)")
    for field, kind in (("configMapGenerator", "ConfigMap"), ("secretGenerator", "Secret")):
        for spec in kust.get(field) or []:
            new = _generated(root, spec, kind)
            behavior = spec.get("behavior", "create")
            existing = _find(objects, kind, spec["name"])
            if behavior == "create":
                if existing:
                    raise KustomizeError(f"{root}: {kind} {spec['name']} exists already (use behavior: merge)")
                objects.append(new)
            elif behavior in ("merge", "replace"):
                if not existing:
                    raise KustomizeError(f"{root}: {kind} {spec['name']} to {behavior} does not exist")
                old = existing[0]
                if behavior == "merge":
                    old.setdefault("data", {}).update(new["data"])
                    for field_name in ("labels", "annotations"):
                        if new["metadata"].get(field_name):
                            old["metadata"].setdefault(field_name, {}).update(new["metadata"][field_name])
                else:
                    old["data"] = new["data"]
            else:
                raise KustomizeError(f"{root}: unknown generator behavior {behavior!r}")


# --- patches --------------------------------------------------------------------------------------

def strategic_merge(base: Any, patch: Any, field: str = "") -> Any:
    """A strategic-merge patch of `base` (kustomize's semantics for the lists in MERGE_KEYS)."""
    if isinstance(patch, dict) and isinstance(base, dict):
        if patch.get("$patch") == "replace":
            return {k: v for k, v in patch.items() if k != "$patch"}
        out = dict(base)
        for key, value in patch.items():
            if key == "$patch":
                continue
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = strategic_merge(out[key], value, key)
            else:
                out[key] = _without_directives(value)
        return out
    if isinstance(patch, list) and isinstance(base, list) and MERGE_KEYS.get(field):
        key = MERGE_KEYS[field]
        rest = [copy.deepcopy(item) for item in base]
        first = []  # the patch's items come first, in its order, then the base's others (as kustomize writes them)
        for item in patch:
            if not isinstance(item, dict) or key not in item:
                raise KustomizeError(f"patch of {field}: every item needs its {key}")
            index = next((i for i, old in enumerate(rest) if old.get(key) == item[key]), None)
            old = rest.pop(index) if index is not None else None
            if item.get("$patch") == "delete":
                continue
            first.append(_without_directives(item) if old is None else strategic_merge(old, item, field))
        return first + rest
    return _without_directives(patch)


def _without_directives(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_directives(v) for k, v in value.items() if k != "$patch"}
    if isinstance(value, list):
        return [_without_directives(v) for v in value]
    return copy.deepcopy(value)


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise KustomizeError(f"JSON patch path must start with '/': {path!r}")
    return [part.replace("~1", "/").replace("~0", "~") for part in path[1:].split("/")]


def json6902(obj: dict, ops: list[dict]) -> dict:
    obj = copy.deepcopy(obj)
    for op in ops:
        parts = _pointer(op["path"])
        parent: Any = obj
        for part in parts[:-1]:
            parent = parent[int(part)] if isinstance(parent, list) else parent[part]
        last = parts[-1]
        kind = op["op"]
        if isinstance(parent, list):
            index = len(parent) if last == "-" else int(last)
            if kind == "add":
                parent.insert(index, copy.deepcopy(op["value"]))
            elif kind == "replace":
                parent[index] = copy.deepcopy(op["value"])
            elif kind == "remove":
                parent.pop(index)
            else:
                raise KustomizeError(f"JSON patch op not supported here: {kind}")
        else:
            if kind in ("add", "replace"):
                if kind == "replace" and last not in parent:
                    raise KustomizeError(f"JSON patch replace of a missing path {op['path']}")
                parent[last] = copy.deepcopy(op["value"])
            elif kind == "remove":
                del parent[last]
            else:
                raise KustomizeError(f"JSON patch op not supported here: {kind}")
    return obj


def _apply_patches(root: str, kust: dict, objects: list[dict]) -> None:
    for entry in kust.get("patches") or []:
        if set(entry) - {"path", "patch", "target"}:
            raise KustomizeError(f"{root}: patch fields not supported here: {sorted(set(entry) - {'path', 'patch', 'target'})}")
        if "path" in entry:
            with open(_inside(root, entry["path"])) as f:
                text = f.read()
        else:
            text = entry["patch"]
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
        target = entry.get("target") or {}
        if set(target) - {"kind", "name"}:
            raise KustomizeError(f"{root}: patch target fields not supported here: {sorted(target)}")
        for doc in docs:
            if isinstance(doc, list):  # JSON 6902
                if not target:
                    raise KustomizeError(f"{root}: a JSON 6902 patch needs a target")
                matches = _find(objects, target.get("kind"), target.get("name"))
                if not matches:
                    raise KustomizeError(f"{root}: patch target {target} matches nothing")
                for obj in matches:
                    objects[objects.index(obj)] = json6902(obj, doc)
                continue
            kind = target.get("kind", doc.get("kind"))  # with a target, the patch's own name does not count
            name = target.get("name") if target else (doc.get("metadata") or {}).get("name")
            matches = _find(objects, kind, name)
            if not matches:
                raise KustomizeError(f"{root}: patch of {kind}/{name} matches nothing")
            for obj in matches:
                if doc.get("$patch") == "delete":
                    objects.remove(obj)
                    continue
                patched = strategic_merge(obj, {k: v for k, v in doc.items() if k not in ("apiVersion", "kind")})
                patched["metadata"]["name"] = obj["metadata"]["name"]
                objects[objects.index(obj)] = patched


# --- other transformers ---------------------------------------------------------------------------

def _containers(obj: dict) -> list[dict]:
    spec = obj.get("spec") or {}
    pod = (spec.get("template") or {}).get("spec") if "template" in spec else \
        ((spec.get("jobTemplate") or {}).get("spec") or {}).get("template", {}).get("spec")
    if pod is None and obj.get("kind") == "Pod":
        pod = spec
    if not pod:
        return []
    return list(pod.get("initContainers") or []) + list(pod.get("containers") or [])


def _set_images(kust: dict, objects: list[dict]) -> None:
    for image in kust.get("images") or []:
        if set(image) - {"name", "newName", "newTag", "digest"}:
            raise KustomizeError(f"image fields not supported here: {sorted(image)}")
        for obj in objects:
            for container in _containers(obj):
                ref = container.get("image", "")
                name, tag = ref, None
                if "@" in ref:
                    ref = ref.split("@", 1)[0]
                if ":" in ref.rsplit("/", 1)[-1]:
                    name, tag = ref.rsplit(":", 1)
                else:
                    name = ref
                if name != image["name"]:
                    continue
                new = image.get("newName", name)
                if image.get("digest") and image.get("newTag"):  # kustomize keeps both: name:tag@digest
                    container["image"] = f"{new}:{image['newTag']}@{image['digest']}"
                elif image.get("digest"):
                    container["image"] = f"{new}@{image['digest']}"
                elif image.get("newTag") or tag:
                    container["image"] = f"{new}:{image.get('newTag') or tag}"
                else:
                    container["image"] = new


def _set_namespace(namespace: str, objects: list[dict]) -> None:
    for obj in objects:
        if obj.get("kind") not in CLUSTER_SCOPED:
            obj.setdefault("metadata", {})["namespace"] = namespace


# --- build ----------------------------------------------------------------------------------------

def build(folder: str, _parent: list[dict] | None = None) -> list[dict]:
    """The objects `folder`'s kustomization renders to (a Component is applied to `_parent`)."""
    path = _kustomization_file(folder)
    with open(path) as f:
        kust = yaml.safe_load(f) or {}
    unknown = set(kust) - KNOWN_FIELDS
    if unknown:
        raise KustomizeError(f"{path}: fields not supported by this renderer: {sorted(unknown)}")
    component = kust.get("kind") == "Component"
    if component and _parent is None:
        raise KustomizeError(f"{path}: a Component is rendered only through a kustomization that lists it")
    if not component and _parent is not None:
        raise KustomizeError(f"{path}: listed under components but is not a Component")
    objects = _parent if component else []
    for entry in kust.get("resources") or []:
        target = os.path.normpath(os.path.join(folder, entry))
        if os.path.isdir(target):
            objects.extend(build(target))
        else:
            objects.extend(_read_yaml_docs(_inside(folder, entry)))
    for entry in kust.get("components") or []:
        build(os.path.normpath(os.path.join(folder, entry)), objects)
    _run_generators(folder, kust, objects)
    _apply_patches(folder, kust, objects)
    if kust.get("namespace"):
        _set_namespace(kust["namespace"], objects)
    _set_images(kust, objects)
    seen: set[tuple[str, str, str]] = set()
    for obj in objects:
        if _key(obj) in seen:
            raise KustomizeError(f"{path}: {_key(obj)} defined twice")
        seen.add(_key(obj))
    return objects


def _refuse_stale(folder: str) -> None:
    """An overlay made from a settings.yaml (deploy/k8s/settings.py) whose files are not what the
    settings make now is refused: what it would render is not what the settings say."""
    if not os.path.isfile(os.path.join(folder, "settings.yaml")):
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    try:
        import settings
    finally:
        sys.path.pop(0)
    try:
        names = settings.stale(folder)
    except settings.SettingsError as exc:
        raise KustomizeError(str(exc)) from None
    if names:
        raise KustomizeError(f"{folder}: {', '.join(names)} differ from what its settings.yaml makes: "
                             "run `make deploy-config` (python deploy/k8s/settings.py) first")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: kustomize.py DIRECTORY", file=sys.stderr)
        return 2
    try:
        _refuse_stale(argv[0])
        objects = build(argv[0])
    except (KustomizeError, OSError, yaml.YAMLError) as exc:
        print(f"kustomize.py: error: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(yaml.safe_dump_all(objects, sort_keys=False))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
