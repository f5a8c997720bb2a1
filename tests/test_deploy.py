"""The docker compose deployment (docker-compose.yml, ops/) agrees with the code it deploys.

Nothing here starts a container: the compose file and the configs are parsed, every ``pagedkv``
command in the compose file is parsed by the real CLI parser (so flags cannot drift), and the
wiring between services (worker -> control plane, Prometheus -> /metrics, control plane -> OTLP
collector -> Jaeger, Grafana -> Prometheus) is checked by name and port. Every metric the Grafana
dashboard queries must exist in `scheduler.metrics.Metrics`.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import pytest

yaml = pytest.importorskip("yaml")

from pagedkv.scheduler.cli import _engine_config, build_parser  # noqa: E402
from pagedkv.scheduler.metrics import Metrics  # noqa: E402
from pagedkv.common.tracing import EXPORTERS  # noqa: E402
from prometheus_client import generate_latest  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OPS = ROOT / "ops"
LOCAL_OVERRIDE = OPS / "docker-compose.local.yml"
DEFAULT_OVERRIDE = ROOT / "docker-compose.override.yml"
CONTROL_PLANE = "control-plane"
WORKERS = ("worker", "worker-gpu")

# Compose's interpolation (https://docs.docker.com/reference/compose-file/interpolation/), the
# subset the compose file uses: $$, ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:+alt}, ${VAR+alt},
# ${VAR:?error} (required: unset or empty is an error).
_VAR = re.compile(r"\$(\$|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-+?])([^}]*))?\})")


def _interpolate(value, env: dict[str, str]):
    if isinstance(value, dict):
        return {k: _interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m.group(1) == "$":
            return "$"
        name, op, word = m.group(2), m.group(3), m.group(4) or ""
        val = env.get(name)
        present = val is not None and (val != "" or not (op or "").startswith(":"))
        if op in (":-", "-"):
            return val if present else word
        if op in (":+", "+"):
            return word if present else ""
        if op in (":?", "?"):
            if not present:
                raise ValueError(f"compose: required variable {name} is missing: {word}")
            return val
        return val or ""

    return _VAR.sub(sub, value)


SECRET = "0123456789abcdef" * 4  # PAGEDKV_WORKER_SECRET, which the compose file requires


def _load(path: Path, env: dict[str, str] | None) -> dict:
    return _interpolate(yaml.safe_load(path.read_text()), {"PAGEDKV_WORKER_SECRET": SECRET, **(env or {})})


def _merge(services: dict, override: dict) -> dict:
    """Services with an override file's services over them, as Compose merges them: mappings key by
    key (build, environment), lists joined (ports, extra_hosts), command and entrypoint replaced."""
    merged = {name: dict(svc) for name, svc in services.items()}
    for name, over in override.items():
        svc = merged.setdefault(name, {})
        for key, value in over.items():
            old = svc.get(key)
            if isinstance(old, dict) and isinstance(value, dict):
                svc[key] = {**old, **value}
            elif isinstance(old, list) and isinstance(value, list) and key not in ("command", "entrypoint"):
                svc[key] = old + value
            else:
                svc[key] = value
    return merged


def _compose(env: dict[str, str] | None = None) -> dict:
    """What `docker compose up` reads: docker-compose.yml with docker-compose.override.yml over it."""
    raw = _load(ROOT / "docker-compose.yml", env)
    return {**raw, "services": _merge(raw["services"], _load(DEFAULT_OVERRIDE, env)["services"])}


def _local(env: dict[str, str] | None = None) -> dict:
    """The services ops/compose_check.sh starts: docker-compose.yml with ops/docker-compose.local.yml
    over it (given with -f, so docker-compose.override.yml is not read)."""
    base = _load(ROOT / "docker-compose.yml", env)["services"]
    override = _load(LOCAL_OVERRIDE, env)["services"]
    return {name: svc for name, svc in _merge(base, override).items() if name in override}


def _argv(service: dict) -> list[str]:
    """The service's command as Compose passes it: a string is split shell-style, a list taken as is."""
    cmd = service["command"]
    return shlex.split(cmd) if isinstance(cmd, str) else list(cmd)


def _parse_pagedkv(service: dict):
    argv = _argv(service)
    assert argv[0] == "pagedkv", argv
    return build_parser().parse_args(argv[1:])


def _yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _mounts(service: dict) -> dict[str, str]:
    """Container path -> host path of the service's bind mounts (short syntax)."""
    out = {}
    for v in service.get("volumes", []):
        host, container = v.split(":")[:2]
        out[container] = host
    return out


def _bind_port(address: str) -> int:
    return urlsplit(address).port


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    # --model checks for config.json when it parses; the contents do not matter to the parser
    d = tmp_path / "X"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


# ---- the pagedkv commands ---------------------------------------------------------------------

def test_compose_refuses_to_start_without_the_worker_secret():
    raw = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    with pytest.raises(ValueError, match="PAGEDKV_WORKER_SECRET"):
        _interpolate(raw, {})


def test_control_plane_and_workers_share_the_worker_secret():
    services = _compose()["services"]
    for name in (CONTROL_PLANE, *WORKERS):
        assert services[name]["environment"]["PAGEDKV_WORKER_SECRET"] == SECRET, name


def test_control_plane_command_parses_with_the_real_cli_and_waits_for_an_external_worker(monkeypatch):
    services = _compose()["services"]
    monkeypatch.setenv("PAGEDKV_WORKER_SECRET", services[CONTROL_PLANE]["environment"]["PAGEDKV_WORKER_SECRET"])
    args = _parse_pagedkv(services[CONTROL_PLANE])
    assert args.command == "serve"
    assert args.external_worker is True
    assert urlsplit(args.worker_address).scheme == "tcp"
    assert urlsplit(args.worker_address).hostname == "0.0.0.0"
    assert args.host == "0.0.0.0"
    assert args.model is None  # MODEL unset: the embedded default
    assert args.log_format == "json"
    # the cross-flag checks `pagedkv serve` runs before it starts (e.g. --external-worker needs an address)
    config = _engine_config(args, build_parser())
    assert config.model is None


def test_model_variable_becomes_the_model_flag(model_dir: Path):
    services = _compose({"MODEL": str(model_dir)})["services"]
    args = _parse_pagedkv(services[CONTROL_PLANE])
    assert args.model == str(model_dir)
    assert args.external_worker is True


def test_extra_serve_flags_pass_through():
    services = _compose({"PAGEDKV_ARGS": "--max-model-len 128 --max-num-seqs 8"})["services"]
    args = _parse_pagedkv(services[CONTROL_PLANE])
    assert (args.max_model_len, args.max_num_seqs) == (128, 8)


@pytest.mark.parametrize("worker", WORKERS)
def test_worker_connects_to_the_control_plane_service_and_port(worker: str):
    services = _compose()["services"]
    serve = _parse_pagedkv(services[CONTROL_PLANE])
    args = _parse_pagedkv(services[worker])
    assert args.command == "worker"
    url = urlsplit(args.connect)
    assert url.scheme == "tcp"
    assert url.hostname == CONTROL_PLANE and CONTROL_PLANE in services
    assert url.port == _bind_port(serve.worker_address)
    assert CONTROL_PLANE in services[worker]["depends_on"]


def test_the_step_protocol_port_is_never_published_to_the_host():
    services = _compose()["services"]
    port = _bind_port(_parse_pagedkv(services[CONTROL_PLANE]).worker_address)
    for name in (CONTROL_PLANE, *WORKERS):
        published = [p.split(":")[-1] for p in services[name].get("ports", [])]
        assert str(port) not in published, name


def test_api_port_is_published_and_health_checked():
    services = _compose()["services"]
    cp = services[CONTROL_PLANE]
    port = _parse_pagedkv(cp).port
    assert any(p.endswith(f":{port}") for p in cp["ports"])
    assert f"127.0.0.1:{port}/health" in " ".join(cp["healthcheck"]["test"])


def test_model_directory_is_mounted_read_only_at_the_same_path_in_both_pagedkv_containers():
    # the control plane sends its --model path to the worker, which opens it itself
    services = _compose()["services"]
    for name in (CONTROL_PLANE, *WORKERS):
        vols = [v for v in services[name]["volumes"] if v.split(":")[1] == "/models"]
        assert vols, f"{name} does not mount /models"
        assert vols[0].endswith(":ro"), name
        assert vols[0].split(":")[0] == "./models"


def test_gpu_profile_worker_reserves_a_gpu_and_runs_the_same_command():
    services = _compose()["services"]
    cpu, gpu = services["worker"], services["worker-gpu"]
    assert "profiles" not in cpu  # `docker compose up` starts the CPU worker
    assert gpu["profiles"] == ["gpu"]
    assert _argv(gpu) == _argv(cpu)
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert "/whl/cu" in gpu["build"]["args"]["TORCH_INDEX_URL"]
    assert gpu["image"] != cpu["image"]


# ---- the local override (ops/docker-compose.local.yml, what ops/compose_check.sh starts) --------

def test_local_override_puts_every_started_service_on_the_host_network_bound_to_loopback(model_dir: Path,
                                                                                          monkeypatch):
    services = _local({"MODEL": str(model_dir)})
    # the control plane gets the worker secret from the base file's environment, as Compose merges it
    monkeypatch.setenv("PAGEDKV_WORKER_SECRET", _compose()["services"][CONTROL_PLANE]["environment"]["PAGEDKV_WORKER_SECRET"])
    assert set(services) == {CONTROL_PLANE, "worker", "prometheus"}
    assert all(svc["network_mode"] == "host" for svc in services.values())
    serve = _parse_pagedkv(services[CONTROL_PLANE])
    assert serve.host == "127.0.0.1" and urlsplit(serve.worker_address).hostname == "127.0.0.1"
    assert serve.model == str(model_dir) and serve.external_worker is True
    assert _engine_config(_parse_pagedkv(_local()[CONTROL_PLANE]), build_parser()).model is None  # MODEL unset
    worker = _parse_pagedkv(services["worker"])
    assert worker.connect == serve.worker_address
    assert "--web.listen-address=127.0.0.1:9090" in services["prometheus"]["command"]
    # docker refuses published ports on the host network: none may come from docker-compose.yml
    assert not any(svc.get("ports") for svc in services.values())


def test_local_prometheus_resolves_the_scrape_target_to_loopback():
    prom = _local()["prometheus"]
    targets = [t for job in _yaml(OPS / "prometheus.yml")["scrape_configs"]
               for sc in job["static_configs"] for t in sc["targets"]]
    hosts = dict(h.split(":") for h in prom["extra_hosts"])
    assert all(hosts[t.split(":")[0]] == "127.0.0.1" for t in targets)
    assert _mounts(prom)["/etc/prometheus/prometheus.yml"] == "./ops/prometheus.yml"


def test_local_override_builds_on_the_local_base_with_torch_from_a_wheelhouse():
    services = _local({"WHEELHOUSE_URL": "http://127.0.0.1:8765/"})
    for name in (CONTROL_PLANE, "worker"):
        build = services[name]["build"]
        assert (build["context"], build["dockerfile"], build["network"]) == (".", "ops/Dockerfile", "host")
        assert build["args"] == {"BASE_IMAGE": "pagedkv-base:bookworm", "WHEELHOUSE_URL": "http://127.0.0.1:8765/"}
        assert services[name]["image"] == "pagedkv:cpu"
    prom = services["prometheus"]
    assert prom["image"] == "pagedkv-prometheus:local" and "build" in prom
    assert prom["build"]["args"]["BASE_IMAGE"] == "pagedkv-base:bookworm"
    assert "apt-get install" in (ROOT / prom["build"]["context"] / prom["build"]["dockerfile"]).read_text()
    # no collector runs beside the local stack: tracing is off, by a value the engine accepts
    assert services[CONTROL_PLANE]["environment"]["OTEL_TRACES_EXPORTER"] in EXPORTERS


# ---- images and build --------------------------------------------------------------------------

def test_every_image_is_pinned_to_a_version():
    for name, svc in _compose()["services"].items():
        image = svc["image"]
        repo, _, tag = image.rpartition(":")
        assert repo and tag and tag != "latest", f"{name}: {image}"
        if "build" not in svc:  # pulled images: a numbered release
            assert re.search(r"\d+\.\d+\.\d+", tag), f"{name}: {image}"


def test_dockerfile_defaults_to_a_pinned_cpu_build_and_builds_the_packages_it_needs():
    text = (OPS / "Dockerfile").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)", text, re.M))
    assert re.fullmatch(r"python:3\.\d+\.\d+-slim-\w+", args["BASE_IMAGE"])
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert re.fullmatch(r"\d+\.\d+\.\d+", args["TORCH_VERSION"])
    assert "FROM ${BASE_IMAGE}" in text
    # the image copies every folder pyproject.toml ships as pagedkv.<folder>, and the root package
    shipped = re.search(r'packages = \[([^\]]*)\]', (ROOT / "pyproject.toml").read_text()).group(1)
    folders = re.findall(r'"pagedkv\.(\w+)"', shipped)
    assert folders == ["common", "scheduler", "worker", "kernels", "bench"]
    for pkg in folders:
        assert f"COPY {pkg} {pkg}" in text, pkg
    assert "COPY __init__.py ./" in text
    for name in ("control-plane", "worker", "worker-gpu"):
        build = _compose()["services"][name]["build"]
        assert (build["context"], build["dockerfile"]) == (".", "ops/Dockerfile")


def _dockerfile_args(path: Path) -> set[str]:
    return set(re.findall(r"^ARG (\w+)", path.read_text(), re.M))


def test_every_build_arg_the_compose_files_pass_is_declared_in_its_dockerfile():
    services = {**_compose()["services"], **{f"{k} (local)": v for k, v in _local().items()}}
    checked = 0
    for name, svc in services.items():
        build = svc.get("build")
        if not build:
            continue
        dockerfile = ROOT / build["context"] / build["dockerfile"]
        undeclared = set(build.get("args", {})) - _dockerfile_args(dockerfile)
        assert not undeclared, f"{name}: {sorted(undeclared)} not an ARG of {dockerfile.name}"
        checked += len(build.get("args", {}))
    assert checked >= 5  # worker-gpu's two, and BASE_IMAGE / WHEELHOUSE_URL in the local override


def test_dockerfile_installs_torch_from_its_own_source_before_the_dependencies():
    text = (OPS / "Dockerfile").read_text()
    torch_from_index = text.index('pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"')
    torch_from_folder = text.index('pip install --no-index --find-links "${WHEELHOUSE_URL}" "torch==${TORCH_VERSION}"')
    deps = text.index("-r /tmp/requirements.txt")
    assert max(torch_from_index, torch_from_folder) < deps < text.index("--no-deps .")
    assert "python3 -m venv /opt/venv" in text and "PATH=/opt/venv/bin:$PATH" in text


def test_dependency_layer_installs_pyproject_dependencies_except_torch_and_triton(tmp_path: Path):
    # run the Dockerfile's own filter on the real pyproject.toml: the CPU image must not pull
    # PyPI's torch (a CUDA build) or Triton (it ships CUPTI and ptxas)
    text = (OPS / "Dockerfile").read_text()
    script = re.search(r"RUN python -c '(.*?)' \\\n\s*> /tmp/requirements.txt", text, re.S).group(1)
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    out = subprocess.run([sys.executable, "-c", script.replace("\\\n", "")], cwd=tmp_path,
                         capture_output=True, text=True, check=True).stdout.split("\n")
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert [d for d in out if d] == [d for d in deps if not d.startswith(("torch", "triton"))]
    assert any(d.startswith("triton") for d in deps)  # the filter has something to drop


def test_compose_files_use_only_interpolation_that_docker_compose_1_reads():
    # Debian bookworm ships docker-compose 1.29, which rejects ${VAR:+alt} and ${VAR+alt}
    for path in (ROOT / "docker-compose.yml", DEFAULT_OVERRIDE, LOCAL_OVERRIDE):
        for m in _VAR.finditer(path.read_text()):
            assert m.group(3) in (None, ":-", "-", ":?", "?"), f"{path.name}: {m.group(0)}"


def test_ops_shell_scripts_parse():
    for script in ("build_base_image.sh", "compose_check.sh"):
        subprocess.run(["bash", "-n", str(OPS / script)], check=True)


def test_dockerignore_keeps_checkpoints_and_git_out_of_the_build_context():
    lines = (ROOT / ".dockerignore").read_text().split()
    assert "models/" in lines and ".git/" in lines


def test_every_bind_mounted_config_exists_in_the_repo():
    for name, svc in _compose()["services"].items():
        for container, host in _mounts(svc).items():
            if container == "/models":
                continue
            assert (ROOT / host).exists(), f"{name}: {host}"


# ---- Prometheus --------------------------------------------------------------------------------

def test_prometheus_scrapes_the_control_plane_metrics_endpoint():
    services = _compose()["services"]
    port = _parse_pagedkv(services[CONTROL_PLANE]).port
    prom = services["prometheus"]
    config_flag = next(a for a in prom["command"] if a.startswith("--config.file="))
    assert _mounts(prom)[config_flag.split("=", 1)[1]] == "./ops/prometheus.yml"
    jobs = _yaml(OPS / "prometheus.yml")["scrape_configs"]
    targets = [(t, job.get("metrics_path", "/metrics")) for job in jobs
               for sc in job["static_configs"] for t in sc["targets"]]
    assert (f"{CONTROL_PLANE}:{port}", "/metrics") in targets


# ---- tracing -----------------------------------------------------------------------------------

def test_control_plane_exports_otlp_http_to_the_collector():
    services = _compose()["services"]
    env = services[CONTROL_PLANE]["environment"]
    assert env["OTEL_TRACES_EXPORTER"] == "otlp"
    endpoint = urlsplit(env["OTEL_EXPORTER_OTLP_ENDPOINT"])
    assert endpoint.scheme == "http" and endpoint.hostname in services
    collector = services[endpoint.hostname]
    config_path = next(a for a in collector["command"] if a.startswith("--config=")).split("=", 1)[1]
    assert _mounts(collector)[config_path] == "./ops/otel-collector.yaml"
    http = _yaml(OPS / "otel-collector.yaml")["receivers"]["otlp"]["protocols"]["http"]
    host, port = http["endpoint"].rsplit(":", 1)
    assert host == "0.0.0.0" and int(port) == endpoint.port


def test_collector_pipeline_takes_otlp_traces_to_jaeger():
    services = _compose()["services"]
    config = _yaml(OPS / "otel-collector.yaml")
    pipeline = config["service"]["pipelines"]["traces"]
    assert "otlp" in pipeline["receivers"] and "http" in config["receivers"]["otlp"]["protocols"]
    for kind in ("receivers", "processors", "exporters"):
        for component in pipeline.get(kind, []):
            assert component in config[kind], f"{kind}: {component} is used but not defined"
    exporters = [config["exporters"][e] for e in pipeline["exporters"]]
    hosts = [urlsplit("//" + e["endpoint"].split("://")[-1]).hostname for e in exporters]
    assert "jaeger" in hosts and "jaeger" in services
    assert any(p.endswith(":16686") for p in services["jaeger"]["ports"])  # the UI


# ---- Grafana -----------------------------------------------------------------------------------

def _metric_names() -> set[str]:
    """Every series name the engine's registry exports, with prometheus_client's suffixes."""
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created"),
                "gauge": ("",), "summary": ("", "_count", "_sum", "_created")}
    return {family.name + s for family in Metrics("x").registry.collect() for s in suffixes[family.type]}


def _dashboard_exprs() -> list[str]:
    dash = json.loads((OPS / "grafana" / "dashboards" / "pagedkv.json").read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def test_every_metric_the_dashboard_queries_exists_in_the_engine():
    exported = _metric_names()
    queried = {m for e in _dashboard_exprs() for m in re.findall(r"pagedkv:[A-Za-z0-9_:]+", e)}
    assert queried, "the dashboard queries no pagedkv metric"
    assert queried <= exported, sorted(queried - exported)


def test_every_series_the_dashboard_queries_is_exported_before_any_request():
    # Prometheus has a series only once the engine exports it: a fresh engine exports them all (zeros)
    text = generate_latest(Metrics("x").registry).decode()
    exported = set(re.findall(r"^(pagedkv:[A-Za-z0-9_:]+)\{", text, re.M))
    queried = {m for e in _dashboard_exprs() for m in re.findall(r"pagedkv:[A-Za-z0-9_:]+", e)}
    assert queried <= exported, sorted(queried - exported)
    assert 'pagedkv:num_preemptions_total{mode="recompute",model_name="x"} 0.0' in text


def test_dashboard_shows_the_serving_essentials():
    exprs = "\n".join(_dashboard_exprs())
    for needed in ("pagedkv:kv_cache_usage_perc", "pagedkv:num_requests_running", "pagedkv:num_requests_waiting",
                   "rate(pagedkv:generation_tokens_total"):
        assert needed in exprs, needed
    assert re.search(r"sum by \(mode\) \(rate\(pagedkv:num_preemptions_total", exprs)
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert re.search(rf"histogram_quantile\(0\.\d+, sum by \(le\) \(rate\(pagedkv:{hist}_bucket", exprs), hist
    # the preemption counter really carries the `mode` label the panel groups by, both modes from the start
    m = Metrics("x")
    m.on_preemption("swap")
    totals = {s.labels["mode"]: s.value for f in m.registry.collect() if f.name == "pagedkv:num_preemptions"
              for s in f.samples if s.name == "pagedkv:num_preemptions_total"}
    assert totals == {"recompute": 0.0, "swap": 1.0}


def test_grafana_provisions_the_prometheus_datasource_and_the_dashboard():
    services = _compose()["services"]
    grafana = _mounts(services["grafana"])
    prov = ROOT / grafana["/etc/grafana/provisioning"]
    (ds,) = _yaml(prov / "datasources" / "prometheus.yml")["datasources"]
    url = urlsplit(ds["url"])
    assert ds["type"] == "prometheus" and url.hostname == "prometheus" and url.port == 9090
    assert any(p.endswith(":9090") for p in services["prometheus"]["ports"])
    (provider,) = _yaml(prov / "dashboards" / "pagedkv.yml")["providers"]
    assert grafana[provider["options"]["path"]] == "./ops/grafana/dashboards"
    dash = json.loads((OPS / "grafana" / "dashboards" / "pagedkv.json").read_text())
    for panel in dash["panels"]:
        assert panel["datasource"]["uid"] == ds["uid"], panel["title"]
        for t in panel["targets"]:
            assert t["datasource"]["uid"] == ds["uid"], panel["title"]
