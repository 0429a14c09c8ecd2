"""deploy/kubernetes validated offline: the built-in kinds against Kubernetes' own schemas
(kubernetes-validate, strict: an unknown field is an error), the ServiceMonitor against the
CRD schema kept beside it; the ConfigMap's zerod.toml is one zerod accepts; the DaemonSet
asks for the host access zerod needs and nothing more; the Containerfile runs as non-root."""

from __future__ import annotations

import copy
import json
import re
import tomllib

import jsonschema
import kubernetes_validate
import pytest
import yaml

from test_checks_helpers import REPO

K8S = REPO / "deploy" / "kubernetes"
VERSION = "1.30"  # the oldest Kubernetes the manifests target


def docs() -> dict[str, dict]:
    out = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            out[doc["kind"]] = doc
    return out


def servicemonitor_schema() -> dict:
    return json.loads((K8S / "schemas" / "servicemonitor-monitoring-v1.json").read_text())


def test_the_manifests_are_the_expected_kinds():
    assert set(docs()) == {"Namespace", "ConfigMap", "DaemonSet", "Service", "ServiceMonitor"}


@pytest.mark.parametrize("kind", ["Namespace", "ConfigMap", "DaemonSet", "Service"])
def test_builtin_kinds_pass_kubernetes_schemas(kind):
    assert kubernetes_validate.validate(docs()[kind], VERSION, strict=True)


def test_a_typo_is_caught():
    ds = copy.deepcopy(docs()["DaemonSet"])
    ds["spec"]["template"]["spec"]["hostPid"] = True  # hostPID misspelt
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, VERSION, strict=True)


def test_servicemonitor_has_no_builtin_schema_and_passes_the_crd_s():
    sm = docs()["ServiceMonitor"]
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate(sm, VERSION, strict=True)
    jsonschema.Draft202012Validator(servicemonitor_schema()).validate(sm)
    bad = copy.deepcopy(sm)
    bad["spec"]["endpoints"][0]["intervall"] = "15s"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(servicemonitor_schema()).validate(bad)
    bad["spec"]["endpoints"][0] = {"port": "metrics", "interval": "15 seconds"}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(servicemonitor_schema()).validate(bad)


def test_the_pieces_fit_together():
    d = docs()
    ds, svc, sm = d["DaemonSet"], d["Service"], d["ServiceMonitor"]
    pod = ds["spec"]["template"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    (c,) = pod["spec"]["containers"]
    container_ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= set(container_ports)
    assert {e["port"] for e in sm["spec"]["endpoints"]} <= {p["name"] for p in svc["spec"]["ports"]}
    config = pod["spec"]["volumes"][0]["configMap"]["name"]
    assert config == d["ConfigMap"]["metadata"]["name"]
    # the ports the config binds are the ones the pod exposes
    toml = tomllib.loads(d["ConfigMap"]["data"]["zerod.toml"])
    assert container_ports == {"http": toml["engine"]["port"], "metrics": toml["daemon"]["metrics_port"]}
    assert {x["metadata"]["namespace"] for x in (ds, svc, sm, d["ConfigMap"])} == {d["Namespace"]["metadata"]["name"]}


def test_the_configmap_is_a_config_zerod_accepts(tmp_path):
    from zerod.checks import DoctorConfig
    from zerod.config import load_config
    from zerod.daemon_config import DaemonConfig

    path = tmp_path / "zerod.toml"
    path.write_text(docs()["ConfigMap"]["data"]["zerod.toml"])
    cfg = load_config(path)
    daemon = DaemonConfig.from_dict(cfg["daemon"])
    doctor = DoctorConfig.from_config(cfg)
    assert daemon.metrics_host == "0.0.0.0" and doctor.bind_address == "0.0.0.0" and doctor.api_key_set


def test_the_daemonset_asks_for_what_zerod_needs_and_nothing_more():
    pod = docs()["DaemonSet"]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    sc = c["securityContext"]
    assert pod["hostPID"] is True and pod["runtimeClassName"] == "nvidia"
    assert not pod.get("hostNetwork") and not pod.get("hostIPC") and pod["automountServiceAccountToken"] is False
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["SYS_PTRACE"]}
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert not sc.get("privileged")
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    host_paths = [v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v]
    assert host_paths == ["/srv/models"]
    assert all(m.get("readOnly") for m in c["volumeMounts"] if m["name"] in ("models", "config"))
    # every privilege is explained in the header comment
    head = (K8S / "daemonset.yaml").read_text().split("apiVersion:")[0]
    for word in ("hostPID", "SYS_PTRACE", "nvidia.com/gpu", "SYS_ADMIN", "/srv/models", "hostNetwork"):
        assert word in head, word


def test_containerfile_runs_non_root_with_the_nvidia_runtime():
    text = (REPO / "deploy" / "container" / "Containerfile").read_text()
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert "NVIDIA_DRIVER_CAPABILITIES=compute,utility" in text and "NVIDIA_VISIBLE_DEVICES=all" in text
    assert "pip install --no-cache-dir /src" in text  # zerod from this repository
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    for folder in set(pyproject["tool"]["setuptools"]["package-dir"].values()):  # every room
        assert f"COPY {folder} ./{folder}" in text
