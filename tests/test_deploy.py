"""deploy/: render the Kustomize overlays and check them against docs/config.md and each other.

`kubectl kustomize` (kubectl's built-in Kustomize) renders the overlays offline; nothing here
talks to a cluster. The checks are the ones a typo can break: ports, probes, RBAC, the Redis
wiring of the ha overlay, the worker NetworkPolicy, the config keys, the example worker's
--kv-events-config, the Dockerfile, and the dashboard's metric names.
"""

from __future__ import annotations

import functools
import json
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from router.config import ServerConfig

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
OVERLAYS = ("single", "ha")
ROUTER = "kvrouter"  # name of the router Deployment, its container and its Service
ZMQ_PORTS = (5557, 5558)
# Labels Prometheus adds from the scrape target; a dashboard may group by them.
TARGET_LABELS = {"job", "instance", "namespace", "pod", "service", "container", "endpoint"}

Obj = dict[str, Any]

KUBECTL = shutil.which("kubectl") or next(
    (p for p in ("/usr/bin/kubectl", "/usr/local/bin/kubectl") if Path(p).is_file()), ""
)


# ---------------------------------------------------------------------------------------------
# rendering and lookup helpers


@functools.cache
def _render(overlay: str) -> tuple[Obj, ...]:
    proc = subprocess.run(
        [KUBECTL, "kustomize", str(K8S / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, f"kubectl kustomize {overlay} failed:\n{proc.stderr}"
    return tuple(d for d in yaml.safe_load_all(proc.stdout) if d)


def render(overlay: str) -> tuple[Obj, ...]:
    if not KUBECTL:
        pytest.fail("kubectl is not installed (scripts/setup.sh --with-kubectl installs it)")
    return _render(overlay)


def of_kind(objs: tuple[Obj, ...], kind: str) -> list[Obj]:
    return [o for o in objs if o["kind"] == kind]


def named(objs: tuple[Obj, ...], kind: str, name: str) -> Obj:
    found = [o for o in of_kind(objs, kind) if o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name!r}, found {len(found)}"
    return found[0]


def selects(selector: Obj | None, labels: dict[str, str]) -> bool:
    """LabelSelector (or a Service's plain selector map) semantics, matchLabels only."""
    selector = selector or {}
    if "matchLabels" in selector or "matchExpressions" in selector:
        assert "matchExpressions" not in selector, "test only understands matchLabels"
        selector = selector.get("matchLabels") or {}
    return all(labels.get(k) == v for k, v in selector.items())


def container(deploy: Obj, name: str) -> Obj:
    cs = [c for c in deploy["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    assert len(cs) == 1, f"Deployment {deploy['metadata']['name']} has no container {name!r}"
    return cs[0]


def resolve_port(ctr: Obj, port: int | str) -> int:
    if isinstance(port, int):
        return port
    by_name = {p.get("name"): p["containerPort"] for p in ctr.get("ports", [])}
    assert port in by_name, f"named port {port!r} is not a port of container {ctr['name']}"
    return by_name[port]


def pod_labels(deploy: Obj) -> dict[str, str]:
    return deploy["spec"]["template"]["metadata"]["labels"]


def env_of(ctr: Obj) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in ctr.get("env", [])}


class Rendered:
    """One rendered overlay with the router's pieces found by following references."""

    def __init__(self, overlay: str) -> None:
        self.overlay = overlay
        self.objs = render(overlay)
        self.deploy = named(self.objs, "Deployment", ROUTER)
        self.namespace = self.deploy["metadata"]["namespace"]
        self.pod = self.deploy["spec"]["template"]["spec"]
        self.ctr = container(self.deploy, ROUTER)
        self.labels = pod_labels(self.deploy)
        self.service = named(self.objs, "Service", ROUTER)
        self.config_path, self.config = self._config()

    def _config(self) -> tuple[str, Obj]:
        args = self.ctr.get("args") or []
        assert "--config" in args, f"router args {args} have no --config"
        path = PurePosixPath(args[args.index("--config") + 1])
        for mount in self.ctr.get("volumeMounts", []):
            mdir = PurePosixPath(mount["mountPath"])
            if mount.get("subPath"):
                if mdir != path:
                    continue
                key = mount["subPath"]
            elif path.parent == mdir:
                key = path.name
            else:
                continue
            vol = next(v for v in self.pod["volumes"] if v["name"] == mount["name"])
            assert "configMap" in vol, f"config volume {vol['name']} is not a ConfigMap"
            items = {i["path"]: i["key"] for i in vol["configMap"].get("items", [])}
            key = items.get(key, key)
            cm = named(self.objs, "ConfigMap", vol["configMap"]["name"])
            assert key in cm.get("data", {}), f"ConfigMap {cm['metadata']['name']} lacks {key}"
            return str(path), yaml.safe_load(cm["data"][key])
        raise AssertionError(f"--config {path} is not inside any ConfigMap volume mount")

    def redis_url(self) -> str | None:
        """redis.url after KVROUTER_REDIS_URL overrides it, as docs/config.md specifies."""
        env = env_of(self.ctr)
        if "KVROUTER_REDIS_URL" in env:
            return env["KVROUTER_REDIS_URL"]
        return (self.config.get("redis") or {}).get("url")

    def other_pod_labels(self) -> list[dict[str, str]]:
        return [
            pod_labels(d)
            for d in of_kind(self.objs, "Deployment") + of_kind(self.objs, "StatefulSet")
            if d is not self.deploy
        ]


@pytest.fixture(params=OVERLAYS, scope="module")
def r(request: pytest.FixtureRequest) -> Rendered:
    return Rendered(request.param)


# ---------------------------------------------------------------------------------------------
# contract from docs/config.md


@functools.cache
def contract() -> Obj:
    text = (ROOT / "docs" / "config.md").read_text()
    m = re.search(r"```yaml\n(.*?)```", text, re.S)
    assert m, "docs/config.md has no ```yaml block"
    return yaml.safe_load(m.group(1))


def unknown_keys(value: Any, schema: Any, path: str = "") -> list[str]:
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            return [f"{path or '<root>'}: expected a mapping"]
        errors = []
        for key, sub in value.items():
            where = f"{path}.{key}" if path else str(key)
            if key not in schema:
                errors.append(f"{where}: not in docs/config.md")
            else:
                errors += unknown_keys(sub, schema[key], where)
        return errors
    if isinstance(schema, list):
        if value is None:
            return []
        if not isinstance(value, list):
            return [f"{path}: expected a list"]
        if not schema:
            return [f"{path}[]: expected scalars" for v in value if isinstance(v, dict | list)]
        return [e for i, v in enumerate(value) for e in unknown_keys(v, schema[0], f"{path}[{i}]")]
    if isinstance(value, dict | list):
        return [f"{path}: expected a scalar"]
    return []


def env_names(schema: Any, prefix: tuple[str, ...] = ()) -> set[str]:
    """KVROUTER_<SECTION>_<KEY> for every scalar reachable through mappings."""
    if isinstance(schema, dict):
        return {n for k, v in schema.items() for n in env_names(v, (*prefix, str(k)))}
    if isinstance(schema, list) and schema and isinstance(schema[0], dict):
        return set()  # list of mappings (workers): not addressable by one variable
    return {"KVROUTER_" + "_".join(prefix).upper()}


def test_contract_block_parses() -> None:
    tree = contract()
    assert {"server", "discovery", "redis"} <= set(tree)
    assert "KVROUTER_REDIS_URL" in env_names(tree)


# ---------------------------------------------------------------------------------------------
# router Deployment, Service, config


def test_http_port_matches_service_and_config(r: Rendered) -> None:
    http = resolve_port(r.ctr, "http")
    assert http == r.config["server"]["port"]
    assert selects(r.service["spec"]["selector"], r.labels)
    for other in r.other_pod_labels():
        assert not selects(r.service["spec"]["selector"], other), "Service also selects Redis"
    svc_http = next(p for p in r.service["spec"]["ports"] if p["name"] == "http")
    assert resolve_port(r.ctr, svc_http["targetPort"]) == http


def test_admin_port_is_scraped(r: Rendered) -> None:
    admin = r.config["server"]["admin_port"]
    assert admin is not None and admin != r.config["server"]["port"]
    assert resolve_port(r.ctr, "metrics") == admin
    svc_ports = {p["name"]: p for p in r.service["spec"]["ports"]}
    assert resolve_port(r.ctr, svc_ports["metrics"]["targetPort"]) == admin
    (sm,) = of_kind(r.objs, "ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert selects(sm["spec"]["selector"], r.service["metadata"]["labels"])
    (ep,) = sm["spec"]["endpoints"]
    assert ep["port"] == "metrics" and ep.get("path", "/metrics") == "/metrics"


def test_probes_hit_health_and_ready_on_the_api_port(r: Rendered) -> None:
    port = r.config["server"]["port"]
    for probe, path in (("livenessProbe", "/health"), ("readinessProbe", "/ready")):
        get = r.ctr[probe]["httpGet"]
        assert get["path"] == path, probe
        assert resolve_port(r.ctr, get["port"]) == port, probe
    if "startupProbe" in r.ctr:
        get = r.ctr["startupProbe"]["httpGet"]
        assert get["path"] == "/health" and resolve_port(r.ctr, get["port"]) == port


def test_config_keys_and_env_overrides_are_in_the_contract(r: Rendered) -> None:
    assert unknown_keys(r.config, contract()) == []
    allowed = env_names(contract())
    for name in env_of(r.ctr):
        if name.startswith("KVROUTER_"):
            assert name in allowed, f"{name} overrides no key of docs/config.md"


def test_discovery_watches_vllm_pods_in_the_router_namespace(r: Rendered) -> None:
    k8s = r.config["discovery"]["kubernetes"]
    assert k8s["enabled"] is True
    assert k8s["label_selector"] == "app.kubernetes.io/name=vllm"
    assert k8s["namespace"] == r.namespace
    for obj in r.objs:
        if obj["kind"] != "Namespace":
            assert obj["metadata"].get("namespace") == r.namespace, obj["metadata"]["name"]


def test_rbac_is_read_only_on_pods(r: Rendered) -> None:
    assert not of_kind(r.objs, "ClusterRole") and not of_kind(r.objs, "ClusterRoleBinding")
    (role,) = of_kind(r.objs, "Role")
    assert len(role["rules"]) == 1
    (rule,) = role["rules"]
    assert set(rule) == {"apiGroups", "resources", "verbs"}, rule
    assert rule["apiGroups"] == [""]
    assert rule["resources"] == ["pods"]
    assert sorted(rule["verbs"]) == ["get", "list", "watch"]

    sa_name = r.pod["serviceAccountName"]
    named(r.objs, "ServiceAccount", sa_name)
    (binding,) = of_kind(r.objs, "RoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa_name, "namespace": r.namespace}
    ]
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == r.namespace


def test_every_workload_is_locked_down(r: Rendered) -> None:
    for d in of_kind(r.objs, "Deployment") + of_kind(r.objs, "StatefulSet"):
        pod = d["spec"]["template"]["spec"]
        for c in pod["containers"]:
            where = f"{d['metadata']['name']}/{c['name']}"
            sc = c.get("securityContext", {})
            assert sc.get("runAsNonRoot", pod.get("securityContext", {}).get("runAsNonRoot"))
            assert sc.get("readOnlyRootFilesystem") is True, where
            assert sc.get("allowPrivilegeEscalation") is False, where
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], where
            res = c.get("resources", {})
            assert {"cpu", "memory"} <= set(res.get("requests", {})), where
            assert {"cpu", "memory"} <= set(res.get("limits", {})), where
    assert r.pod["securityContext"]["runAsUser"] == 10001


def test_pdb_and_hpa_fit_the_replica_count(r: Rendered) -> None:
    replicas = r.deploy["spec"]["replicas"]
    (pdb,) = of_kind(r.objs, "PodDisruptionBudget")
    assert selects(pdb["spec"]["selector"], r.labels)
    if "maxUnavailable" in pdb["spec"]:
        assert pdb["spec"]["maxUnavailable"] >= 1
    else:  # a minAvailable equal to the replica count would block every node drain
        assert pdb["spec"]["minAvailable"] < replicas
    for hpa in of_kind(r.objs, "HorizontalPodAutoscaler"):
        assert hpa["apiVersion"] == "autoscaling/v2"
        ref = hpa["spec"]["scaleTargetRef"]
        assert (ref["kind"], ref["name"]) == ("Deployment", ROUTER)
        assert hpa["spec"]["minReplicas"] == replicas <= hpa["spec"]["maxReplicas"]
        cpu = [m for m in hpa["spec"]["metrics"] if m["type"] == "Resource"]
        assert cpu and cpu[0]["resource"]["name"] == "cpu"
        assert "cpu" in r.ctr["resources"]["requests"], "CPU utilization needs a CPU request"


# ---------------------------------------------------------------------------------------------
# single vs ha


def test_single_is_one_replica_without_redis() -> None:
    r = Rendered("single")
    assert r.deploy["spec"]["replicas"] == 1
    assert not of_kind(r.objs, "HorizontalPodAutoscaler"), "single must not scale without Redis"
    assert r.redis_url() is None
    assert not any("redis" in c["image"] for o in r.objs for c in _containers(o))


def test_ha_is_three_replicas_on_the_bundled_redis() -> None:
    r = Rendered("ha")
    assert r.deploy["spec"]["replicas"] == 3
    url = urlsplit(r.redis_url() or "")
    assert url.scheme == "redis", r.redis_url()
    svc = named(r.objs, "Service", url.hostname or "")
    (svc_port,) = [p for p in svc["spec"]["ports"] if p["port"] == (url.port or 6379)]
    backends = [
        d
        for d in of_kind(r.objs, "Deployment") + of_kind(r.objs, "StatefulSet")
        if selects(svc["spec"]["selector"], pod_labels(d))
    ]
    assert len(backends) == 1, "the Redis Service must select exactly the Redis pods"
    (redis_ctr,) = backends[0]["spec"]["template"]["spec"]["containers"]
    assert redis_ctr["image"].startswith("redis:7")
    assert resolve_port(redis_ctr, svc_port["targetPort"]) == 6379

    # Redis has no password: a NetworkPolicy admits only the router to it.
    pols = [
        p
        for p in of_kind(r.objs, "NetworkPolicy")
        if selects(p["spec"]["podSelector"], pod_labels(backends[0]))
    ]
    assert pols, "no NetworkPolicy protects Redis"
    for rule in (rule for p in pols for rule in p["spec"].get("ingress", [])):
        _assert_router_only(r, rule.get("from", []), "Redis ingress")


def _containers(obj: Obj) -> list[Obj]:
    tmpl = obj.get("spec", {}).get("template", {})
    return tmpl.get("spec", {}).get("containers", []) if isinstance(tmpl, dict) else []


# ---------------------------------------------------------------------------------------------
# example worker and the worker NetworkPolicy


@functools.cache
def example_worker() -> Obj:
    docs = [d for d in yaml.safe_load_all((K8S / "examples" / "vllm-worker.yaml").read_text()) if d]
    (deploy,) = [d for d in docs if d["kind"] == "Deployment"]
    return deploy


def _flag(argv: list[str], flag: str) -> str:
    for i, a in enumerate(argv):
        if a == flag:
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    raise AssertionError(f"{flag} not in {argv}")


def _tcp_port(endpoint: str) -> int:
    m = re.fullmatch(r"tcp://[^:]+:(\d+)", endpoint)
    assert m, f"not a tcp://host:port endpoint: {endpoint}"
    return int(m.group(1))


def _assert_router_only(r: Rendered, peers: list[Obj], what: str) -> None:
    assert peers, f"{what}: a rule without 'from' admits every source"
    for peer in peers:
        assert set(peer) == {"podSelector"}, f"{what}: peer {peer} is not a bare podSelector"
        sel = peer["podSelector"]
        assert sel.get("matchLabels"), f"{what}: empty podSelector admits every pod"
        assert selects(sel, r.labels), f"{what}: peer {sel} does not select the router pods"
        for other in [*r.other_pod_labels(), pod_labels(example_worker())]:
            assert not selects(sel, other), f"{what}: peer {sel} also selects {other}"


def _rule_ports(rule: Obj, ctr: Obj) -> set[int] | None:
    """Ports a NetworkPolicy ingress rule opens (None: every port)."""
    if not rule.get("ports"):
        return None
    ports: set[int] = set()
    for p in rule["ports"]:
        if "port" not in p:
            return None
        first = resolve_port(ctr, p["port"])
        ports |= set(range(first, p.get("endPort", first) + 1))
    return ports


def test_example_worker_matches_discovery_and_its_own_flags() -> None:
    r = Rendered("single")
    disc = r.config["discovery"]["kubernetes"]
    worker = example_worker()
    meta = worker["spec"]["template"]["metadata"]
    ann = meta["annotations"]
    assert worker["metadata"]["namespace"] == r.namespace, "discovery only sees its namespace"
    key, _, value = disc["label_selector"].partition("=")
    assert meta["labels"].get(key) == value
    assert selects(worker["spec"]["selector"], meta["labels"])

    (ctr,) = worker["spec"]["template"]["spec"]["containers"]
    assert ctr["image"].startswith("vllm/vllm-openai")
    argv = [*ctr.get("command", []), *ctr.get("args", [])]
    assert "--enable-prompt-tokens-details" in argv
    kv = json.loads(_flag(argv, "--kv-events-config"))
    assert kv["enable_kv_cache_events"] is True and kv["publisher"] == "zmq"
    events, replay = _tcp_port(kv["endpoint"]), _tcp_port(kv["replay_endpoint"])
    assert (events, replay) == ZMQ_PORTS
    assert int(ann[disc["events_port_annotation"]]) == events
    assert int(ann[disc["replay_port_annotation"]]) == replay
    assert ann[disc["dp_size_annotation"]] == "1"
    assert all(isinstance(v, str) for v in ann.values()), "annotation values must be strings"

    ports = {p["containerPort"] for p in ctr["ports"]}
    assert {events, replay, disc["port"]} <= ports
    assert int(_flag(argv, "--port")) == disc["port"]
    get = ctr["readinessProbe"]["httpGet"]
    assert get["path"] == "/health" and resolve_port(ctr, get["port"]) == disc["port"]
    assert "nvidia.com/gpu" in ctr["resources"]["limits"]
    assert "nvidia.com/gpu" in ctr["resources"]["requests"]


def test_only_the_router_reaches_the_workers_zmq_ports(r: Rendered) -> None:
    worker = example_worker()
    wlabels = pod_labels(worker)
    (wctr,) = worker["spec"]["template"]["spec"]["containers"]
    pols = [
        p for p in of_kind(r.objs, "NetworkPolicy") if selects(p["spec"]["podSelector"], wlabels)
    ]
    assert pols, "no NetworkPolicy selects the vLLM worker pods"
    disc_key, _, disc_value = r.config["discovery"]["kubernetes"]["label_selector"].partition("=")
    opened_to_router: set[int] = set()
    for pol in pols:
        assert "Ingress" in pol["spec"].get("policyTypes", ["Ingress"])
        assert pol["spec"]["podSelector"]["matchLabels"] == {disc_key: disc_value}
        for rule in pol["spec"].get("ingress", []):
            ports = _rule_ports(rule, wctr)
            if ports is None or ports & set(ZMQ_PORTS):
                _assert_router_only(r, rule.get("from", []), f"{pol['metadata']['name']}")
            opened_to_router |= ports or set()
    needed = {*ZMQ_PORTS, r.config["discovery"]["kubernetes"]["port"]}
    assert needed <= opened_to_router, "the router itself must reach events, replay and HTTP"


# ---------------------------------------------------------------------------------------------
# Dockerfile


def _dockerfile() -> list[tuple[str, str]]:
    text = (DEPLOY / "docker" / "Dockerfile").read_text()
    text = re.sub(r"\\\n", " ", text)
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def test_dockerfile_matches_the_deployment() -> None:
    r = Rendered("single")
    instr = _dockerfile()
    last = {op: rest for op, rest in instr}
    assert sum(op == "FROM" for op, _ in instr) >= 2, "expected a multi-stage build"
    assert "python:3.11-slim" in (DEPLOY / "docker" / "Dockerfile").read_text()
    assert any(op == "RUN" and "pip wheel" in rest for op, rest in instr)

    entry, cmd = json.loads(last["ENTRYPOINT"]), json.loads(last["CMD"])
    assert entry == ["kvrouter"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert entry[0] in scripts, "ENTRYPOINT is not a console script of the package"
    assert cmd == ["serve", "--config", r.config_path]
    assert r.ctr.get("args", cmd) == cmd

    uid = last["USER"].split(":")[0]
    assert uid.isdigit() and int(uid) == r.pod["securityContext"]["runAsUser"]
    exposed = {int(p.split("/")[0]) for p in last["EXPOSE"].split()}
    assert {r.config["server"]["port"], r.config["server"]["admin_port"]} <= exposed
    health = last["HEALTHCHECK"]
    assert "urllib" in health and "/health" in health
    assert str(r.config["server"]["port"]) in health


# ---------------------------------------------------------------------------------------------
# Grafana dashboard vs the metric list in deploy/README.md


@functools.cache
def documented_metrics() -> dict[str, tuple[str, frozenset[str]]]:
    """name -> (type, labels) from the metrics table of deploy/README.md."""
    rows = re.findall(
        r"^\|\s*`(kvrouter_\w+)`\s*\|\s*(\w+)\s*\|([^|]*)\|",
        (DEPLOY / "README.md").read_text(),
        re.M,
    )
    assert rows, "deploy/README.md has no metrics table"
    table = {name: (kind, frozenset(re.findall(r"`(\w+)`", labels))) for name, kind, labels in rows}
    assert len(table) == len(rows), "a metric is listed twice"
    return table


def _queries(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [
            v
            for k, v in node.items()
            if k in ("expr", "query", "definition") and isinstance(v, str)
        ]
        return found + [q for v in node.values() for q in _queries(v)]
    if isinstance(node, list):
        return [q for v in node for q in _queries(v)]
    return []


def _family(name: str, table: dict[str, tuple[str, frozenset[str]]]) -> str:
    for suffix in ("_bucket", "_sum", "_count"):
        base = name.removesuffix(suffix)
        if base != name and table.get(base, ("",))[0] == "histogram":
            return base
    return name


def test_dashboard_queries_only_documented_metrics_and_labels() -> None:
    dash = json.loads((DEPLOY / "grafana" / "kvrouter-dashboard.json").read_text())
    table = documented_metrics()
    queries = _queries(dash)
    assert queries, "dashboard has no queries"
    used: set[str] = set()
    for q in queries:
        names = {_family(n, table) for n in re.findall(r"\b(kvrouter_\w+)", q)}
        unknown = names - set(table)
        assert not unknown, f"{q!r} uses metrics not listed in deploy/README.md: {unknown}"
        used |= names
        labels_here = set().union(*(table[n][1] for n in names)) if names else set()
        ok = labels_here | TARGET_LABELS | ({"le"} if "_bucket" in q else set())
        for name, sel in re.findall(r"\b(kvrouter_\w+)\{([^}]*)\}", q):
            for label in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", sel):
                assert label in table[_family(name, table)][1] | TARGET_LABELS, (q, label)
        for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", q):
            for label in re.findall(r"\w+", group):
                assert label in ok, f"{q!r} groups by {label!r}, not a label of its metrics"
        for label in re.findall(r"label_values\(\s*\w+\s*,\s*(\w+)\s*\)", q):
            assert label in ok, (q, label)
    assert used == set(table), f"documented but not on the dashboard: {set(table) - used}"


def test_dashboard_panels_are_well_formed() -> None:
    dash = json.loads((DEPLOY / "grafana" / "kvrouter-dashboard.json").read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    for p in dash["panels"]:
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        assert {"h", "w", "x", "y"} <= set(p["gridPos"]) and p["gridPos"]["x"] + p["gridPos"][
            "w"
        ] <= 24


def test_readme_documents_the_worker_flags() -> None:
    readme = (DEPLOY / "README.md").read_text()
    worker = example_worker()
    (ctr,) = worker["spec"]["template"]["spec"]["containers"]
    flag = _flag([*ctr.get("command", []), *ctr.get("args", [])], "--kv-events-config")
    assert shlex.quote(flag) in readme, "README's --kv-events-config differs from the example"
    for key, value in worker["spec"]["template"]["metadata"]["annotations"].items():
        assert f"`{key}`" in readme and f'`"{value}"`' in readme
    assert "kubectl apply -k" in readme


def test_the_workers_http_port_stays_open_to_scrapers_and_clients(r: Rendered) -> None:
    """Only the ZMQ sockets are the router's: Prometheus and other clients of vLLM's HTTP port
    (``/metrics``, ``/health``, the API) must still get in once the policy selects the pods."""
    worker = example_worker()
    wlabels = pod_labels(worker)
    (wctr,) = worker["spec"]["template"]["spec"]["containers"]
    http = r.config["discovery"]["kubernetes"]["port"]
    open_to_all: set[int] = set()
    for pol in of_kind(r.objs, "NetworkPolicy"):
        if not selects(pol["spec"]["podSelector"], wlabels):
            continue
        for rule in pol["spec"].get("ingress", []):
            if not rule.get("from"):
                open_to_all |= _rule_ports(rule, wctr) or set(range(1, 65536))
    assert http in open_to_all, "the workers' HTTP port admits the router pods only"
    assert not open_to_all & set(ZMQ_PORTS)


def test_grace_period_covers_the_routers_drain(r: Rendered) -> None:
    pod = named(r.objs, "Deployment", "kvrouter")["spec"]["template"]["spec"]
    drain = r.config.get("server", {}).get("drain_timeout_s", ServerConfig().drain_timeout_s)
    assert pod["terminationGracePeriodSeconds"] > drain, "SIGKILL would cut streams mid-drain"


# ---------------------------------------------------------------------------------------------
# components/epp: kvrouter as an InferencePool's Endpoint Picker


def test_epp_component_wires_pool_service_port_and_rbac(tmp_path: Path) -> None:
    if not KUBECTL:
        pytest.fail("kubectl is not installed (scripts/setup.sh --with-kubectl installs it)")
    import os

    single = os.path.relpath(K8S / "overlays" / "single", tmp_path)
    epp = os.path.relpath(K8S / "components" / "epp", tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"namespace: kvrouter\nresources: [{single}]\ncomponents: [{epp}]\n"
    )
    proc = subprocess.run(
        [KUBECTL, "kustomize", str(tmp_path)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr
    objs = tuple(d for d in yaml.safe_load_all(proc.stdout) if d)

    dep = named(objs, "Deployment", ROUTER)
    (c,) = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == ROUTER]
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    assert set(env) - {"HOME"} <= env_names(contract()), "EPP env vars are config keys"
    epp_port = int(env["KVROUTER_SERVER_EPP_PORT"])
    assert epp_port == 9002
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["grpc"] == epp_port and ports["http"] == 8000  # the base ports are kept

    svc = named(objs, "Service", "kvrouter-epp")
    assert selects(svc["spec"]["selector"], dep["spec"]["template"]["metadata"]["labels"])
    (sp,) = svc["spec"]["ports"]
    assert sp["port"] == epp_port and sp["targetPort"] == "grpc"

    pool = named(objs, "InferencePool", env["KVROUTER_DISCOVERY_KUBERNETES_INFERENCE_POOL"])
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["metadata"]["namespace"] == "kvrouter"
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["name"] == "kvrouter-epp" and ref["port"]["number"] == sp["port"]
    worker = example_worker()
    labels = worker["spec"]["template"]["metadata"]["labels"]
    assert selects(pool["spec"]["selector"], labels)
    worker_ports = {
        p["containerPort"]
        for c in worker["spec"]["template"]["spec"]["containers"]
        for p in c.get("ports", [])
    }
    assert {p["number"] for p in pool["spec"]["targetPorts"]} <= worker_ports

    route = named(objs, "HTTPRoute", "vllm")
    (backend,) = route["spec"]["rules"][0]["backendRefs"]
    assert (backend["kind"], backend["name"]) == ("InferencePool", pool["metadata"]["name"])

    role = named(objs, "Role", "kvrouter-inferencepool-reader")
    assert role["rules"] == [
        {
            "apiGroups": ["inference.networking.k8s.io"],
            "resources": ["inferencepools"],
            "verbs": ["get", "list", "watch"],
        }
    ]
    binding = named(objs, "RoleBinding", "kvrouter-inferencepool-reader")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    sa = dep["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": "kvrouter"}]

    gw = named(objs, "NetworkPolicy", "vllm-workers-from-gateway")
    assert selects(gw["spec"]["podSelector"], labels)
    assert {p["port"] for p in gw["spec"]["ingress"][0]["ports"]} == set(
        p["number"] for p in pool["spec"]["targetPorts"]
    )
