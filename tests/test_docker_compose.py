"""docker/: no Docker engine here, so parse the compose file and run each service's command as a
local process (service host names mapped to 127.0.0.1, container ports to free local ports), and
check that the swarm it forms trains."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

from peer.daemon.status_server import fetch_status

from .processes import PeerdProcess

DOCKER = Path(__file__).resolve().parent.parent / "docker"


def load_compose() -> dict:
    return yaml.safe_load((DOCKER / "docker-compose.yml").read_text())


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_compose_file_describes_a_scalable_swarm():
    compose = load_compose()
    services = compose["services"]
    assert set(services) == {"bootstrap", "peer"}
    for service in services.values():
        assert service["healthcheck"]["test"][1:3] == ["peerd", "status"]
        assert all(key.startswith("PEERD_") for key in service["environment"])
        assert "ports" not in service and "container_name" not in service  # either would break --scale
    assert services["peer"]["depends_on"]["bootstrap"]["condition"] == "service_healthy"
    assert "bootstrap:31337" in services["peer"]["command"]


def test_dockerfile_copies_what_exists_and_defaults_to_cpu_torch():
    dockerfile = (DOCKER / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.\d+-slim", dockerfile, re.M)
    assert "ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu" in dockerfile
    root = DOCKER.parent
    for line in dockerfile.splitlines():
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (root / source).exists(), source
    assert 'ENTRYPOINT ["peerd"]' in dockerfile


def service_command(service: dict, replacements: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    command = [replacements.get(arg, arg) for arg in service["command"]]
    env = {key: str(value) for key, value in service["environment"].items()}
    return command, env


def test_compose_services_run_as_local_processes_and_train(tmp_path):
    compose = load_compose()
    services = compose["services"]
    processes: list[PeerdProcess] = []
    status_ports = []
    try:
        bootstrap_cmd, bootstrap_env = service_command(services["bootstrap"], {"0.0.0.0:31337": "127.0.0.1:0"})
        port = free_port()
        env = {**bootstrap_env, "PEERD_IDENTITY": str(tmp_path / "bootstrap.key"), "PEERD_STATUS_PORT": str(port)}
        env["PEERD_STATUS_HOST"] = "127.0.0.1"
        bootstrap = PeerdProcess(bootstrap_cmd, tmp_path / "bootstrap.log", env)
        processes.append(bootstrap)
        status_ports.append(port)
        address = bootstrap.read_line(timeout=60).removeprefix("peerd listening on ")
        for replica in range(2):  # docker compose up --scale peer=2
            command, peer_env = service_command(
                services["peer"], {"0.0.0.0:31337": "127.0.0.1:0", "bootstrap:31337": address}
            )
            port = free_port()
            env = {**peer_env, "PEERD_IDENTITY": str(tmp_path / f"peer{replica}.key"), "PEERD_STATUS_PORT": str(port)}
            env["PEERD_STATUS_HOST"] = "127.0.0.1"
            processes.append(PeerdProcess(command, tmp_path / f"peer{replica}.log", env))
            status_ports.append(port)
        for process in processes[1:]:
            process.read_line(timeout=60)
        deadline = time.monotonic() + 90
        epochs = [0] * len(processes)
        while time.monotonic() < deadline and min(epochs) < 3:
            time.sleep(0.5)
            for i, port in enumerate(status_ports):
                try:
                    epochs[i] = json.loads(fetch_status(port))["epoch"] or 0
                except OSError:
                    pass
        assert min(epochs) >= 3, (epochs, [p.log()[-2000:] for p in processes])
        # the healthcheck command, as compose would run it
        health = subprocess.run(
            [sys.executable, "-m", "peer.daemon.cli", "status", "--status-port", str(status_ports[1])],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert health.returncode == 0 and "epoch" in health.stdout
        status = json.loads(fetch_status(status_ports[0]))
        assert status["run_id"] == "compose-swarm" and status["task"] == "digits"
        assert status["peers_known"] >= 3
    finally:
        for process in processes:
            process.stop()
