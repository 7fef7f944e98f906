"""docker/: no Docker engine here, so parse the compose file and run each service's command as a
local process (service host names mapped to 127.0.0.1, container ports to free local ports), and
check that the swarm it forms trains."""

from __future__ import annotations

import fnmatch
import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from peerd.data_shards import overlap
from peerd.status_server import fetch_status
from tests.support.processes import PeerdProcess

DOCKER = Path(__file__).resolve().parents[2] / "docker"


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
        assert "container_name" not in service  # it would break --scale
        # No fixed data shard: every replica chooses the least-covered one (--data-shard auto).
        assert "--data-shard" not in service["command"] and service["environment"]["PEERD_DATA_SHARD"] == "auto"
        # TORCH_INDEX passes through `docker compose build`, with the CPU wheels as the default.
        args = service["build"]["args"]
        assert args["TORCH_INDEX"] == "${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
        assert service["build"]["context"] == ".." and service["build"]["dockerfile"] == "docker/Dockerfile"
    assert services["peer"]["depends_on"]["bootstrap"]["condition"] == "service_healthy"
    assert "bootstrap:31337" in services["peer"]["command"]
    # The status port is published: the bootstrap's on a fixed local port, each replica's on a free
    # one (a fixed host port would let only one replica start under --scale).
    assert services["bootstrap"]["ports"] == ["127.0.0.1:8080:8080"]
    assert services["peer"]["ports"] == ["127.0.0.1::8080"]


def test_compose_interpolation_defaults_are_what_the_dockerfile_defaults_to():
    dockerfile = (DOCKER / "Dockerfile").read_text()
    for name, value in load_compose()["services"]["peer"]["build"]["args"].items():
        default = re.fullmatch(r"\$\{(\w+):-(.+)\}", value)
        assert default is not None and default[1] == name, value
        assert f"ARG {name}={default[2]}" in dockerfile


def dockerfile_instructions() -> list[tuple[str, str]]:
    lines = (DOCKER / "Dockerfile").read_text().splitlines()
    return [tuple(line.split(" ", 1)) for line in lines if line and not line.startswith("#") and line[0].isupper()]


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
    assert "COPY examples ./examples" in dockerfile


def test_dependencies_are_installed_before_the_source_is_copied():
    """A code change must rebuild only the layers after the source copy, never the dependencies."""
    steps = dockerfile_instructions()
    copies = [i for i, (op, args) in enumerate(steps) if op == "COPY"]
    first_source = min(i for i in copies if steps[i][1].split()[0] in ("peer", "dht", "averaging", "moe"))
    deps = next(i for i, (op, args) in enumerate(steps) if op == "RUN" and "requirements.txt" in args)
    assert all(
        set(steps[i][1].split()[:-1]) <= {"pyproject.toml", "docker/requirements.py"} for i in copies if i < deps
    )
    assert deps < first_source
    assert steps[-1][0] != "RUN" or "--no-deps" in steps[-1][1]
    assert any(op == "RUN" and "pip install --no-deps ." in args for op, args in steps[first_source:])
    # The requirements script, run as the image runs it, lists exactly pyproject's dependencies.
    printed = subprocess.run(
        [sys.executable, str(DOCKER / "requirements.py"), str(DOCKER.parent / "pyproject.toml")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    with open(DOCKER.parent / "pyproject.toml", "rb") as file:
        assert printed == tomllib.load(file)["project"]["dependencies"]
    assert any(line.startswith("torch") for line in printed)


def test_dockerignore_keeps_history_environments_and_keys_out_of_the_context():
    patterns = [line.strip() for line in (DOCKER.parent / ".dockerignore").read_text().splitlines() if line.strip()]
    patterns = [p for p in patterns if not p.startswith("#")]
    for needed in (".git", ".venv", "venv", "**/__pycache__", ".pytest_cache", "**/*.key"):
        assert needed in patterns, needed
    # nothing the Dockerfile copies is excluded
    copied = {source for op, args in dockerfile_instructions() if op == "COPY" for source in args.split()[:-1]}
    for source in copied:
        assert not any(fnmatch.fnmatch(source, p) or source == p for p in patterns), source


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
            [sys.executable, "-m", "peerd.cli", "status", "--status-port", str(status_ports[1])],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert health.returncode == 0 and "epoch" in health.stdout
        status = json.loads(fetch_status(status_ports[0]))
        assert status["run_id"] == "compose-swarm" and status["task"] == "digits"
        assert status["peers_known"] >= 3
        # The replicas, started together after the bootstrap, train parts of the data that do not
        # overlap, whether the first counted the second (thirds) or chose before it saw it (halves).
        shards = [json.loads(fetch_status(port))["data_shard"] for port in status_ports[1:]]
        (first, second) = (tuple(int(n) for n in shard.split("/")) for shard in shards)
        assert overlap(first, second) == 0.0, shards
    finally:
        for process in processes:
            process.stop()
