"""Helm rendering and Kubernetes validation for tests/deploy, run by the tools' own venv.

helm-python-sdk (Helm v4's Go SDK), kubernetes-validate and checkov pin packages the project's
venv cannot take (numpy 2, packaging 23), so they live in ``.venv-deploy`` (``make deploy-venv``)
and the tests call this script there: one JSON request on stdin, one JSON answer on stdout.

Requests (``op``):

- ``render``: ``{"chart", "name", "namespace", "sets": {label: [values YAML text, ...]}}`` ->
  ``{label: {"ok": true, "manifests": {template: text}} | {"ok": false, "error": message}}``.
  A set's YAML documents are parsed by Helm (``values_from_yaml``) and merged in order as
  ``helm -f a.yaml -f b.yaml`` merges them (maps key by key, anything else replaced).
- ``lint``: like render, with ``kube_version``: ``{label: Helm's lint report}`` (``helm lint --strict``).
- ``package``: ``{"chart", "dest", "name", "namespace"}``: ``helm package`` into ``dest``, then the
  archive loaded back and rendered with its defaults: ``{"archive", "files", "manifests"}``.
- ``validate``: ``{"objects": [{"where", "object"}], "kube_versions", "crds"}`` -> one result per
  object and version: built-in kinds strictly against kubernetes-validate's schemas of that
  Kubernetes version; kinds defined by a CRD in ``crds`` (``*.yaml`` or ``*.yaml.gz``) against
  that CRD's ``openAPIV3Schema`` made strict (unknown fields refused, as the API server's strict
  field validation does) and their ``metadata`` against the version's ObjectMeta.

From a shell it is also ``helm template`` without the helm binary (docs/kubernetes.md)::

    .venv-deploy/bin/python tests/deploy/k8s_tool.py template deploy/helm/tritonguard \
        -f deploy/helm/tritonguard/examples/gpu.yaml --name tg --namespace serving
"""

from __future__ import annotations

import copy
import functools
import gzip
import json
import sys
from pathlib import Path
from typing import Any


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _values(texts: list[str]) -> dict:
    import helm_python  # noqa: PLC0415

    merged: dict = {}
    for text in texts:
        merged = _merge(merged, helm_python.values_from_yaml(text) or {})
    return merged


def render(req: dict) -> dict:
    import helm_python  # noqa: PLC0415

    out = {}
    with helm_python.Chart.load(req["chart"]) as chart:
        for label, texts in req["sets"].items():
            try:
                manifests = chart.render(_values(texts), name=req["name"], namespace=req["namespace"],
                                         is_install=True)
                out[label] = {"ok": True, "manifests": manifests}
            except helm_python.HelmError as exc:
                out[label] = {"ok": False, "error": str(exc), "type": type(exc).__name__}
    return out


def lint(req: dict) -> dict:
    import helm_python  # noqa: PLC0415

    return {label: helm_python.lint(req["chart"], _values(texts), strict=True, namespace=req["namespace"],
                                    kube_version=req["kube_version"])
            for label, texts in req["sets"].items()}


def package(req: dict) -> dict:
    import helm_python  # noqa: PLC0415

    archive = helm_python.package(req["chart"], destination=req["dest"])
    with helm_python.Chart.load(archive) as chart:
        return {"archive": archive, "files": {f["name"]: f["data"] for f in chart.files},
                "manifests": chart.render({}, name=req["name"], namespace=req["namespace"], is_install=True)}


# -- validation ---------------------------------------------------------------------------------
def _strict(schema: Any) -> Any:
    """A CRD's structural schema with unknown fields refused where the API server prunes them."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if out.pop("x-kubernetes-int-or-string", False):
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@functools.cache
def _crds(directory: str) -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> strict schema, for every served version of every CRD in ``directory``."""
    import yaml  # noqa: PLC0415

    found: dict[tuple[str, str], dict] = {}
    for path in sorted(Path(directory).iterdir()):
        if path.name.endswith(".yaml.gz"):
            text = gzip.decompress(path.read_bytes()).decode()
        elif path.suffix == ".yaml":
            text = path.read_text()
        else:
            continue
        for doc in yaml.load_all(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
            if not doc or doc.get("kind") != "CustomResourceDefinition":
                continue
            group, kind = doc["spec"]["group"], doc["spec"]["names"]["kind"]
            for version in doc["spec"]["versions"]:
                if version.get("served", True):
                    schema = copy.deepcopy(version["schema"]["openAPIV3Schema"])
                    found[(f"{group}/{version['name']}", kind)] = _strict(schema)
    return found


@functools.cache
def _object_meta(kube_version: str) -> Any:
    """A validator of ``kube_version``'s strict ObjectMeta schema (kubernetes-validate's files,
    resolved the way its own ``validate`` resolves them)."""
    import jsonschema  # noqa: PLC0415
    import kubernetes_validate.utils as kvu  # noqa: PLC0415
    from referencing import Registry, Resource  # noqa: PLC0415

    want = kvu.major_minor(kube_version)
    version = [v for v in kvu.all_versions() if kvu.major_minor(v) == want][-1]
    folder = f"kubernetes-json-schema/v{version}-local-strict"
    schema = kvu.schema_contents(f"{folder}/objectmeta-meta-v1.json", kube_version)
    registry = Resource.from_contents(kvu.schema_contents(f"{folder}/_definitions.json", kube_version)) @ (
        Resource.from_contents(schema) @ Registry())
    return jsonschema.Draft202012Validator(schema, registry=registry)


def _crd_errors(obj: dict, schema: dict, kube_version: str) -> list[str]:
    import jsonschema  # noqa: PLC0415

    body = {k: v for k, v in obj.items() if k != "metadata"}
    errors = [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
              for e in jsonschema.Draft7Validator({**schema, "properties": {
                  k: v for k, v in schema.get("properties", {}).items() if k != "metadata"}}).iter_errors(body)]
    errors += [f"metadata.{'.'.join(map(str, e.absolute_path))}: {e.message}"
               for e in _object_meta(kube_version).iter_errors(obj.get("metadata") or {})]
    return errors


def validate(req: dict) -> list[dict]:
    import kubernetes_validate  # noqa: PLC0415
    import kubernetes_validate.utils as kvu  # noqa: PLC0415

    # its validate() reads and parses the version's schema files (1.3 MB of definitions) for every
    # object: read each once (the parsed schemas are only read, never changed)
    if not hasattr(kvu.schema_contents, "cache_info"):
        kvu.schema_contents = functools.lru_cache(maxsize=None)(kvu.schema_contents)

    crds = _crds(req["crds"])
    results = []
    for item in req["objects"]:
        obj = item["object"]
        api, kind = obj.get("apiVersion", ""), obj.get("kind", "")
        name = (obj.get("metadata") or {}).get("name", "")
        for kube in req["kube_versions"]:
            result = {"where": item["where"], "kind": kind, "name": name, "kube_version": kube}
            if (api, kind) in crds:
                errors = _crd_errors(obj, crds[(api, kind)], kube)
                result.update(validator="crd", errors=errors)
            else:
                try:
                    kubernetes_validate.validate(obj, kube, strict=True)
                    result.update(validator="kubernetes-validate", errors=[])
                except kubernetes_validate.SchemaNotFoundError as exc:
                    result.update(validator="none", errors=[exc.message])
                except kubernetes_validate.ValidationError as exc:
                    path = ".".join(map(str, exc.path)) or "<root>"
                    result.update(validator="kubernetes-validate", errors=[f"{path}: {exc.message}"])
            results.append(result)
    return results


OPS = {"render": render, "lint": lint, "package": package, "validate": validate}


def template(argv: list[str]) -> int:
    """``helm template NAME CHART -f VALUES… -n NAMESPACE``: every manifest, as helm prints them."""
    import argparse  # noqa: PLC0415

    parser = argparse.ArgumentParser(prog="k8s_tool.py template", description=template.__doc__)
    parser.add_argument("chart")
    parser.add_argument("-f", "--values", action="append", default=[], help="a values file (repeat)")
    parser.add_argument("--name", default="tritonguard")
    parser.add_argument("-n", "--namespace", default="default")
    args = parser.parse_args(argv)
    texts = [Path(f).read_text() for f in args.values]
    answer = render({"chart": args.chart, "name": args.name, "namespace": args.namespace,
                     "sets": {"cli": texts}})["cli"]
    if not answer["ok"]:
        sys.stderr.write(f"Error: {answer['error']}\n")
        return 1
    for name, text in sorted(answer["manifests"].items()):
        if text.strip() and not name.endswith("NOTES.txt"):
            sys.stdout.write(f"---\n# Source: {name}\n{text.strip()}\n")
    return 0


def main() -> int:
    if sys.argv[1:2] == ["template"]:
        return template(sys.argv[2:])
    req = json.load(sys.stdin)
    json.dump(OPS[req["op"]](req), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
