"""configs/cluster/: the `ray up` YAML (local provider over a tpu7x-16 slice's two hosts) and the
KubeRay RayCluster for GKE TPU v7x parse, have the keys a deployment needs (the KubeRay head's
probes on the serve line's --http-port among them), and every value a user must fill in is a
<PLACEHOLDER> that docs/deploy.md documents."""

import pathlib
import re

import pytest

yaml = pytest.importorskip("yaml")

ROOT = pathlib.Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "configs" / "cluster"
RAY_UP = CLUSTER / "tpu7x-16-ray-up.yaml"
KUBERAY = CLUSTER / "tpu7x-16-kuberay.yaml"
DEPLOY = ROOT / "docs" / "deploy.md"
PLACEHOLDER = re.compile(r"<[A-Z][A-Z0-9_]*>")
SERVE = ("cp-runtime serve --executor ray --hosts 2 --devices-per-host 8 --ray-address auto "
         "--host 0.0.0.0")


def _load(path):
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _words(command: str) -> str:
    return " ".join(command.replace("~/cp-runtime-venv/bin/", "").split())


def test_ray_up_uses_the_local_provider_over_two_hosts():
    (cfg,) = _load(RAY_UP)
    assert cfg["cluster_name"]
    provider = cfg["provider"]
    assert provider["type"] == "local"
    assert provider["head_ip"] == "<HEAD_IP>" and provider["worker_ips"] == ["<WORKER_IP>"]
    assert cfg["auth"]["ssh_user"] and cfg["auth"]["ssh_private_key"]
    assert cfg["min_workers"] == cfg["max_workers"] == 1       # host 1; host 0 is the head


def test_ray_up_installs_the_tpu_extra_and_starts_the_server_with_a_token_from_env():
    (cfg,) = _load(RAY_UP)
    setup = " ".join(cfg["setup_commands"])
    assert re.search(r"pip install \S*\[tpu,ray,http\]", setup)     # http: --http-port
    head = [_words(c) for c in cfg["head_start_ray_commands"]]
    assert any("ray start --head" in c for c in head)
    serve = [c for c in head if SERVE in c]
    assert len(serve) == 1
    assert "CP_RUNTIME_TOKEN=" in serve[0] and "--auth-token" not in serve[0]
    assert "--tpu-topology 2x2x2 --tpu-version v7x" in serve[0]
    assert any("ray start --address=$RAY_HEAD_IP:6379" in _words(c)
               for c in cfg["worker_start_ray_commands"])
    assert set(cfg["file_mounts"].values()) == {"<TOKEN_FILE>"}


def test_kuberay_cluster_places_one_pod_per_tpu7x_host():
    cluster, service = _load(KUBERAY)
    assert (cluster["apiVersion"], cluster["kind"]) == ("ray.io/v1", "RayCluster")
    (group,) = cluster["spec"]["workerGroupSpecs"]
    assert group["numOfHosts"] == 2 and group["replicas"] == 1
    pod = group["template"]["spec"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu7x",
                                   "cloud.google.com/gke-tpu-topology": "2x2x2"}
    (container,) = pod["containers"]
    for kind in ("requests", "limits"):
        assert str(container["resources"][kind]["google.com/tpu"]) == "4"
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in head["env"]}
    assert "secretKeyRef" in env["CP_RUNTIME_TOKEN"]["valueFrom"]
    start = _words(" ".join(head["lifecycle"]["postStart"]["exec"]["command"]))
    assert SERVE in start
    assert service["kind"] == "Service"


@pytest.mark.parametrize("path", [RAY_UP, KUBERAY], ids=lambda p: p.name)
def test_every_placeholder_is_documented(path):
    found = set(PLACEHOLDER.findall(path.read_text()))
    assert found, f"{path.name} has no <PLACEHOLDER>: values to fill in must be marked"
    documented = set(re.findall(r"^\| `(<[A-Z][A-Z0-9_]*>)` \|", DEPLOY.read_text(), re.M))
    assert not found - documented, f"undocumented in docs/deploy.md: {found - documented}"


def test_deploy_walks_through_both_files():
    text = DEPLOY.read_text()
    for needle in ("tpu7x-16-ray-up.yaml", "tpu7x-16-kuberay.yaml", "ray up", "kubectl apply",
                   "numOfHosts", "google.com/tpu: 4", "Cloud TPU API"):
        assert needle in text, needle


def test_configs_ship_as_package_data():
    text = (ROOT / "pyproject.toml").read_text()
    assert '"cluster/*.yaml"' in text
    # pyyaml only where it is used: the tests read the manifests, the runtime never does
    assert re.search(r'(?m)^test = \[[^]]*"pyyaml', text)
    assert not re.search(r'(?ms)^dependencies = \[[^]]*pyyaml', text)


def _serve_args(command: str):
    """The serve line's flags, parsed by the real `cp-runtime serve` parser."""
    from cp_runtime.cli.main import build_parser

    line = re.split(r"\s>\s", _words(command).split("cp-runtime serve", 1)[1])[0]
    return build_parser().parse_args(["serve", *line.rstrip(" '").split()])


def _kuberay_head() -> dict:
    cluster, _ = _load(KUBERAY)
    return cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]


def _serve_commands() -> list[str]:
    (ray_up,) = _load(RAY_UP)
    kube = " ".join(_kuberay_head()["lifecycle"]["postStart"]["exec"]["command"])
    return [c for c in ray_up["head_start_ray_commands"] if "cp-runtime serve" in c] + [kube]


def test_both_serve_lines_serve_http():
    ports = {_serve_args(c).http_port for c in _serve_commands()}
    assert ports == {8000}


def test_kuberay_head_probes_the_servers_http_port():
    head = _kuberay_head()
    port = _serve_args(_serve_commands()[-1]).http_port
    assert {"containerPort": port, "name": "http"} in head["ports"]
    _, service = _load(KUBERAY)
    assert {"name": "http", "port": port, "targetPort": port} in service["spec"]["ports"]
    # Ready: /health says 200 (503 while sessions are restored takes the pod out of the Service).
    ready = head["readinessProbe"]
    assert ready["httpGet"] == {"path": "/health", "port": port}
    # Alive: the port listens. Not /health, which is 503 for as long as a restore takes: a
    # liveness probe on it would restart a recovering server.
    live = head["livenessProbe"]
    assert live["tcpSocket"] == {"port": port} and "httpGet" not in live and "exec" not in live
    # The weights load before the server listens: the startup probe waits an hour for it, and
    # holds liveness off until then.
    start = head["startupProbe"]
    assert start["tcpSocket"] == {"port": port}
    assert start["periodSeconds"] * start["failureThreshold"] >= 3600


def test_ray_up_says_how_to_check_health():
    port = _serve_args(_serve_commands()[0]).http_port
    for text in (RAY_UP.read_text(), DEPLOY.read_text()):
        assert f"http://127.0.0.1:{port}/health" in text


@pytest.mark.parametrize("model_name", ["glm-5.2", "deepseek-v3.2"])
def test_serve_lines_fit_a_tpu7x_16_slice(model_name):
    """Each serve line, as its checkpoint's model would run it on 16 devices of 96 GiB: the
    weights split in the line's dtype, plus the line's pool, plus the reserve, fit a device."""
    from cp_runtime.cache.capacity import TOPOLOGIES, bytes_per_token, deployment_report
    from cp_runtime.config import RuntimeConfig, load_model_config
    from cp_runtime.weights.format import resolve_runtime_weights

    model, topo = load_model_config(model_name), TOPOLOGIES["tpu7x-16"]
    commands = _serve_commands()
    assert len(commands) == 2
    for command in commands:
        args = _serve_args(command)
        assert args.shards == topo.devices == args.hosts * args.devices_per_host
        runtime = RuntimeConfig(model=model.name, kv_cache_dtype=args.kv_cache_dtype,
                                page_size=args.page_size, num_shards=args.shards,
                                pages_per_shard=args.pages_per_shard, weights=args.weights,
                                weight_dtype=args.weight_dtype)
        runtime = resolve_runtime_weights(runtime, model, int(topo.hbm_gib * 2**30))
        assert runtime.weights == "sharded"
        report = deployment_report(model, runtime.kv_cache_dtype, devices=topo.devices,
                                   hbm_gib=topo.hbm_gib, weight_dtype=runtime.weight_dtype,
                                   weights=runtime.weights)
        pool = (runtime.pages_per_shard + 1) * runtime.page_size * bytes_per_token(
            model, runtime.kv_cache_dtype)
        used = report.weight_bytes_per_device + pool + report.reserve_gib_per_device * 2**30
        assert used <= topo.hbm_gib * 2**30, (command, used / 2**30)
        assert runtime.pages_per_shard * runtime.page_size * topo.devices >= 10**7
