"""docker/ holds real deployment files: they parse, the dashboard queries only metrics the processes export (in the
form Prometheus sees them), and every command in the compose files and the Dockerfile runs a console script that
pyproject.toml declares, with flags (and values) that script's own argparse parser accepts. No docker needed."""

import argparse
import importlib
import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest itself depends on tomli there
    import tomli as tomllib

from draft_worker.server import DraftMetrics
from gateway.metrics import GatewayMetrics
from shared import metric_names
from verify_worker.request import StepReport
from verify_worker.worker_metrics import VerifyMetrics

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
COMPOSE_FILES = sorted(p for p in DOCKER.glob("compose*.yml") if not p.name.endswith(".gpu.yml"))
YAML_FILES = sorted([*DOCKER.rglob("*.yml"), *DOCKER.rglob("*.yaml")])
DASHBOARDS = sorted((DOCKER / "grafana" / "dashboards").glob("*.json"))
IMAGE = "dflash-serve"
# Not the [a-z_]+ of a first draft: dflash_e2e_request_latency_seconds has digits.
METRIC_RE = re.compile(r"\bdflash_[a-z0-9_]+")
VAR_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$\$")


def load_yaml(path):
    with open(path) as f:
        return yaml.safe_load(f)


def pyproject():
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def console_scripts() -> dict:
    return pyproject()["project"]["scripts"]


def interpolate(text: str, where: str) -> str:
    """Compose's ${NAME:-default} / ${NAME-default} with the variable unset: the default. A variable without a
    default would make the command depend on the operator's shell, so it is an error here."""

    def one(match):
        if match.group(0) == "$$":
            return "$"
        name, op, default = match.groups()
        if op not in (":-", "-"):
            pytest.fail(f"{where}: ${{{name}}} has no default (use ${{{name}:-value}})")
        return default

    return VAR_RE.sub(one, str(text))


def dflash_services():
    """(compose file, service name, service) for every service that runs our image."""
    found = []
    for path in COMPOSE_FILES:
        for name, service in (load_yaml(path).get("services") or {}).items():
            if "build" in service or IMAGE in str(service.get("image", "")):
                found.append((path, name, service))
    return found


def command_argv(service, where) -> list[str]:
    command = service.get("command")
    assert command, f"{where}: no command (it would run the image's demo CMD)"
    argv = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
    return [interpolate(a, where) for a in argv]


def parse_with_script(argv: list[str], monkeypatch):
    """Run the console script's own parse_args on argv[1:]; return (its parser, the parsed settings)."""
    script, args = argv[0], argv[1:]
    scripts = console_scripts()
    assert script in scripts, f"{script!r} is not a console script of pyproject.toml ({sorted(scripts)})"
    module = importlib.import_module(scripts[script].split(":")[0])
    assert hasattr(module, "parse_args"), f"{script}: {module.__name__} has no parse_args to check flags with"
    parsers = []
    original = argparse.ArgumentParser.parse_args

    def capture(self, *a, **k):
        parsers.append(self)
        return original(self, *a, **k)

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", capture)
        try:
            namespace = module.parse_args(args)
        except SystemExit as exc:  # argparse: unknown flag, bad value or choice
            pytest.fail(f"{script} rejects {args}: exit {exc.code}")
    parser = parsers[0]
    for token in args:
        if token.startswith("--"):
            flag = token.split("=", 1)[0]
            # exact names only: argparse would also accept an abbreviation
            assert flag in parser._option_string_actions, f"{script} has no flag {flag}"
    return parser, namespace


@pytest.fixture(autouse=True)
def no_dflash_env(monkeypatch):
    """The role parsers take defaults from DFLASH_* variables; the checks must not depend on this shell's."""
    import os

    for name in list(os.environ):
        if name.startswith("DFLASH_"):
            monkeypatch.delenv(name)


# --- files parse --------------------------------------------------------------------------------------------


def test_every_yaml_and_dashboard_parses():
    names = {p.relative_to(DOCKER).as_posix() for p in YAML_FILES}
    for required in ("prometheus.yml", "prometheus-two-hosts.yml", "compose.host-a.yml", "compose.host-b.yml",
                     "grafana/provisioning/datasources/prometheus.yml", "grafana/provisioning/dashboards/dflash.yml"):
        assert required in names, f"docker/{required} is missing"
    for path in YAML_FILES:
        assert isinstance(load_yaml(path), dict), f"{path} is not a YAML mapping"
    assert DASHBOARDS, "no Grafana dashboard JSON in docker/grafana/dashboards"
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        assert 36 <= board["schemaVersion"] <= 41 and board["uid"] and board["panels"]


def test_pyyaml_is_a_declared_test_dependency():
    assert any(req.lower().startswith("pyyaml") for req in pyproject()["project"]["optional-dependencies"]["test"])


# --- dashboard ------------------------------------------------------------------------------------------------


def all_panels(panels):
    for panel in panels:
        yield panel
        yield from all_panels(panel.get("panels", []))


def dashboard_exprs(board) -> list[str]:
    return [t["expr"] for p in all_panels(board["panels"]) for t in p.get("targets", []) if t.get("expr")]


def exported_series() -> dict[str, str]:
    """Every series name the three processes expose (as Prometheus scrapes it) -> its base metric name."""
    registries = [GatewayMetrics().registry, VerifyMetrics("dflash").registry, DraftMetrics().registry]
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                "gauge": ("",)}
    series = {}
    for registry in registries:
        for family in registry.collect():
            for suffix in suffixes[family.type]:
                series[family.name + suffix] = family.name
    return series


def declared_metrics() -> set[str]:
    return {v for k, v in vars(metric_names).items() if k.isupper() and k != "PREFIX" and isinstance(v, str)}


def test_exported_metrics_are_the_declared_ones():
    assert set(exported_series().values()) == declared_metrics()


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_uses_only_real_metrics_and_shows_them_all(path):
    board = json.loads(path.read_text())
    series, declared = exported_series(), declared_metrics()
    used = set()
    for expr in dashboard_exprs(board):
        for name in METRIC_RE.findall(expr):
            base = re.sub(r"_(total|bucket|sum|count)$", "", name)
            assert base in declared or name in declared, f"{name} (in {expr!r}) is not in shared/metric_names.py"
            assert name in series, (f"{name} (in {expr!r}) is not exported as such: counters end in _total, "
                                    f"histograms are read through _bucket/_sum/_count, gauges have no suffix")
            used.add(series[name])
    assert declared - used == set(), f"metrics without a panel: {sorted(declared - used)}"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_layout_and_datasource(path):
    board = json.loads(path.read_text())
    datasources = load_yaml(DOCKER / "grafana/provisioning/datasources/prometheus.yml")["datasources"]
    uids = {d["uid"] for d in datasources}
    panels = list(all_panels(board["panels"]))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells = set()
    for panel in panels:
        g = panel["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24, f"{panel['title']}: outside the 24 columns"
        mine = {(g["y"] + dy, g["x"] + dx) for dy in range(g["h"]) for dx in range(g["w"])}
        assert not mine & cells, f"{panel['title']} overlaps another panel"
        cells |= mine
        if panel["type"] == "row":
            continue
        assert panel.get("targets"), f"{panel['title']}: no query"
        for ds in [panel.get("datasource"), *(t.get("datasource") for t in panel["targets"])]:
            assert ds and ds["uid"] in uids, f"{panel['title']}: datasource {ds} is not provisioned ({uids})"


def test_acceptance_length_formula_matches_what_the_verify_worker_counts():
    """The dashboard's acceptance length is accepted/drafts + 1: right only if dflash_spec_drafts_total counts one
    per request verify step that carried drafts (each commits its accepted drafts plus one target token)."""
    board = json.loads(DASHBOARDS[0].read_text())
    stat = next(p for p in all_panels(board["panels"]) if p["title"] == "Acceptance length")
    expr = " ".join(stat["targets"][0]["expr"].split())
    assert re.fullmatch(r"sum\(rate\(dflash_spec_accepted_tokens_total\[\S+\]\)\) / "
                        r"sum\(rate\(dflash_spec_drafts_total\[\S+\]\)\) \+ 1", expr), expr
    metrics = VerifyMetrics("dflash")
    # one engine step, two requests, 3 drafts each: one accepts 2 (commits 3 tokens), one accepts 0 (commits 1)
    metrics.record(StepReport(draft_tokens=6, accepted_tokens=2, drafted_at=[2, 2, 2], accepted_at=[1, 1, 0]))
    # and a request with a single draft that is accepted (commits 2)
    metrics.record(StepReport(draft_tokens=1, accepted_tokens=1, drafted_at=[1], accepted_at=[1]))
    value = metrics.registry.get_sample_value
    accepted = value("dflash_spec_accepted_tokens_total")
    drafts = value("dflash_spec_drafts_total")
    assert accepted / drafts + 1 == pytest.approx((3 + 1 + 2) / 3)
    assert value("dflash_spec_draft_tokens_per_position_total", {"position": "1"}) == 3
    assert value("dflash_spec_accepted_tokens_per_position_total", {"position": "3"}) == 0


# --- compose files and the Dockerfile ---------------------------------------------------------------------------


def test_compose_services_run_declared_scripts_with_accepted_flags(monkeypatch):
    services = dflash_services()
    assert services, "no service runs the dflash-serve image"
    scripts = set()
    for path, name, service in services:
        where = f"{path.name}:{name}"
        argv = command_argv(service, where)
        parse_with_script(argv, monkeypatch)
        scripts.add(argv[0])
    assert {"dflash-gateway", "dflash-verify-worker", "dflash-draft-worker"} <= scripts


def test_compose_gpu_and_networking():
    """The host files run on CPUs (docker/smoke.sh runs them so); each host's .gpu.yml overlay gives every worker
    role one NVIDIA GPU, and names only services of its host's file."""
    for path, name, service in dflash_services():
        assert service.get("network_mode") == "host", f"{path.name}:{name}: ZeroMQ/NCCL between hosts need host networking"
        assert "deploy" not in service, f"{path.name}:{name}: the GPU reservation belongs in the .gpu.yml overlay"
        overlay = load_yaml(path.with_name(path.stem + ".gpu.yml"))["services"]
        assert set(overlay) <= set(load_yaml(path)["services"]), f"{path.name}: the overlay names unknown services"
        if command_argv(service, name)[0] != "dflash-gateway":
            devices = overlay[name]["deploy"]["resources"]["reservations"]["devices"]
            assert any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices), name


def test_tensor_parallel_ranks_agree(monkeypatch):
    """Host B's rank 1 joins the group that host A's rank 0 hosts, and the two draft addresses meet."""
    by_rank, draft_bind, verify_draft = {}, None, None
    for path, name, service in dflash_services():
        argv = command_argv(service, name)
        _, ns = parse_with_script(argv, monkeypatch)
        if argv[0] == "dflash-verify-worker":
            by_rank[ns.parallel.rank] = (path.name, ns)
            if ns.parallel.rank == 0:
                verify_draft = ns.channels.draft_addr
        elif argv[0] == "dflash-draft-worker":
            draft_bind = ns.channels.draft_addr
    rank0, rank1 = by_rank[0][1], by_rank[1][1]
    assert by_rank[0][0] != by_rank[1][0], "the two ranks belong on the two hosts"
    assert (rank1.parallel.master_addr, rank1.parallel.master_port) == (rank0.parallel.master_addr,
                                                                        rank0.parallel.master_port)
    assert rank1.parallel.world_size == 2 and rank1.metrics.metrics_port == 0
    assert draft_bind.rsplit(":", 1)[1] == verify_draft.rsplit(":", 1)[1], (draft_bind, verify_draft)
    assert not verify_draft.startswith(("tcp://127.", "tcp://localhost")), "the draft worker runs on the other host"


def test_healthchecks_and_scrape_targets_use_the_real_ports(monkeypatch):
    routes = (ROOT / "gateway" / "service_routes.py").read_text()
    assert '@app.get("/health")' in routes
    targets = {}
    for job in load_yaml(DOCKER / "prometheus-two-hosts.yml")["scrape_configs"]:
        for group in job["static_configs"]:
            for target in group["targets"]:
                targets[target] = group.get("labels", {})
    expected = set()
    for path, name, service in dflash_services():
        argv = command_argv(service, name)
        _, ns = parse_with_script(argv, monkeypatch)
        host = "dflash-host-a" if "host-a" in path.name else "dflash-host-b"
        check = " ".join(interpolate(x, name) for x in service.get("healthcheck", {}).get("test", []))
        if argv[0] == "dflash-gateway":
            port = ns.http.port
            assert re.search(rf"127\.0\.0\.1:{port}/health(?![\w/])", check), f"{name}: healthcheck {check!r}"
        elif ns.metrics.metrics_port:
            port = ns.metrics.metrics_port
            assert ns.metrics.metrics_host == "0.0.0.0", f"{name}: Prometheus on the other host cannot reach 127.0.0.1"
            assert re.search(rf"127\.0\.0\.1:{port}/metrics(?![\w/])", check), f"{name}: healthcheck {check!r}"
        else:
            continue  # a TP follower: no port at all
        expected.add(f"{host}:{port}")
    assert expected == set(targets), f"scrape targets {sorted(targets)} vs the compose ports {sorted(expected)}"
    compose_a = load_yaml(DOCKER / "compose.host-a.yml")
    extra = " ".join(compose_a["services"]["prometheus"]["extra_hosts"])
    assert "dflash-host-a:" in extra and "dflash-host-b:" in extra


def test_grafana_provisioning_points_at_the_mounted_dashboards():
    provider = load_yaml(DOCKER / "grafana/provisioning/dashboards/dflash.yml")["providers"][0]
    volumes = load_yaml(DOCKER / "compose.host-a.yml")["services"]["grafana"]["volumes"]
    mounts = dict(v.split(":")[:2] for v in volumes)
    assert mounts.get("./grafana/dashboards") == provider["options"]["path"]
    assert mounts.get("./grafana/provisioning") == "/etc/grafana/provisioning"


def test_dockerfile_copies_real_paths_and_runs_a_declared_script(monkeypatch):
    text = (DOCKER / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    assert lines[0].startswith("ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:") and lines[1] == "FROM ${BASE_IMAGE}"
    for line in lines:
        if line.startswith("COPY"):
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
    run = next(line for line in lines if line.startswith("RUN") and "pip install" in line)
    assert "--constraint" in run and " ." in run, "install the project with torch pinned to the base image's"
    cmd = json.loads(next(line for line in lines if line.startswith("CMD"))[len("CMD"):])
    _, ns = parse_with_script(cmd, monkeypatch)
    copy = next(line.split() for line in lines if line.startswith("COPY models/demo "))
    model = ns.model
    assert model.target.startswith(copy[-1] + "/") and model.draft.startswith(copy[-1] + "/"), (model.target, copy)
    assert (ROOT / "models/demo" / Path(model.target).name / "config.json").exists()
    assert (ROOT / "models/demo" / Path(model.draft).name / "config.json").exists()
    ignore = (DOCKER / "Dockerfile.dockerignore").read_text().split()
    assert "runs" in ignore and ".git" in ignore
    # every package the distribution installs is copied into the image (and not filtered out of the context)
    packages = re.search(r'include = \[([^\]]*)\]', (ROOT / "pyproject.toml").read_text()).group(1)
    copied = {line.split()[1] for line in lines if line.startswith("COPY")}
    for package in re.findall(r'"(\w+)\*"', packages):
        assert package in copied and package not in ignore, f"the image lacks the package {package}"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_the_dashboard_checker_runs_every_query_with_grafanas_variables_filled_in(path):
    spec = importlib.util.spec_from_file_location("check_dashboard", DOCKER / "check_dashboard.py")
    checker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(checker)
    board = json.loads(path.read_text())
    queries = checker.panel_queries(board)
    assert [expr for _, expr in queries] == dashboard_exprs(board)
    for _, expr in queries:
        assert "$" not in checker.with_grafana_variables(expr, "5m"), expr


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cpu"])
def test_images_run_as_a_user_with_a_readiness_healthcheck_and_a_declared_command(dockerfile, monkeypatch):
    text = (DOCKER / dockerfile).read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0"), f"{dockerfile}: the image must not run as root"
    health = next(line for line in lines if line.startswith("HEALTHCHECK"))
    assert "/ready" in health and ":8000" in health
    cmd = json.loads(next(line for line in lines if line.startswith("CMD"))[len("CMD"):])
    _, settings = parse_with_script(cmd, monkeypatch)
    assert settings.http.port == 8000 and settings.http.host == "0.0.0.0"
