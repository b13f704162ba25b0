"""What an operator deploys (deploy/): the KubeRay RayService carries serve_config.yaml
itself, the Docker image installs with the README's script, and every metric a Grafana
panel or a Prometheus alert queries exists, with the labels the query uses, in the
metrics a running app exports (scraped from the Ray node's metrics agent, where
Prometheus scrapes them)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import promql_parser
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy/grafana/loraplex.json"
ALERTS = ROOT / "deploy/prometheus/alerts.yaml"
RAYSERVICE = ROOT / "deploy/kuberay/rayservice.yaml"
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$model": ".*"}


def test_the_rayservice_embeds_serve_config_yaml():
    render = subprocess.run(
        [sys.executable, str(ROOT / "deploy/kuberay/render.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert render.returncode == 0, render.stderr
    service = yaml.safe_load(RAYSERVICE.read_text())
    embedded = yaml.safe_load(service["spec"]["serveConfigV2"])
    source = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    # serve run: the ingress replica serves HTTP itself; pods: Serve's proxy on the head.
    assert source["proxy_location"] == "Disabled"
    assert embedded["proxy_location"] == "HeadOnly"
    assert embedded["http_options"] == {"host": "0.0.0.0", "port": 8000}
    for app in source["applications"]:
        assert app["args"]["ingress"].pop("direct_http_port") == 8000
        app["args"]["ingress"].pop("direct_http_host")
    assert embedded["applications"] == source["applications"]
    assert embedded["controller_options"] == source["controller_options"]
    head = service["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    from loraplex.deployments.config import IngressOptions, ServerOptions

    drain = IngressOptions.model_fields["graceful_shutdown_timeout_s"].default
    graceful = ServerOptions.model_fields["graceful_shutdown_timeout_s"].default
    groups = [
        head,
        *(g["template"]["spec"] for g in service["spec"]["rayClusterConfig"]["workerGroupSpecs"]),
    ]
    for spec in groups:
        assert spec["terminationGracePeriodSeconds"] >= max(drain, graceful)


SHIPPED_SERVE_CONFIGS = sorted(ROOT.glob("scripts/*config.yaml"))


@pytest.mark.parametrize("path", SHIPPED_SERVE_CONFIGS, ids=lambda p: p.name)
def test_every_shipped_serve_config_runs_serve_as_serve_config_yaml_does(path):
    """Serve's settings (the proxy middleware, the idle-cost intervals) and who serves
    HTTP have one home, serve_config.yaml: each benchmark app takes them as they are, for
    its controller and for its replicas, so what it measures is what `serve run
    serve_config.yaml` runs."""
    source = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    settings = source["controller_options"]["runtime_env"]["env_vars"]
    assert [app["runtime_env"]["env_vars"] for app in source["applications"]] == [settings]
    http = {
        key: value
        for key, value in source["applications"][0]["args"]["ingress"].items()
        if key.startswith("direct_http")
    }
    config = yaml.safe_load(path.read_text())
    assert config["controller_options"] == source["controller_options"]
    assert config["proxy_location"] == source["proxy_location"]
    assert config.get("http_options") == source.get("http_options")
    for app in config["applications"]:
        assert app["runtime_env"] == {"env_vars": settings}, app["name"]
        ingress = app["args"]["ingress"]
        assert {k: v for k, v in ingress.items() if k.startswith("direct_http")} == http


SERVE_PORT = 8000
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


def _serve_dependent(probe: dict) -> bool:
    """Whether a probe asks the Serve proxy's port (the apps, or the proxy's own
    health): anything on it depends on Serve applications having been submitted."""
    http = probe.get("httpGet") or {}
    if http.get("port") in (SERVE_PORT, "serve") or str(http.get("path", "")).startswith("/health"):
        return True
    command = " ".join(probe.get("exec", {}).get("command", []))
    return f":{SERVE_PORT}" in command or "/health" in command


def test_no_head_probe_depends_on_serve_applications():
    """KubeRay submits serveConfigV2 only once the head pod is Ready (its HeadPodReady
    condition), so a head readiness or startup probe on the app can never pass: the app
    is never deployed. A liveness probe on it restarts the cluster whenever a model is
    replaced. The head carries no probe of its own (KubeRay injects raylet/GCS ones)
    and no worker probe asks the app's /health."""
    service = yaml.safe_load(RAYSERVICE.read_text())
    cluster = service["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]["template"]["spec"]
    for container in head["containers"]:
        for name in PROBES:
            probe = container.get(name)
            assert probe is None or not _serve_dependent(probe), (container["name"], name)
        ports = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
        assert ports.get("serve") == SERVE_PORT, "KubeRay builds the serve Service from it"
    for group in cluster["workerGroupSpecs"]:
        for container in group["template"]["spec"]["containers"]:
            for name in PROBES:
                probe = container.get(name) or {}
                assert "/health" not in json.dumps(probe), (group["groupName"], name)
    assert "serviceUnhealthySecondThreshold" not in service["spec"], "unused since KubeRay 1.3"


def test_the_image_installs_with_the_readme_quick_start_script():
    runs = re.findall(r"^RUN (.+)$", (ROOT / "Dockerfile").read_text(), re.MULTILINE)
    installs = [run for run in runs if "install" in run and "apt-get" not in run]
    assert installs == ["bash scripts/install.sh"]
    readme = (ROOT / "README.md").read_text()
    quick_start = readme[readme.index("## Quick start") :]
    commands = re.findall(r"^# 1\..*\n(.+)$", quick_start, re.MULTILINE)
    assert commands and commands[0].startswith("bash scripts/install.sh && ")


def test_the_image_serves_http_on_every_interface():
    """`docker run -p 8000:8000` reaches the app only if what listens in the container
    binds 0.0.0.0: the image's command rewrites serve_config.yaml's listening hosts
    (sed), and after it nothing that serves HTTP is left on 127.0.0.1."""
    command = re.search(r"^CMD (.+)$", (ROOT / "Dockerfile").read_text(), re.MULTILINE)
    assert command is not None
    edit = re.search(r"sed '(s/[^']+)'", command.group(1))
    assert edit is not None, command.group(1)
    pattern, replacement = edit.group(1).split("/")[1:3]
    served = yaml.safe_load((ROOT / "serve_config.yaml").read_text().replace(pattern, replacement))
    hosts = [served.get("http_options", {}).get("host", "0.0.0.0")]
    hosts += [app["args"]["ingress"].get("direct_http_host") for app in served["applications"]]
    assert [h for h in hosts if h is not None] and all(
        h == "0.0.0.0" for h in hosts if h is not None
    ), hosts


def queries() -> list[tuple[str, str]]:
    """(where, PromQL) of every dashboard target and alert rule."""
    found = []
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for name, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(name, value)
            found.append((f"panel {panel['title']!r}", expr))
    for group in yaml.safe_load(ALERTS.read_text())["groups"]:
        for rule in group["rules"]:
            found.append((f"alert {rule['alert']}", rule["expr"]))
    return found


def used_metrics(node, labels: frozenset[str] = frozenset()) -> list[tuple[str, frozenset[str]]]:
    """(metric, labels the query needs on it) for every selector under `node`: its own
    matchers' labels, and those of every aggregation's `by` and matching's `on` above."""
    kind = type(node).__name__
    if kind == "VectorSelector":
        names = {m.name for m in node.matchers.matchers} - {"__name__"}
        return [(node.name, labels | names)]
    if kind == "MatrixSelector":
        return used_metrics(node.vector_selector, labels)
    if kind == "AggregateExpr":
        grouping = set(node.modifier.labels) if node.modifier is not None else set()
        return used_metrics(node.expr, labels | grouping)
    if kind == "BinaryExpr":
        matching = set()
        if node.modifier is not None and node.modifier.matching is not None:
            matching = set(node.modifier.matching.labels)
        return used_metrics(node.lhs, labels | matching) + used_metrics(node.rhs, labels | matching)
    if kind == "Call":
        return [pair for arg in node.args for pair in used_metrics(arg, labels)]
    if kind in ("ParenExpr", "SubqueryExpr", "UnaryExpr"):
        return used_metrics(node.expr, labels)
    return []


def test_every_query_parses_and_names_its_metrics():
    for where, expr in queries():
        metrics = used_metrics(promql_parser.parse(expr))
        assert metrics, f"{where}: no metric in {expr}"


def exported_series(text: str) -> dict[str, set[str]]:
    """Metric name -> label names seen on its samples, from Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    series: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels)
    return series


def node_metrics_text() -> str:
    import ray

    node = next(n for n in ray.nodes() if n["Alive"])
    url = f"http://127.0.0.1:{node['MetricsExportPort']}/metrics"
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read().decode()


@pytest.mark.parametrize("tenant", ["acme"])
def test_every_queried_metric_is_exported_with_the_queried_labels(
    serve_setup, tenant_client, tenant
):
    client = tenant_client(tenant)
    client.completions.create(model="tiny:sa", prompt=[4, 4, 4], max_tokens=3)
    client.completions.create(model="tiny", prompt=[5, 6], max_tokens=3)
    wanted = {}
    for where, expr in queries():
        for metric, labels in used_metrics(promql_parser.parse(expr)):
            wanted.setdefault(metric, (set(), []))
            wanted[metric][0].update(labels)
            wanted[metric][1].append(where)
    deadline = time.monotonic() + 90
    while True:
        series = exported_series(node_metrics_text())
        problems = [
            f"{metric} (labels {sorted(labels - series.get(metric, set()))}) in {places[0]}"
            for metric, (labels, places) in sorted(wanted.items())
            if metric not in series or not labels <= series[metric]
        ]
        if not problems or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert not problems, "not exported: " + "; ".join(problems)
