"""What the Helm chart renders (Helm's own engine, through helm-python-sdk): the working set of the
default values, a GPU request, the server's flags and probes, the secrets' wiring to the names
tritonguard's code reads, and the monitoring objects from their single source files."""

from __future__ import annotations

import base64
import json
import re

import pytest
import yaml

from tests.deploy.conftest import (
    CHART,
    EXAMPLES,
    NAMESPACE,
    RELEASE,
    ROOT,
    by_kind,
    documents,
    one,
    run_tool,
)

FULL = f"{RELEASE}-tritonguard"


def _server(docs) -> dict:
    return one(docs, "Deployment", FULL)["spec"]["template"]["spec"]


def _container(docs) -> dict:
    (c,) = [c for c in _server(docs)["containers"] if c["name"] == "tritonserver"]
    return c


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def _dockerfile_cmd() -> list[str]:
    text = (ROOT / "Dockerfile").read_text()
    m = re.search(r"^CMD (\[.*?\])\s*$", text, re.M | re.S)
    assert m, "the Dockerfile has no JSON CMD"
    return json.loads(m.group(1).replace("\\\n", ""))


def test_default_values_render_the_working_set(docs):
    d = docs["default"]
    kinds = {(doc["kind"], doc["metadata"]["name"]) for _, doc in d}
    expected = {
        ("Deployment", FULL), ("Service", FULL), ("Service", f"{FULL}-grpc"), ("Service", f"{FULL}-metrics"),
        ("Service", f"{FULL}-headless"), ("PodDisruptionBudget", FULL), ("ServiceMonitor", FULL),
        ("PrometheusRule", FULL), ("StatefulSet", f"{FULL}-redis"), ("Service", f"{FULL}-redis"),
        ("Secret", f"{FULL}-redis"), ("Secret", f"{FULL}-keys"), ("ConfigMap", f"{FULL}-dashboard"),
        ("NetworkPolicy", FULL), ("NetworkPolicy", f"{FULL}-redis"), ("ServiceAccount", FULL),
    }
    assert expected <= kinds, f"missing: {sorted(expected - kinds)}"
    # nothing optional by default: no HPA, no rollout Job, no claim for models, no GPU
    assert not {"HorizontalPodAutoscaler", "Job", "PersistentVolumeClaim"} & {k for k, _ in kinds}
    assert all(doc["metadata"].get("namespace") == NAMESPACE for _, doc in d)
    # each Service selects the server pods and exposes the one port its name says
    ports = {s["metadata"]["name"]: [(p["name"], p["port"]) for p in s["spec"]["ports"]]
             for s in by_kind(d, "Service")}
    assert ports[FULL] == [("http", 8000)]
    assert ports[f"{FULL}-grpc"] == [("grpc", 8001)]
    assert ports[f"{FULL}-metrics"] == [("metrics", 8002)]
    pdb = one(d, "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "server"


def test_server_runs_the_supervising_launcher_with_the_dockerfile_flags(docs):
    c = _container(docs["default"])
    assert c["command"] == ["/usr/local/bin/tritonserver"]
    cmd = _dockerfile_cmd()
    assert cmd[0] == c["command"][0], "the chart and the Dockerfile run different launchers"
    # every flag of the image's CMD but the repository (the chart's own) is passed as the image passes it
    for flag in cmd[1:]:
        if not flag.startswith("--model-repository="):
            assert flag in c["args"], f"{flag} (Dockerfile CMD) is missing from the chart's args"
    assert "--model-repository=/var/lib/tritonguard/models" in c["args"]
    env = _env(c)
    assert env["TRITONGUARD_SUPERVISE"]["value"] == "1"
    assert env["TRITONGUARD_STALL_S"]["value"] == "60"


def test_rendered_flags_read_back_by_the_supervisor(docs):
    """The supervisor parses the server's flags for its control URL, metrics and admin header:
    the rendered args, with the kubelet's $(VAR) expansion done, give it what it needs."""
    from tritonguard.ops.supervisor.control import (
        control_mode,
        http_base,
        metrics_url,
        repository_headers,
        with_default_control,
    )

    args = [a.replace("$(TRITONGUARD_ADMIN_KEY)", "k3y") for a in _container(docs["default"])["args"]]
    assert with_default_control(args) == args  # explicit mode is already there
    assert control_mode(args) == "explicit"
    assert http_base(args) == "http://127.0.0.1:8000"
    assert metrics_url(args) == "http://127.0.0.1:8002/metrics"
    assert repository_headers(args) == {"x-tritonguard-admin-key": "k3y"}


def test_probes_and_shm(docs):
    d = docs["default"]
    c = _container(d)
    assert c["startupProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    # model load time: the startup probe's budget, 10 min by default
    s = c["startupProbe"]
    assert s["periodSeconds"] * s["failureThreshold"] == 600
    volumes = {v["name"]: v for v in _server(d)["volumes"]}
    assert volumes["shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}
    assert {"name": "shm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    # the GPU example sizes both for big models
    g = _container(docs["examples/gpu.yaml"])
    assert g["startupProbe"]["failureThreshold"] == 120
    assert {v["name"]: v for v in _server(docs["examples/gpu.yaml"])["volumes"]}["shm"]["emptyDir"]["sizeLimit"] == "4Gi"


def test_gpu_true_requests_a_gpu(docs):
    assert "nvidia.com/gpu" not in json.dumps(_container(docs["default"])["resources"])
    res = _container(docs["default+gpu"])["resources"]
    assert res["requests"]["nvidia.com/gpu"] == 2 and res["limits"]["nvidia.com/gpu"] == 2
    assert "--allow-gpu-metrics=true" in _container(docs["default+gpu"])["args"]
    gpu = _server(docs["examples/gpu.yaml"])
    assert _container(docs["examples/gpu.yaml"])["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert gpu["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert "requiredDuringSchedulingIgnoredDuringExecution" in gpu["affinity"]["podAntiAffinity"]


def test_pod_security(docs):
    """Non-root (the image's uid 1000), no privilege escalation, no capabilities, read-only root
    filesystem with emptyDirs where something writes, no service account token."""
    for label, d in docs.items():
        for kind in ("Deployment", "StatefulSet", "Job"):
            for obj in by_kind(d, kind):
                pod = obj["spec"]["template"]["spec"]
                assert pod["securityContext"]["runAsNonRoot"] is True, (label, kind)
                assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
                assert pod["automountServiceAccountToken"] is False
                for c in pod.get("initContainers", []) + pod["containers"]:
                    sc = c["securityContext"]
                    assert sc["allowPrivilegeEscalation"] is False, (label, c["name"])
                    assert sc["readOnlyRootFilesystem"] is True, (label, c["name"])
                    assert sc["capabilities"]["drop"] == ["ALL"], (label, c["name"])
                    assert "limits" in c["resources"] and "requests" in c["resources"], (label, c["name"])
    mounts = {m["mountPath"] for m in _container(docs["default"])["volumeMounts"]}
    assert {"/tmp", "/dev/shm", "/var/cache/tritonguard", "/var/lib/tritonguard"} <= mounts


def test_repository_sources(docs):
    # image: the example models copied into a writable emptyDir before the server starts
    pod = _server(docs["default"])
    (init,) = pod["initContainers"]
    assert {e["name"]: e["value"] for e in init["env"]} == {"REPOSITORY": "/var/lib/tritonguard/models",
                                                            "IMAGE_MODELS": "/models"}
    assert "emptyDir" in {v["name"]: v for v in pod["volumes"]}["data"]
    # pvc: the claim, created and kept on uninstall
    pvc_docs = docs["examples/pvc.yaml"]
    claim = one(pvc_docs, "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert {v["name"]: v for v in _server(pvc_docs)["volumes"]}["data"]["persistentVolumeClaim"] == {
        "claimName": claim["metadata"]["name"]}
    # s3: Triton reads the URL, AWS_* come from the named Secret, nothing is mounted for models
    c = _container(docs["examples/s3.yaml"])
    assert "--model-repository=s3://models-bucket/tritonguard/repository" in c["args"]
    env = _env(c)
    assert env["AWS_DEFAULT_REGION"]["value"] == "eu-west-1"
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert env[key]["valueFrom"]["secretKeyRef"] == {"name": "models-s3", "key": key}
    assert "data" not in {v["name"] for v in _server(docs["examples/s3.yaml"])["volumes"]}
    assert "initContainers" not in _server(docs["examples/s3.yaml"])


def test_store_bundled_and_external(docs):
    from tritonguard.core.store import ENV_URL

    d = docs["default"]
    env = _env(_container(d))
    # bundled: the URL is composed from the Redis Secret by the kubelet; the password stays in the Secret
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": f"{FULL}-redis", "key": "password"}
    assert env[ENV_URL]["value"] == f"redis://:$(REDIS_PASSWORD)@{FULL}-redis.{NAMESPACE}.svc:6379/0"
    names = [e["name"] for e in _container(d)["env"]]
    assert names.index("REDIS_PASSWORD") < names.index(ENV_URL), "$(REDIS_PASSWORD) must be defined first"
    redis = one(d, "StatefulSet", f"{FULL}-redis")
    rc = redis["spec"]["template"]["spec"]["containers"][0]
    assert "--appendonly yes" in rc["args"][0] and "--appendfsync everysec" in rc["args"][0]
    assert redis["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "2Gi"
    password = base64.b64decode(one(d, "Secret", f"{FULL}-redis")["data"]["password"]).decode()
    assert re.fullmatch(r"[A-Za-z0-9]{32}", password)
    # external: no Redis at all, the URL from the user's Secret
    x = docs["examples/external-redis.yaml"]
    assert not by_kind(x, "StatefulSet")
    assert _env(_container(x))[ENV_URL]["valueFrom"]["secretKeyRef"] == {"name": "tritonguard-state", "key": "url"}


def test_secret_env_names_are_the_ones_the_code_reads(docs, tmp_path):
    from tritonguard.core.config import env_parameters
    from tritonguard.privacy.audit.anchors import KEY_ENV
    from tritonguard.privacy.cache.config import CacheConfig
    from tritonguard.privacy.tenancy.config import TenancyConfig

    env = _env(_container(docs["examples/pvc.yaml"]))
    refs = {name: e["valueFrom"]["secretKeyRef"]["key"] for name, e in env.items()
            if "secretKeyRef" in e.get("valueFrom", {})}
    assert refs[TenancyConfig().jwt_secret_env] == "tenant-jwt-secret"
    assert refs[CacheConfig().key_env] == "cache-encryption-key"
    assert refs[KEY_ENV] == "audit-key"
    assert refs["TRITONGUARD_ADMIN_KEY"] == "admin-key"
    # the tenant keys file and the fleet-wide parameters reach the guards through the environment layer
    plain = {name: e["value"] for name, e in env.items() if "value" in e}
    layer = env_parameters(environ=plain)
    assert layer["tenancy.keys_file"] == "/etc/tritonguard/tenant-keys/tenant-keys.toml"
    assert layer["validation.max_payload_bytes"] == "1048576"
    assert layer["cache.l2_path"] == "/var/cache/tritonguard/l2.db"
    server = _server(docs["examples/pvc.yaml"])
    mount = [m for m in _container(docs["examples/pvc.yaml"])["volumeMounts"] if m["name"] == "tenant-keys"]
    assert mount == [{"name": "tenant-keys", "mountPath": "/etc/tritonguard/tenant-keys", "readOnly": True}]
    vol = {v["name"]: v for v in server["volumes"]}["tenant-keys"]["secret"]
    assert vol["items"] == [{"key": "tenant-keys.toml", "path": "tenant-keys.toml"}]
    # the file the Secret carries is one the guards can read
    from tritonguard.privacy.tenancy.auth import read_keys_file

    keys = one(docs["examples/pvc.yaml"], "Secret", f"{FULL}-keys")["data"]["tenant-keys.toml"]
    path = tmp_path / "tenant-keys.toml"
    path.write_bytes(base64.b64decode(keys))
    assert set(read_keys_file(path, TenancyConfig().pattern).values()) == {"acme"}


def test_secret_values_appear_only_in_secrets(tmp_path):
    values = {"secrets": {"tenantJwtSecret": "jwt-secret-0123456789-0123456789-abcdef",
                          "cacheEncryptionKey": "ab" * 32,
                          "auditKey": "audit-key-0123456789",
                          "tenantKeys": '"acme" = ["' + "c" * 64 + '"]\n'},
              "adminApi": {"key": "admin-key-0123456789"},
              "redis": {"password": "redis-password-0123456789"},
              "modelRepository": {"source": "s3", "s3": {"url": "s3://b/p", "accessKeyId": "AKIAEXAMPLEKEY0001",
                                                         "secretAccessKey": "s3-secret-0123456789"}}}
    answer = run_tool("render", chart=str(CHART), name=RELEASE, namespace=NAMESPACE,
                      sets={"secrets": [yaml.safe_dump(values)]})["secrets"]
    assert answer["ok"], answer
    secrets = [*values["secrets"].values(), values["adminApi"]["key"], values["redis"]["password"],
               values["modelRepository"]["s3"]["accessKeyId"], values["modelRepository"]["s3"]["secretAccessKey"]]
    found_in_secrets = set()
    for _, doc in documents(answer["manifests"]):
        text = yaml.safe_dump(doc)
        for secret in secrets:
            encoded = base64.b64encode(secret.encode()).decode()
            if doc["kind"] == "Secret":
                if encoded in text:
                    found_in_secrets.add(secret)
            else:
                assert secret not in text and encoded not in text, f"{secret!r} leaks into {doc['kind']}"
    assert found_in_secrets == set(secrets)


def test_prometheus_rule_is_rules_yml(docs):
    """One source of truth: the chart reads deploy/prometheus/rules.yml through a link."""
    link = CHART / "files" / "rules.yml"
    assert link.is_symlink() and link.resolve() == (ROOT / "deploy" / "prometheus" / "rules.yml").resolve()
    source = yaml.safe_load((ROOT / "deploy" / "prometheus" / "rules.yml").read_text())
    for label, d in docs.items():
        rule = one(d, "PrometheusRule")
        assert rule["spec"]["groups"] == source["groups"], label
        assert set(rule["spec"]) == {"groups"}


def test_dashboard_configmap_is_the_dashboard(docs):
    link = CHART / "files" / "tritonguard.json"
    assert link.is_symlink() and link.resolve() == (ROOT / "deploy" / "grafana" / "tritonguard.json").resolve()
    cm = one(docs["default"], "ConfigMap", f"{FULL}-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["data"]["tritonguard.json"] == (ROOT / "deploy" / "grafana" / "tritonguard.json").read_text()


def test_service_monitor_scrapes_the_metrics_service(docs):
    d = docs["default"]
    sm = one(d, "ServiceMonitor")
    metrics = one(d, "Service", f"{FULL}-metrics")
    selector = sm["spec"]["selector"]["matchLabels"]
    assert all(metrics["metadata"]["labels"].get(k) == v for k, v in selector.items())
    # and only that Service: the HTTP and gRPC Services do not match
    for name in (FULL, f"{FULL}-grpc"):
        labels = one(d, "Service", name)["metadata"]["labels"]
        assert not all(labels.get(k) == v for k, v in selector.items())
    assert sm["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "15s"}]


def test_autoscaler_on_triton_queue_time(docs):
    d = docs["examples/pvc.yaml"]
    hpa = one(d, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": FULL}
    (metric,) = hpa["spec"]["metrics"]
    assert metric["pods"]["metric"]["name"] == "avg_time_queue_us"
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "10000"}
    # the HPA owns the replica count
    assert "replicas" not in one(d, "Deployment", FULL)["spec"]


def test_rollout_job(docs):
    job = one(docs["examples/pvc.yaml"], "Job")
    assert job["metadata"]["name"] == f"{FULL}-promote-digits-v2"
    spec = job["spec"]
    assert spec["backoffLimit"] == 0 and spec["template"]["spec"]["restartPolicy"] == "Never"
    (c,) = spec["template"]["spec"]["containers"]
    env = _env(c)
    assert env["REPOSITORY"]["value"] == "/var/lib/tritonguard/models"
    assert env["TRITONGUARD_REPLICAS"]["value"] == f"{FULL}-headless.{NAMESPACE}.svc"
    # the same store and admin key as the servers
    server_env = _env(_container(docs["examples/pvc.yaml"]))
    for name in ("REDIS_PASSWORD", "TRITONGUARD_STATE_URL", "TRITONGUARD_ADMIN_KEY"):
        assert env[name] == server_env[name], name
    # the same claim as the servers, at the same place
    volumes = {v["name"]: v for v in spec["template"]["spec"]["volumes"]}
    assert volumes["data"]["persistentVolumeClaim"]["claimName"] == f"{FULL}-models"
    assert c["args"][1:] == ["promote", "--steps=5,25,50,100", "--dwell-s=300", "--max-cost-increase=10%"]
    headless = one(docs["examples/pvc.yaml"], "Service", f"{FULL}-headless")
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is False


def test_examples_are_all_rendered():
    """Every file in examples/ is one of the rendered sets (value_sets reads the folder)."""
    assert {p.name for p in EXAMPLES} >= {"gpu.yaml", "s3.yaml", "external-redis.yaml", "pvc.yaml"}


@pytest.mark.parametrize("example, edit, message", [
    ("gpu.yaml", ("gpuCount: 1", "gpuCount: one"), "/gpuCount"),
    ("gpu.yaml", ("gpu: true", "gpu: \"yes\""), "/gpu"),
    ("gpu.yaml", ("podAntiAffinity: hard", "podAntiAffinity: strict"), "/podAntiAffinity"),
    ("s3.yaml", ("url: s3://models-bucket", "url: https://models-bucket"), "/modelRepository/s3/url"),
    ("s3.yaml", ("  source: s3", "  source: nfs"), "/modelRepository/source"),
    ("external-redis.yaml", ("mode: external", "mode: sentinel"), "/store/mode"),
    ("pvc.yaml", ("  version: 2", "  version: 0"), "/rollout/version"),
    ("pvc.yaml", ("autoscaling:", "autoscale:"), "additional properties 'autoscale' not allowed"),
    ("pvc.yaml", ("  source: pvc", "  source: image"), "/modelRepository/source"),
    ("pvc.yaml", ("  auditKey: example-audit-anchor-key-change-me", "  auditKey: short"), "/secrets/auditKey"),
])
def test_a_wrong_value_in_an_example_is_refused(tmp_path, example, edit, message):
    """A broken copy of an example values file fails to render, and the message names the value."""
    text = (CHART / "examples" / example).read_text()
    old, new = edit
    assert text.count(old) == 1, f"{example} no longer holds {old!r}: update this test"
    broken = tmp_path / example
    broken.write_text(text.replace(old, new))
    answer = run_tool("render", chart=str(CHART), name=RELEASE, namespace=NAMESPACE,
                      sets={"broken": [broken.read_text()], "intact": [text]})
    assert answer["intact"]["ok"], answer["intact"]
    assert not answer["broken"]["ok"], f"{example} with {new!r} rendered"
    assert answer["broken"]["type"] == "HelmValuesError"
    assert message in answer["broken"]["error"], answer["broken"]["error"]


def test_external_store_needs_a_url():
    answer = run_tool("render", chart=str(CHART), name=RELEASE, namespace=NAMESPACE,
                      sets={"no-url": ["store: {mode: external}"],
                            "url": ["store: {mode: external, external: {url: 'rediss://:pw@redis:6380/0'}}"],
                            "bad-password": ["redis: {password: 'p@ss:word/with-specials'}"]})
    assert not answer["no-url"]["ok"] and "/store/external" in answer["no-url"]["error"]
    assert answer["url"]["ok"]
    assert not answer["bad-password"]["ok"] and "/redis/password" in answer["bad-password"]["error"]


def test_network_policies(docs):
    d = docs["default"]
    servers = one(d, "NetworkPolicy", FULL)
    api, metrics, job_rule = servers["spec"]["ingress"]
    # default: HTTP/gRPC from the release's namespace only, metrics from there and from `monitoring`
    assert {p["port"] for p in api["ports"]} == {"http", "grpc"}
    assert api["from"] == [{"podSelector": {}}]
    assert {p["port"] for p in metrics["ports"]} == {"metrics"}
    assert metrics["from"] == [{"podSelector": {}},
                               {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    assert job_rule["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "rollout"
    assert {q["port"] for q in job_rule["ports"]} == {"http", "metrics"}
    redis = one(d, "NetworkPolicy", f"{FULL}-redis")
    components = {peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
                  for peer in redis["spec"]["ingress"][0]["from"]}
    assert components == {"server", "rollout"}
    # every rule of every values set names its sources: no port is open to any source
    for label, x in docs.items():
        for rule in one(x, "NetworkPolicy", FULL)["spec"]["ingress"]:
            assert rule.get("from"), f"{label}: a rule without sources {rule}"
    # with `from` set, those peers replace the namespace; the rollout Job still reaches HTTP and metrics
    p = one(docs["examples/pvc.yaml"], "NetworkPolicy", FULL)["spec"]["ingress"]
    assert len(p) == 3 and len(p[0]["from"]) == 2 and {"podSelector": {}} not in p[0]["from"]
    assert p[1]["from"][:2] == p[0]["from"]
    assert p[2]["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "rollout"
    assert {q["port"] for q in p[2]["ports"]} == {"http", "metrics"}
    job = one(docs["examples/pvc.yaml"], "NetworkPolicy", f"{FULL}-rollout")
    assert job["spec"]["policyTypes"] == ["Ingress"] and "ingress" not in job["spec"]


def test_network_policy_sources_cannot_be_emptied():
    """An empty `from` used to mean "from anywhere": now it is refused, and every source open has
    to be written out as an ipBlock."""
    answer = run_tool("render", chart=str(CHART), name=RELEASE, namespace=NAMESPACE, sets={
        "empty": ["networkPolicy: {servers: {from: []}}"],
        "bad-peer": ["networkPolicy: {servers: {from: [{podSelectr: {}}]}}"],
        "anywhere": ["networkPolicy: {servers: {from: [{ipBlock: {cidr: 0.0.0.0/0}}], metricsFrom: []}}"]})
    assert not answer["empty"]["ok"] and "/networkPolicy/servers/from" in answer["empty"]["error"]
    assert not answer["bad-peer"]["ok"] and "podSelectr" in answer["bad-peer"]["error"]
    assert answer["anywhere"]["ok"], answer["anywhere"]
    rules = one(documents(answer["anywhere"]["manifests"]), "NetworkPolicy", FULL)["spec"]["ingress"]
    assert rules[0]["from"] == rules[1]["from"] == [{"ipBlock": {"cidr": "0.0.0.0/0"}}]


ADMIN_APIS = {"shared-memory", "model-repository", "model-config", "trace", "logging"}


def test_every_admin_api_is_restricted_on_both_frontends(docs):
    """Issue 39 item 6: the pods listen on the pod network, so every API that changes the server
    (client shared-memory registration, load/unload, configs, trace, logging) needs the admin key,
    in every values set; the launcher, reading the kubelet-expanded flags, finds nothing left open."""
    from tritonguard.ops import launcher
    from tritonguard.ops.supervisor.control import repository_headers

    for label, d in docs.items():
        c = _container(d)
        assert _env(c)["TRITONGUARD_ADMIN_KEY"]["valueFrom"]["secretKeyRef"]["key"] == "admin-key", label
        for flag in ("--http-restricted-api", "--grpc-restricted-protocol"):
            (spec,) = [a.split("=", 1)[1] for a in c["args"] if a.startswith(flag + "=")]
            apis, _, kv = spec.partition(":")
            assert set(apis.split(",")) == ADMIN_APIS, (label, flag)
            assert kv == "x-tritonguard-admin-key=$(TRITONGUARD_ADMIN_KEY)", (label, flag)
        args = [a.replace("$(TRITONGUARD_ADMIN_KEY)", "k3y") for a in c["args"]]
        assert launcher.exposed_frontends(args) == {"http": "0.0.0.0", "grpc": "0.0.0.0"}
        assert launcher.restrict_admin_apis(args, {"TRITONGUARD_ADMIN_KEY": "k3y"}) == args, label
        assert repository_headers(args) == {"x-tritonguard-admin-key": "k3y"}
    # the switch that turned the restriction off is gone: such values are refused
    answer = run_tool("render", chart=str(CHART), name=RELEASE, namespace=NAMESPACE,
                      sets={"off": ["adminApi: {restricted: false}"]})
    assert not answer["off"]["ok"] and "restricted" in answer["off"]["error"]


def _kubelet_env(container: dict, field_values: dict[str, str]) -> dict[str, str]:
    """The container's environment as the kubelet builds it: fieldRefs from ``field_values``,
    $(VAR) expanded from the variables defined before it (Kubernetes' rule)."""
    out: dict[str, str] = {}
    for e in container["env"]:
        if "value" in e:
            out[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: out.get(m.group(1), m.group(0)), e["value"])
        elif "fieldRef" in e.get("valueFrom", {}):
            out[e["name"]] = field_values[e["valueFrom"]["fieldRef"]["fieldPath"]]
    return out


def test_pods_advertise_their_own_ip(docs):
    """Issue 39 item 8: every pod used to register 127.0.0.1:8000, one registry key for the whole
    fleet. The address is the pod's IP from the downward API, so two pods register two replicas."""
    from tritonguard.ops.launcher import advertise_env
    from tritonguard.rollout.replicas import ENV_HOST, ENV_HTTP, replica_id

    for label, d in docs.items():
        c = _container(d)
        env = _env(c)
        assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}, label
        assert env[ENV_HOST]["value"] == "$(POD_IP)", label
        names = [e["name"] for e in c["env"]]
        assert names.index("POD_IP") < names.index(ENV_HOST), "$(POD_IP) expands only after POD_IP"
        assert ENV_HTTP not in env, f"{label}: a literal advertised URL would be the same on every pod"
        ids, urls = set(), set()
        for pod_ip in ("10.244.1.7", "10.244.2.9", "fd00:10:244::5"):
            advertised = advertise_env(c["args"], _kubelet_env(c, {"status.podIP": pod_ip}))
            assert advertised[ENV_HOST] == pod_ip
            ids.add(replica_id({"http": advertised[ENV_HTTP]}))
            urls.add(advertised[ENV_HTTP])
        assert ids == {"10.244.1.7:8000", "10.244.2.9:8000", "fd00:10:244::5:8000"}, label
        assert "http://[fd00:10:244::5]:8000" in urls


def test_server_env_accepts_value_from(tmp_path):
    """server.env takes plain values and downward-API / Secret references; the result is valid
    for Kubernetes (kubernetes-validate) and a malformed reference is refused by the schema."""
    values = {"server": {"env": {
        "NODE_NAME": {"valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        "EXTRA_TOKEN": {"valueFrom": {"secretKeyRef": {"name": "mine", "key": "token", "optional": True}}},
        "PLAIN": "text", "COUNT": 3, "FLAG": True}}}
    answer = run_tool("render", chart=str(CHART), name=RELEASE, namespace=NAMESPACE, sets={
        "ok": [yaml.safe_dump(values)],
        "no-source": ["server: {env: {X: {valueFrom: {}}}}"],
        "unknown-source": ["server: {env: {X: {valueFrom: {podIP: {}}}}}"],
        "value-key": ["server: {env: {X: {value: plain}}}"]})
    assert answer["ok"]["ok"], answer["ok"]
    for bad in ("no-source", "unknown-source", "value-key"):
        assert not answer[bad]["ok"] and "/server/env/X" in answer[bad]["error"], (bad, answer[bad])
    d = documents(answer["ok"]["manifests"])
    env = _env(_container(d))
    assert env["NODE_NAME"] == {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}
    assert env["EXTRA_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "mine", "key": "token", "optional": True}
    assert (env["PLAIN"]["value"], env["COUNT"]["value"], env["FLAG"]["value"]) == ("text", "3", "true")
    from tests.deploy.conftest import CRDS, KUBE_VERSIONS

    dep = one(d, "Deployment", FULL)
    results = run_tool("validate", objects=[{"where": "server.env valueFrom", "object": dep}],
                       kube_versions=list(KUBE_VERSIONS), crds=str(CRDS))
    assert len(results) == len(KUBE_VERSIONS) and not [r for r in results if r["errors"]], results


def test_update_strategy(docs):
    default = one(docs["default"], "Deployment", FULL)["spec"]["strategy"]["rollingUpdate"]
    assert default == {"maxSurge": 1, "maxUnavailable": 0}
    gpu = one(docs["examples/gpu.yaml"], "Deployment", FULL)["spec"]["strategy"]["rollingUpdate"]
    assert gpu == {"maxSurge": 0, "maxUnavailable": 1}


def test_release_sets_the_redis_namespace(docs):
    """Issue 39 item 3: two releases sharing one Redis (an external store) never share a key: the
    servers and the rollout Job of one release carry the same TRITONGUARD_NAMESPACE, made of the
    Kubernetes namespace and the release name, which the code accepts as a namespace."""
    from tritonguard.core.store import namespace, redis_prefix

    expected = f"{NAMESPACE}.{RELEASE}"
    for name in ("default", "examples/external-redis.yaml", "examples/pvc.yaml"):
        env = _env(_container(docs[name]))
        assert env["TRITONGUARD_NAMESPACE"] == {"name": "TRITONGUARD_NAMESPACE", "value": expected}, name
    (job,) = one(docs["examples/pvc.yaml"], "Job")["spec"]["template"]["spec"]["containers"]
    assert _env(job)["TRITONGUARD_NAMESPACE"]["value"] == expected
    env = {"TRITONGUARD_NAMESPACE": expected}
    assert namespace(env) == expected and redis_prefix("state", env) == f"tritonguard:{{{expected}}}:state:"
