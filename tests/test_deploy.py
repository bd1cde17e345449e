"""The fleet's deployment examples (docs/deploy: a compose file for three servers and S3, a
Kubernetes StatefulSet behind a headless Service): parsed, and every lmserver command line in
them parsed by the real CLI and its tier built from its spec, so they cannot drift from the
code. (Docker and Kubernetes cannot run here.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from lmserver.cli import health, serve
from lmserver.config import ServerConfig
from lmserver.sizes import parse_size
from lmserver.storage.tiers import registry
from lmserver.storage.tiers.spec import TierSpec

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "docs" / "deploy"


def server_config(argv: list[str]) -> ServerConfig:
    """What ``lmcache-server ARGV`` would run with (the CLI's own parsing and checks)."""
    assert argv[0] == "serve", argv
    params = dict(serve.make_context("serve", list(argv[1:])).params)
    assert params.pop("positional") == ()
    if params["memory_limit"] is None:
        del params["memory_limit"]
    config = ServerConfig(**params)
    for text in config.tiers:  # each spec builds its tier (nothing is opened)
        registry.build(TierSpec.parse(text))
    return config


def test_compose_runs_three_servers_on_one_shared_bucket() -> None:
    pytest.importorskip("nixl_cu12", reason="the compose file's tier is NIXL OBJ")
    doc: dict[str, Any] = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = doc["services"]
    servers = {name: svc for name, svc in services.items() if name.startswith("lms-")}
    assert sorted(servers) == ["lms-1", "lms-2", "lms-3"]
    configs = [server_config(svc["command"]) for svc in servers.values()]
    (tier,) = {c.tiers for c in configs}  # one shared tier, the same on every server
    assert (
        "shared=true" in tier[0] and "mode=write-behind" in tier[0] and "endpoint=http://s3:9000" in tier[0]
    )
    assert all(c.host == "0.0.0.0" and c.port == 65432 and str(c.disk) == "/data" for c in configs)
    assert len({svc["volumes"][0] for svc in servers.values()}) == 3  # a disk of its own each
    assert len({port for svc in servers.values() for port in svc["ports"]}) == 6
    for svc in servers.values():
        assert svc["build"]["args"]["EXTRAS"] == "nixl"
        assert svc["depends_on"]["bucket"]["condition"] == "service_completed_successfully"
        assert svc["environment"]["AWS_ACCESS_KEY_ID"] == services["s3"]["environment"]["MINIO_ROOT_USER"]
    assert "kv-cache" in " ".join(services["bucket"]["entrypoint"]) and "kv-cache" in tier[0]
    assert set(doc["volumes"]) == {"s3-data", "lms-1-data", "lms-2-data", "lms-3-data"}


def test_kubernetes_statefulset_behind_a_headless_service() -> None:
    pytest.importorskip("huggingface_hub", reason="the Kubernetes example's tier is an HF bucket")
    docs = {d["kind"]: d for d in yaml.safe_load_all((DEPLOY / "kubernetes.yaml").read_text())}
    assert set(docs) == {"Service", "PodDisruptionBudget", "StatefulSet"}
    service, sts = docs["Service"], docs["StatefulSet"]
    assert service["spec"]["clusterIP"] == "None"
    assert sts["spec"]["serviceName"] == service["metadata"]["name"]
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert sts["spec"]["selector"]["matchLabels"] == labels == service["spec"]["selector"]
    assert docs["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"] == labels
    assert sts["spec"]["replicas"] == 3

    pod = sts["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    config = server_config(container["args"])
    assert config.tiers[0].startswith("hf://buckets/") and "mode=write-behind" in config.tiers[0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"lm": config.port, "metrics": config.metrics_port}
    assert {p["targetPort"] for p in service["spec"]["ports"]} == set(ports)
    assert pod["securityContext"]["runAsUser"] == 10001  # the Dockerfile's user
    assert "USER 10001" in (ROOT / "Dockerfile").read_text()

    (claim,) = sts["spec"]["volumeClaimTemplates"]
    (mount,) = container["volumeMounts"]
    assert mount == {"name": claim["metadata"]["name"], "mountPath": str(config.disk)}
    assert config.disk_limit < parse_size(
        claim["spec"]["resources"]["requests"]["storage"].replace("Gi", "GiB")
    )
    memory = parse_size(container["resources"]["limits"]["memory"].replace("Gi", "GiB"))
    assert config.memory_limit + (1 << 30) <= memory  # room beyond --memory-limit (docs/fleet.md)
    assert container["env"][0]["name"] == "HF_TOKEN"
    for probe in ("readinessProbe", "livenessProbe"):
        argv = container[probe]["exec"]["command"]
        assert argv[:2] == ["lmcache-server", "health"]
        assert health.make_context("health", argv[2:]).params["port"] == config.port
