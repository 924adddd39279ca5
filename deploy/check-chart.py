#!/usr/bin/env python3
"""`make chart`: lint, render and validate the Helm chart deploy/helm/arl.

For each set of values (the defaults, values-gpu.yaml, and every ci/*-values.yaml):

1. `helm lint --strict` (which also checks the values against values.schema.json);
2. `helm template` for Kubernetes 1.35;
3. every rendered object validated: built-in kinds with kubernetes-validate (strict: an
   unknown field is an error), custom resources against the CRD schemas in deploy/crds
   (unknown fields are errors there too, as with strict field validation); a kind that
   neither knows is an error;
4. the chart's promises, checked on what it rendered (the `invariant_*` functions below:
   no cluster-wide RBAC, probes on /health and /ready, nobody runs as root, GPUs where
   asked and nowhere else, least privilege on NATS and the API, sandboxes' network …);
5. the rendered nats.conf checked by a real nats-server (`-t`).

Then a few values that must be refused (a typo, stream replicas above the servers) are
rendered and must fail. Every failure is printed; the exit status is 1 if there was any.

Usage: check-chart.py --helm PATH [--nats-server PATH]
"""

from __future__ import annotations

import argparse
import copy
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jsonschema
import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parent
CHART = ROOT / "helm" / "arl"
CRDS = ROOT / "crds"
KUBE_VERSION = "1.35"
NAMESPACE = "arl-test"
RELEASE = "rel"
FULL = f"{RELEASE}-arl"

SERVICES = [
    "controller", "dataset", "evaluator", "imagebuilder", "inference",
    "proxy", "reward", "rollout", "sandbox", "trainer",
]


def services(values: dict) -> list[str]:
    """The services rendered: every one, and the optional exporter when enabled."""
    return SERVICES + (["exporter"] if values["exporter"]["enabled"] else [])


# Where HPAs are allowed: more replicas of these are safe.
SCALABLE = {"rollout", "proxy", "reward", "sandbox"}
# The API access each service may have, as (apiGroup, resource, verb) triples; a service
# not named here gets none (no RoleBinding, no token mounted).
SANDBOX_RULES = {
    *(("", "pods", v) for v in ["get", "list", "create", "delete", "patch"]),
    *(("", "pods/exec", v) for v in ["create", "get"]),
}
KRUISE_RULES = {
    *(("agents.kruise.io", "sandboxclaims", v) for v in ["get", "create", "delete"]),
    *(("agents.kruise.io", "sandboxes", v) for v in ["list", "patch", "delete"]),
}
IMAGEBUILDER_RULES = {
    *(("batch", "jobs", v) for v in ["get", "create", "delete"]),
    ("", "pods", "list"),
    ("", "pods/log", "get"),
}


class Failures:
    """Collects failures with the scenario they belong to."""

    def __init__(self) -> None:
        self.items: list[str] = []
        self.scenario = ""

    def add(self, message: str) -> None:
        self.items.append(f"[{self.scenario}] {message}")

    def check(self, condition: bool, message: str) -> bool:
        if not condition:
            self.add(message)
        return condition


# ---------------------------------------------------------------- helm and values


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kwargs)


def deep_merge(base: dict, overlay: dict) -> dict:
    merged = copy.deepcopy(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def scenario_values(files: list[Path]) -> dict:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for file in files:
        values = deep_merge(values, yaml.safe_load(file.read_text()) or {})
    return values


def helm_args(files: list[Path], sets: list[str]) -> list[str]:
    args = []
    for file in files:
        args += ["-f", str(file)]
    for s in sets:
        args += ["--set", s]
    return args


def render(helm: str, files: list[Path], sets: list[str] = ()) -> tuple[int, str, str]:
    result = run(
        [helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE,
         "--kube-version", f"{KUBE_VERSION}.0"] + helm_args(files, list(sets))
    )
    return result.returncode, result.stdout, result.stderr


# ---------------------------------------------------------------- schema validation


def crd_to_jsonschema(node):
    """An OpenAPI v3 structural schema as JSON Schema with strict field validation:
    objects with `properties` refuse other fields unless they preserve unknown ones."""
    if isinstance(node, list):
        return [crd_to_jsonschema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-") or key in ("format", "description"):
            continue
        out[key] = crd_to_jsonschema(value)
    if "properties" in node and "additionalProperties" not in node \
            and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def load_crds(failures: Failures) -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) → JSON Schema, from deploy/crds; each CRD itself validated."""
    schemas = {}
    for path in sorted(CRDS.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        try:
            kubernetes_validate.validate(crd, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            failures.add(f"{path.name}: not a valid CustomResourceDefinition: "
                         f"{'.'.join(map(str, e.path))}: {e.message}")
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            schema = crd_to_jsonschema(version["schema"]["openAPIV3Schema"])
            jsonschema.Draft7Validator.check_schema(schema)
            schemas[(f"{group}/{version['name']}", kind)] = schema
    return schemas


def name_of(doc: dict) -> str:
    meta = doc.get("metadata") or {}
    ns = meta.get("namespace", NAMESPACE)
    return f"{doc.get('kind')}/{meta.get('name')} ({ns})"


def validate_object(doc: dict, crds: dict, failures: Failures) -> None:
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key in crds:
        validator = jsonschema.Draft7Validator(crds[key])
        for error in sorted(validator.iter_errors(doc), key=lambda e: list(e.path)):
            failures.add(f"{name_of(doc)}: {'.'.join(map(str, error.path))}: {error.message}")
        if doc.get("kind") == "SandboxSet" and "template" in doc.get("spec", {}):
            # The pool's pods are ordinary pods: hold them to Kubernetes' schema.
            template = {"apiVersion": "v1", "kind": "PodTemplate",
                        "metadata": {"name": doc["metadata"]["name"]},
                        "template": doc["spec"]["template"]}
            validate_builtin(template, failures, f"{name_of(doc)} spec.template")
        return
    validate_builtin(doc, failures, name_of(doc))


def validate_builtin(doc: dict, failures: Failures, label: str) -> None:
    try:
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        failures.add(f"{label}: {'.'.join(map(str, e.path))}: {e.message}")
    except kubernetes_validate.utils.SchemaNotFoundError as e:
        failures.add(f"{label}: no schema for {doc.get('apiVersion')} {doc.get('kind')} "
                     f"(neither Kubernetes {KUBE_VERSION} nor deploy/crds): {e.message}")


# ---------------------------------------------------------------- rendered objects


class Rendered:
    def __init__(self, docs: list[dict]):
        self.docs = docs

    def of(self, kind: str) -> list[dict]:
        return [d for d in self.docs if d["kind"] == kind]

    def get(self, kind: str, name: str) -> dict | None:
        for d in self.of(kind):
            if d["metadata"]["name"] == name:
                return d
        return None

    def workloads(self) -> list[dict]:
        return [d for d in self.docs if d["kind"] in ("Deployment", "StatefulSet")]

    def pod_templates(self) -> list[tuple[str, dict]]:
        out = [(name_of(d), d["spec"]["template"]) for d in self.workloads()]
        out += [(name_of(d), d["spec"]["template"]) for d in self.of("SandboxSet")]
        return out

    def service_workload(self, service: str) -> dict | None:
        for d in self.workloads():
            if d["metadata"]["name"] == f"{FULL}-{service}":
                return d
        return None


def container(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]["containers"][0]


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def flag(args: list[str], name: str) -> str | None:
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            return args[i + 1]
    return None


def labels_match(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# ---------------------------------------------------------------- invariants


def invariant_no_cluster_scope(r: Rendered, f: Failures, values: dict) -> None:
    for kind in ("ClusterRole", "ClusterRoleBinding", "Namespace", "CustomResourceDefinition"):
        for d in r.of(kind):
            f.add(f"{name_of(d)}: the chart must render nothing cluster-scoped")


def invariant_unique_names(r: Rendered, f: Failures, values: dict) -> None:
    seen = set()
    for d in r.docs:
        key = (d["kind"], d["metadata"].get("namespace", NAMESPACE), d["metadata"]["name"])
        f.check(key not in seen, f"{name_of(d)} rendered twice")
        seen.add(key)


def invariant_every_service(r: Rendered, f: Failures, values: dict) -> None:
    for service in services(values):
        w = r.service_workload(service)
        if not f.check(w is not None, f"no workload for the {service} service"):
            continue
        c = container(w)
        f.check(c.get("command") == ["/usr/local/bin/arl"] and c.get("args", [])[:2] == ["serve", service],
                f"{name_of(w)}: runs {c.get('command')} {c.get('args', [])[:2]}, not `arl serve {service}`")
        env = env_of(c)
        f.check(env.get("ARL_HTTP_ADDR", {}).get("value") == "0.0.0.0:9090",
                f"{name_of(w)}: ARL_HTTP_ADDR is not 0.0.0.0:9090")
        f.check(env.get("NATS_URL", {}).get("value", "").endswith(f"{FULL}-nats.{NAMESPACE}.svc.cluster.local:4222"),
                f"{name_of(w)}: NATS_URL does not name the client Service")
        f.check(str(env.get("ARL_STREAM_REPLICAS", {}).get("value")) == str(values["nats"]["jetstream"]["replicas"]),
                f"{name_of(w)}: ARL_STREAM_REPLICAS is not nats.jetstream.replicas")
        tls = values["nats"]["tls"]["enabled"]
        f.check(env.get("NATS_URL", {}).get("value", "").startswith("tls://" if tls else "nats://"),
                f"{name_of(w)}: NATS_URL's scheme does not follow nats.tls.enabled")
        f.check(("NATS_CA" in env) == tls, f"{name_of(w)}: NATS_CA set {'NATS_CA' in env}, TLS {tls}")
        otel = values["otel"]["enabled"]
        endpoint = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", {}).get("value")
        if otel:
            f.check(endpoint == f"http://{FULL}-otel-collector:4318",
                    f"{name_of(w)}: OTEL_EXPORTER_OTLP_ENDPOINT is {endpoint!r}, not the collector")
        else:
            f.check(endpoint is None, f"{name_of(w)}: exports traces while otel.enabled is false")


def invariant_probes(r: Rendered, f: Failures, values: dict) -> None:
    for w in r.workloads():
        spec = w["spec"]["template"]["spec"]
        for c in spec["containers"]:
            ports = {p.get("name") for p in c.get("ports", [])} | {p["containerPort"] for p in c.get("ports", [])}
            for probe in ("livenessProbe", "readinessProbe"):
                p = c.get(probe, {}).get("httpGet")
                if not f.check(p is not None, f"{name_of(w)} container {c['name']}: no HTTP {probe}"):
                    continue
                f.check(p["port"] in ports, f"{name_of(w)} {probe}: port {p['port']} is not a container port")
            if c.get("command") == ["/usr/local/bin/arl"]:
                live = c.get("livenessProbe", {}).get("httpGet", {}).get("path")
                ready = c.get("readinessProbe", {}).get("httpGet", {}).get("path")
                f.check(live == "/health", f"{name_of(w)}: liveness probes {live}, not /health")
                f.check(ready in ("/ready", "/health"), f"{name_of(w)}: readiness probes {ready}, not /ready")


def invariant_non_root(r: Rendered, f: Failures, values: dict) -> None:
    for where, template in r.pod_templates():
        spec = template["spec"]
        pod = spec.get("securityContext", {})
        f.check(pod.get("runAsNonRoot") is True, f"{where}: pod securityContext.runAsNonRoot is not true")
        f.check(pod.get("runAsUser", 0) > 0, f"{where}: pod runAsUser is {pod.get('runAsUser')}")
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            sc = c.get("securityContext", {})
            uid = sc.get("runAsUser", pod.get("runAsUser", 0))
            f.check(uid > 0, f"{where} container {c['name']}: runs as uid {uid}")
            f.check(sc.get("runAsNonRoot", pod.get("runAsNonRoot")) is True,
                    f"{where} container {c['name']}: runAsNonRoot is not true")
            f.check(sc.get("allowPrivilegeEscalation") is False,
                    f"{where} container {c['name']}: allowPrivilegeEscalation is not false")
            f.check("ALL" in sc.get("capabilities", {}).get("drop", []),
                    f"{where} container {c['name']}: capabilities are not all dropped")
            f.check(not sc.get("privileged"), f"{where} container {c['name']}: privileged")


def invariant_gpus(r: Rendered, f: Failures, values: dict) -> None:
    resource = values["gpu"]["resourceName"]
    for w in r.workloads():
        name = w["metadata"]["name"].removeprefix(f"{FULL}-")
        c = container(w)
        gpus = (c.get("resources", {}).get("limits") or {}).get(resource)
        wanted = name in ("trainer", "inference") and values[name]["gpu"]["enabled"]
        spec = w["spec"]["template"]["spec"]
        if wanted:
            f.check(gpus is not None and int(gpus) >= 1, f"{name_of(w)}: requests no {resource}")
            f.check(labels_match(values["gpu"]["nodeSelector"], spec.get("nodeSelector", {})),
                    f"{name_of(w)}: nodeSelector lacks gpu.nodeSelector")
            for t in values["gpu"]["tolerations"]:
                f.check(t in spec.get("tolerations", []), f"{name_of(w)}: lacks the GPU toleration {t}")
        else:
            f.check(gpus is None, f"{name_of(w)}: requests {resource} though its gpu is off")
    trainer = r.service_workload("trainer")
    if trainer:
        gpu = flag(container(trainer)["args"], "--gpu")
        f.check(gpu == ("0" if values["trainer"]["gpu"]["enabled"] else "none"),
                f"trainer: --gpu {gpu} does not follow trainer.gpu.enabled")


def rules_of(role: dict) -> set[tuple[str, str, str]]:
    return {(g, res, v) for rule in role.get("rules", []) for g in rule.get("apiGroups", [])
            for res in rule.get("resources", []) for v in rule.get("verbs", [])}


def invariant_rbac(r: Rendered, f: Failures, values: dict) -> None:
    sandbox_ns = values["sandbox"]["kube"]["namespace"] or NAMESPACE
    kruise = values["sandbox"]["kube"]["sandboxSet"]["enabled"]
    builds = bool(values["imagebuilder"]["registry"]["url"]) and values["imagebuilder"]["buildJobs"]["enabled"]
    expected = {f"{FULL}-sandbox": SANDBOX_RULES | (KRUISE_RULES if kruise else set())}
    if builds:
        expected[f"{FULL}-imagebuilder"] = IMAGEBUILDER_RULES
    roles = {d["metadata"]["name"]: d for d in r.of("Role")}
    f.check(set(roles) == set(expected), f"Roles {sorted(roles)}, expected {sorted(expected)}")
    for name, rules in expected.items():
        role = roles.get(name)
        if role is None:
            continue
        got = rules_of(role)
        f.check(got == rules, f"Role {name}: grants {sorted(got - rules)} too many, lacks {sorted(rules - got)}")
        f.check("*" not in {x for t in got for x in t}, f"Role {name}: a wildcard")
    bound = {}
    for b in r.of("RoleBinding"):
        f.check(b["roleRef"]["kind"] == "Role", f"{name_of(b)}: binds a {b['roleRef']['kind']}")
        ns = b["metadata"].get("namespace", NAMESPACE)
        role = roles.get(b["roleRef"]["name"])
        if f.check(role is not None, f"{name_of(b)}: binds a Role the chart does not render"):
            f.check(role["metadata"].get("namespace", NAMESPACE) == ns, f"{name_of(b)}: its Role is in another namespace")
        for s in b["subjects"]:
            bound[s["name"]] = b
    f.check(set(bound) == {n for n in expected}, f"bound ServiceAccounts {sorted(bound)}, expected {sorted(expected)}")
    sandbox_role = roles.get(f"{FULL}-sandbox")
    if sandbox_role:
        f.check(sandbox_role["metadata"].get("namespace") == sandbox_ns,
                f"the sandbox Role is in {sandbox_role['metadata'].get('namespace')}, sandboxes in {sandbox_ns}")
    # Every service has its own ServiceAccount; only those with a Role mount a token.
    accounts = {d["metadata"]["name"]: d for d in r.of("ServiceAccount")}
    for w in r.workloads():
        spec = w["spec"]["template"]["spec"]
        sa = spec.get("serviceAccountName")
        if not f.check(sa in accounts, f"{name_of(w)}: ServiceAccount {sa} is not rendered"):
            continue
        token = spec.get("automountServiceAccountToken", accounts[sa].get("automountServiceAccountToken", True))
        f.check(token == (sa in bound), f"{name_of(w)}: mounts an API token: {token}, has a Role: {sa in bound}")
        if w["metadata"]["name"].removeprefix(f"{FULL}-") in services(values):
            f.check(sa == w["metadata"]["name"], f"{name_of(w)}: shares ServiceAccount {sa}")
    pod_sa = f"{FULL}-sandbox-pod"
    account = accounts.get(pod_sa)
    if f.check(account is not None, f"no ServiceAccount {pod_sa} for sandbox Pods"):
        f.check(account.get("automountServiceAccountToken") is False, f"{pod_sa} mounts a token")
        f.check(pod_sa not in bound, f"{pod_sa} has a Role")
        f.check(account["metadata"].get("namespace") == sandbox_ns, f"{pod_sa} is not in {sandbox_ns}")


def invariant_sandboxes(r: Rendered, f: Failures, values: dict) -> None:
    sandbox_ns = values["sandbox"]["kube"]["namespace"] or NAMESPACE
    proxy_port = values["proxy"]["port"]
    w = r.service_workload("sandbox")
    if w:
        args = container(w)["args"]
        f.check(flag(args, "--backend") == "kube", "sandbox: not --backend kube")
        f.check(flag(args, "--kube-namespace") == sandbox_ns, f"sandbox: --kube-namespace is not {sandbox_ns}")
        url = f"http://{FULL}-proxy.{NAMESPACE}.svc.cluster.local:{proxy_port}"
        f.check(flag(args, "--kube-proxy-url") == url, f"sandbox: --kube-proxy-url {flag(args, '--kube-proxy-url')}, not {url}")
        svc = r.get("Service", f"{FULL}-proxy")
        f.check(svc is not None and any(p["port"] == proxy_port for p in svc["spec"]["ports"]),
                f"the proxy Service does not serve port {proxy_port}")
        f.check(flag(args, "--kube-service-account") == f"{FULL}-sandbox-pod", "sandbox: --kube-service-account")
        kube = values["sandbox"]["kube"]
        registry = kube["registry"] or (
            re.sub(r"^[a-z]+://", "", values["imagebuilder"]["registry"]["url"].rstrip("/"))
            + "/" + values["imagebuilder"]["registry"]["namespace"]
            if values["imagebuilder"]["registry"]["url"] else None)
        f.check(flag(args, "--kube-registry") == registry, f"sandbox: --kube-registry {flag(args, '--kube-registry')}, expected {registry}")
        images = sorted(a for i, a in enumerate(args) if i and args[i - 1] == "--kube-image")
        f.check(images == sorted(f"{k}={v}" for k, v in kube["images"].items()), f"sandbox: --kube-image {images}")
        secrets = [a for i, a in enumerate(args) if i and args[i - 1] == "--kube-image-pull-secret"]
        f.check(secrets == kube["imagePullSecrets"], f"sandbox: --kube-image-pull-secret {secrets}")
        # Owners cannot span namespaces: the service owns its Pods only in its own.
        env = env_of(container(w))
        owned = sandbox_ns == NAMESPACE
        f.check(("ARL_POD_UID" in env and "ARL_POD_NAME" in env) == owned,
                f"sandbox: owner Pod given {'ARL_POD_UID' in env}, sandboxes in its namespace {owned}")
        f.check(env.get("ARL_SANDBOX_PUBLIC_URL", {}).get("value") == f"http://$(POD_IP):{values['sandbox']['port']}",
                "sandbox: ARL_SANDBOX_PUBLIC_URL is not the pod's own address")
        sets = r.of("SandboxSet")
        if kube["sandboxSet"]["enabled"]:
            given = flag(args, "--kube-sandboxset")
            name = kube["sandboxSet"]["name"]
            if kube["sandboxSet"]["create"]:
                name = f"{FULL}-sandboxes"
                f.check([s["metadata"]["name"] for s in sets] == [name], f"SandboxSets {[s['metadata']['name'] for s in sets]}, expected {name}")
            f.check(given == f"{kube['sandboxSet']['environment']}={name}", f"sandbox: --kube-sandboxset {given}")
        else:
            f.check("--kube-sandboxset" not in args and not sets, "sandbox: a SandboxSet without sandboxSet.enabled")
        runtime = values["sandbox"]["kube"]["runtimeClassName"]
        f.check(flag(args, "--kube-runtime-class") == (runtime or None), "sandbox: --kube-runtime-class")
    # Only sandboxes carry the sandbox role (the NetworkPolicy selects by it).
    for where, template in r.pod_templates():
        is_set = where.startswith("SandboxSet/")
        labelled = template["metadata"].get("labels", {}).get("arl.dev/role") == "sandbox"
        f.check(labelled == is_set, f"{where}: arl.dev/role=sandbox is {labelled}")
        if is_set:
            spec = template["spec"]
            f.check(spec.get("serviceAccountName") == f"{FULL}-sandbox-pod" and spec.get("automountServiceAccountToken") is False,
                    f"{where}: sandboxes must run as the token-less sandbox-pod account")
    if not values["networkPolicy"]["enabled"]:
        f.check(not r.of("NetworkPolicy"), "a NetworkPolicy though networkPolicy.enabled is false")
        return
    policies = r.of("NetworkPolicy")
    if not f.check(len(policies) == 1, f"{len(policies)} NetworkPolicies, expected the sandboxes' one"):
        return
    p = policies[0]
    spec = p["spec"]
    f.check(p["metadata"].get("namespace") == sandbox_ns, "the sandboxes' NetworkPolicy is not in their namespace")
    f.check(spec["podSelector"] == {"matchLabels": {"arl.dev/role": "sandbox"}}, f"NetworkPolicy selects {spec['podSelector']}")
    f.check(sorted(spec.get("policyTypes", [])) == ["Egress", "Ingress"], "NetworkPolicy: not both Ingress and Egress")
    f.check(spec.get("ingress") in ([], None), "NetworkPolicy: sandboxes accept ingress")
    egress = spec.get("egress", [])
    if not f.check(len(egress) == 2, f"NetworkPolicy: {len(egress)} egress rules, expected proxy and DNS"):
        return
    proxy_rule, dns_rule = egress
    proxy = r.service_workload("proxy")
    proxy_labels = proxy["spec"]["template"]["metadata"]["labels"] if proxy else {}
    peer = proxy_rule["to"][0]
    f.check(len(proxy_rule["to"]) == 1 and labels_match(peer["podSelector"]["matchLabels"], proxy_labels)
            and peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": NAMESPACE},
            "NetworkPolicy: the first egress rule is not exactly the proxy's pods")
    f.check(proxy_rule["ports"] == [{"protocol": "TCP", "port": proxy_port}], f"NetworkPolicy: proxy ports {proxy_rule['ports']}")
    proxy_ports = [p["containerPort"] for p in container(proxy)["ports"]] if proxy else []
    f.check(proxy_port in proxy_ports, f"the proxy container does not listen on {proxy_port}")
    f.check(sorted((p["protocol"], p["port"]) for p in dns_rule["ports"]) == [("TCP", 53), ("UDP", 53)],
            f"NetworkPolicy: DNS ports {dns_rule['ports']}")
    f.check(dns_rule["to"][0]["podSelector"]["matchLabels"] == values["networkPolicy"]["dns"]["podLabels"],
            "NetworkPolicy: DNS peer is not networkPolicy.dns.podLabels")


def invariant_scaling(r: Rendered, f: Failures, values: dict) -> None:
    targets = set()
    for h in r.of("HorizontalPodAutoscaler"):
        ref = h["spec"]["scaleTargetRef"]
        service = ref["name"].removeprefix(f"{FULL}-")
        targets.add(service)
        f.check(service in SCALABLE, f"{name_of(h)}: autoscales {service}, which is not safe to scale out")
        w = r.get(ref["kind"], ref["name"])
        if not f.check(w is not None and ref["kind"] == "Deployment", f"{name_of(h)}: targets a missing {ref}"):
            continue
        f.check("replicas" not in w["spec"], f"{name_of(w)}: sets replicas though an HPA owns them")
        f.check("cpu" in (container(w).get("resources", {}).get("requests") or {}),
                f"{name_of(w)}: autoscaled on CPU without a CPU request")
    for service in SCALABLE:
        f.check((service in targets) == values[service]["autoscaling"]["enabled"],
                f"{service}: HPA rendered {service in targets}, autoscaling.enabled {values[service]['autoscaling']['enabled']}")
    for pdb in r.of("PodDisruptionBudget"):
        selector = pdb["spec"]["selector"]["matchLabels"]
        matched = [w for w in r.workloads() if labels_match(selector, w["spec"]["template"]["metadata"]["labels"])]
        f.check(len(matched) == 1, f"{name_of(pdb)}: selects {len(matched)} workloads")


def invariant_services_and_volumes(r: Rendered, f: Failures, values: dict) -> None:
    for svc in r.of("Service"):
        selector = svc["spec"].get("selector", {})
        matched = [w for w in r.workloads() if labels_match(selector, w["spec"]["template"]["metadata"]["labels"])]
        if not f.check(len(matched) == 1, f"{name_of(svc)}: selects {len(matched)} workloads"):
            continue
        names = {p.get("name") for c in matched[0]["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
        for p in svc["spec"]["ports"]:
            f.check(p["targetPort"] in names, f"{name_of(svc)}: targetPort {p['targetPort']} is no container port")
    claims = {d["metadata"]["name"] for d in r.of("PersistentVolumeClaim")}
    claims |= {p["existingClaim"] for p in values["persistence"].values() if p.get("existingClaim")}
    for w in r.workloads():
        spec = w["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        volumes |= {t["metadata"]["name"]: t for t in w["spec"].get("volumeClaimTemplates", [])}
        for v in volumes.values():
            if "persistentVolumeClaim" in v:
                f.check(v["persistentVolumeClaim"]["claimName"] in claims,
                        f"{name_of(w)}: mounts claim {v['persistentVolumeClaim']['claimName']}, which is not rendered")
        for c in spec["containers"]:
            for m in c.get("volumeMounts", []):
                f.check(m["name"] in volumes, f"{name_of(w)}: mounts undeclared volume {m['name']}")
    if values["serviceMonitor"]["enabled"]:
        monitors = r.of("ServiceMonitor")
        if f.check(len(monitors) == 1, "serviceMonitor.enabled but no ServiceMonitor"):
            m = monitors[0]
            ports = {e["port"] for e in m["spec"]["endpoints"]}
            for service in services(values):
                svc = r.get("Service", f"{FULL}-{service}")
                if not f.check(svc is not None, f"no Service for {service}"):
                    continue
                f.check(labels_match(m["spec"]["selector"]["matchLabels"], svc["metadata"]["labels"]),
                        f"the ServiceMonitor does not select {name_of(svc)}")
                f.check(any(p["name"] in ports for p in svc["spec"]["ports"]),
                        f"{name_of(svc)}: no port the ServiceMonitor scrapes")
    else:
        f.check(not r.of("ServiceMonitor"), "a ServiceMonitor though serviceMonitor.enabled is false")


def nats_users(conf: str) -> dict[str, tuple[str, dict]]:
    """The authorization users of a rendered nats.conf: role → (password variable, permissions)."""
    users = {}
    pattern = re.compile(r'^\s*\{user: "([a-z]+)", password: \$([A-Z_]+), permissions: (\{.*\})\}\s*$')
    for line in conf.splitlines():
        m = pattern.match(line)
        if m:
            users[m.group(1)] = (m.group(2), json.loads(m.group(3)))
    return users


def invariant_nats(r: Rendered, f: Failures, values: dict, nats_server: str | None) -> None:
    n = values["nats"]
    sts = r.get("StatefulSet", f"{FULL}-nats")
    if not f.check(sts is not None, "no NATS StatefulSet"):
        return
    f.check(sts["spec"]["replicas"] == n["replicas"], "NATS replicas differ from nats.replicas")
    f.check(any(t["metadata"]["name"] == "data" for t in sts["spec"].get("volumeClaimTemplates", [])),
            "NATS has no persistent volume per server")
    f.check(r.get("Service", f"{FULL}-nats-headless") is not None and
            r.get("Service", f"{FULL}-nats-headless")["spec"].get("clusterIP") == "None", "no headless NATS Service")
    cm = r.get("ConfigMap", f"{FULL}-nats")
    if not f.check(cm is not None, "no NATS ConfigMap"):
        return
    conf = cm["data"]["nats.conf"]
    f.check(("cluster {" in conf) == (n["replicas"] > 1), "NATS routes do not follow nats.replicas")
    routes = [line.strip() for line in conf.splitlines() if line.strip().startswith("nats://")]
    f.check(len(routes) == (n["replicas"] if n["replicas"] > 1 else 0), f"NATS routes {routes} are not one per server")
    f.check(n["jetstream"]["replicas"] <= n["replicas"], "stream replicas above NATS servers")
    permissions = json.loads((CHART / "files" / "permissions.json").read_text())["roles"]
    env = env_of(container(sts))
    users = nats_users(conf)
    if n["auth"]["enabled"]:
        f.check(set(users) == set(permissions), f"NATS users {sorted(users)}, roles {sorted(permissions)}")
        for role, (variable, perms) in users.items():
            want = permissions.get(role, {})
            f.check(perms.get("publish", {}).get("allow") == want.get("publish"), f"nats.conf: {role}'s publish permissions differ from permissions.json")
            f.check(perms.get("subscribe", {}).get("allow") == want.get("subscribe"), f"nats.conf: {role}'s subscribe permissions differ")
            f.check(bool(perms.get("allow_responses")) == bool(want.get("allow_responses")), f"nats.conf: {role}'s allow_responses differs")
            f.check(set(perms) <= {"publish", "subscribe", "allow_responses"}, f"nats.conf: {role} has other permissions")
            source = env.get(variable, {}).get("valueFrom", {}).get("secretKeyRef", {})
            f.check(source == {"name": f"{FULL}-nats-auth", "key": role}, f"NATS: ${variable} does not come from {role}'s secret")
        secret = r.get("Secret", f"{FULL}-nats-auth")
        if f.check(secret is not None, "no Secret of NATS passwords"):
            f.check(set(secret["data"]) == set(permissions), "the NATS Secret's keys are not the roles")
            f.check(all(len(v) >= 32 for v in secret["data"].values()), "a NATS password is short")
        for service in services(values):
            w = r.service_workload(service)
            if not w:
                continue
            e = env_of(container(w))
            f.check(e.get("NATS_USER", {}).get("value") == service, f"{service}: NATS_USER is not {service}")
            f.check(e.get("NATS_PASSWORD", {}).get("valueFrom", {}).get("secretKeyRef") == {"name": f"{FULL}-nats-auth", "key": service},
                    f"{service}: NATS_PASSWORD is not its own")
            f.check(e.get("NATS_INBOX_PREFIX", {}).get("value") == permissions[service]["inbox_prefix"],
                    f"{service}: NATS_INBOX_PREFIX is not {permissions[service]['inbox_prefix']}")
    else:
        f.check(not users and "authorization" not in conf, "NATS users though nats.auth.enabled is false")
    if nats_server:
        check_nats_conf(conf, env, n["tls"]["enabled"], nats_server, f)


def check_nats_conf(conf: str, env: dict, tls: bool, nats_server: str, f: Failures) -> None:
    """`nats-server -t` on the rendered configuration, with the variables the StatefulSet
    defines (and nothing else: a $VAR it does not define fails the test)."""
    with tempfile.TemporaryDirectory() as tmp:
        conf = conf.replace("/data/jetstream", f"{tmp}/js")
        if tls:
            conf = conf.replace("/etc/nats-tls/", f"{tmp}/")
            made = run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                        "-nodes", "-days", "1", "-subj", "/CN=nats", "-keyout", f"{tmp}/tls.key", "-out", f"{tmp}/tls.crt"])
            if not f.check(made.returncode == 0, f"openssl (a test certificate): {made.stderr.strip()}"):
                return
            Path(f"{tmp}/ca.crt").write_bytes(Path(f"{tmp}/tls.crt").read_bytes())
        path = Path(tmp) / "nats.conf"
        path.write_text(conf)
        variables = {"PATH": os.environ.get("PATH", "")}
        for name in env:
            variables[name] = "x" * 32
        result = run([nats_server, "-t", "-c", str(path)], env=variables)
        f.check(result.returncode == 0, f"nats-server -t refuses the rendered nats.conf: {(result.stdout + result.stderr).strip()}")


def invariant_engines(r: Rendered, f: Failures, values: dict) -> None:
    """The proxy routes to each engine by name; the trainer and engines share the weights."""
    engines = r.service_workload("inference")
    proxy = r.service_workload("proxy")
    if not (engines and proxy):
        return
    f.check(engines["kind"] == "StatefulSet", "inference is not a StatefulSet (engines need stable names)")
    backends = [a for i, a in enumerate(container(proxy)["args"]) if i and container(proxy)["args"][i - 1] == "--backend"]
    replicas = values["inference"]["replicas"]
    for n in range(replicas):
        host = f"{FULL}-inference-{n}.{FULL}-inference.{NAMESPACE}.svc.cluster.local:{values['inference']['port']}"
        f.check(f"arl=http://{host}" in backends, f"proxy: no --backend for engine {n}")
    f.check(len(backends) == replicas + len(values["proxy"]["extraBackends"]), f"proxy: backends {backends}")
    trainer = r.service_workload("trainer")
    store = flag(container(trainer)["args"], "--weights-store") if trainer else None
    f.check(store == values["weights"]["store"], f"trainer: --weights-store {store}")
    for w in (engines, trainer):
        mounts = {m["mountPath"] for m in container(w).get("volumeMounts", [])}
        f.check("/var/lib/arl/runs" in mounts, f"{name_of(w)}: does not mount the runs volume")


INVARIANTS = [
    invariant_no_cluster_scope, invariant_unique_names, invariant_every_service, invariant_probes,
    invariant_non_root, invariant_gpus, invariant_rbac, invariant_sandboxes, invariant_scaling,
    invariant_services_and_volumes, invariant_engines,
]


# ---------------------------------------------------------------- the values schema


def check_values_schema(f: Failures) -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    f.check(schema.get("$schema") == "http://json-schema.org/draft-07/schema#", "values.schema.json is not draft-07")
    try:
        jsonschema.Draft7Validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        f.add(f"values.schema.json is no valid schema: {e.message}")
        return
    f.check(schema.get("additionalProperties") is False, "values.schema.json accepts unknown top-level keys")

    def described(node, path):
        if isinstance(node, dict):
            for key, sub in node.get("properties", {}).items():
                f.check("description" in sub, f"values.schema.json: {path}.{key} has no description")
                described(sub, f"{path}.{key}")
            for key, sub in node.get("definitions", {}).items():
                described(sub, f"definitions.{key}")

    described(schema, "")
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    for error in jsonschema.Draft7Validator(schema).iter_errors(defaults):
        f.add(f"values.yaml does not meet values.schema.json: {'.'.join(map(str, error.path))}: {error.message}")


# ---------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--helm", required=True)
    parser.add_argument("--nats-server", default=os.environ.get("ARL_NATS_SERVER"))
    args = parser.parse_args()
    started = time.monotonic()
    f = Failures()
    if args.nats_server and not Path(args.nats_server).is_file():
        f.add(f"--nats-server {args.nats_server}: no such file (make deps installs it)")
        args.nats_server = None
    if not args.nats_server:
        print("note: no nats-server (--nats-server or ARL_NATS_SERVER): the rendered nats.conf is not tested")

    f.scenario = "schemas"
    check_values_schema(f)
    crds = load_crds(f)

    scenarios = [("default", []), ("gpu", [CHART / "values-gpu.yaml"])]
    scenarios += [(Path(p).stem.removesuffix("-values"), [Path(p)])
                  for p in sorted(glob.glob(str(CHART / "ci" / "*-values.yaml")))]
    for label, files in scenarios:
        f.scenario = label
        before = len(f.items)
        lint = run([args.helm, "lint", "--strict", str(CHART)] + helm_args(files, []))
        f.check(lint.returncode == 0, f"helm lint --strict:\n{lint.stdout}{lint.stderr}")
        code, out, err = render(args.helm, files)
        if not f.check(code == 0, f"helm template failed: {err.strip()}"):
            continue
        docs = [d for d in yaml.safe_load_all(out) if d]
        for doc in docs:
            validate_object(doc, crds, f)
        values = scenario_values(files)
        rendered = Rendered(docs)
        for invariant in INVARIANTS:
            invariant(rendered, f, values)
        invariant_nats(rendered, f, values, args.nats_server)
        kinds = sorted({d["kind"] for d in docs})
        status = "ok" if len(f.items) == before else f"{len(f.items) - before} failure(s)"
        print(f"{label:>8}: {len(docs)} objects ({', '.join(kinds)}): {status}")

    # Values the chart must refuse.
    f.scenario = "refusals"
    refusals = [
        (["nats.replica=3"], "a misspelt key", "additional properties 'replica' not allowed"),
        (["nats.replicas=1"], "more stream replicas than NATS servers", "cannot exceed nats.replicas"),
        (["weights.store=nfs"], "an unknown weights store", "/weights/store"),
        (["runAsUser=0"], "running as root", "/runAsUser"),
        (["sandbox.kube.sandboxSet.enabled=true", "sandbox.kube.sandboxSet.create=false"],
         "a SandboxSet with no name", "sandbox.kube.sandboxSet.name"),
        (["otel.enabled=true", "otel.jaeger.enabled=false"], "traces with nowhere to go", "otel.collector.exporterEndpoint"),
        (["nats.tls.enabled=true"], "TLS without a certificate", "nats.tls.secretName"),
        (["exporter.enabled=true"], "an exporter with no Kafka", "exporter.kafka.brokers"),
        (["exporter.enabled=true", "exporter.kafka.brokers=k:9092", "exporter.replicas=2"],
         "two exporters at once", "/exporter/replicas"),
    ]
    refused = 0
    for sets, what, reason in refusals:
        code, _, err = render(args.helm, [], sets)
        if f.check(code != 0 and reason in err,
                   f"{what} ({' '.join(sets)}): expected a refusal naming {reason!r}, got exit {code}: {err.strip()}"):
            refused += 1
    print(f"refusals: {refused} of {len(refusals)} sets of bad values refused with the right reason")

    elapsed = time.monotonic() - started
    if f.items:
        print(f"\nmake chart: {len(f.items)} failure(s) ({elapsed:.1f} s):", file=sys.stderr)
        for item in f.items:
            print(f"  - {item}", file=sys.stderr)
        return 1
    print(f"make chart: the chart lints, renders, validates against Kubernetes {KUBE_VERSION} and the CRDs, "
          f"and keeps its invariants in {len(scenarios)} value sets ({elapsed:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
