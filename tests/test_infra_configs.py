"""The nats-server configurations in infra/nats are valid as shipped (`nats-server -t`),
the multi-host one with the files `alnair keys --tls` writes next to it."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from bus.auth import write_cluster_keys
from bus.server import nats_server_binary, route_url, write_route_authorization
from bus.tls import write_tls_config, write_tls_files

INFRA = Path(__file__).resolve().parent.parent / "infra"


def check_config(path: Path, env: dict[str, str] | None = None) -> None:
    result = subprocess.run(
        [str(nats_server_binary()), "-c", str(path), "-t"],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, f"{path}: {result.stdout}{result.stderr}"


@pytest.mark.parametrize(
    "name", ["single.conf", "local/nats-1.conf", "local/nats-2.conf", "local/nats-3.conf"]
)
def test_standalone_configs_are_valid(name: str) -> None:
    check_config(INFRA / "nats" / name)


def test_cluster_template_is_valid_with_keys_and_tls(tmp_path: Path) -> None:
    etc = tmp_path / "etc-alnair"
    etc.mkdir()
    shutil.copy(INFRA / "nats" / "cluster.conf", etc / "nats.conf")
    keys = etc / "keys"
    write_cluster_keys(keys, nodes=["gpu-01"], tenants=["team-a"], brains=2)
    tls = write_tls_files(keys / "tls", hosts=("nats-1.example", "10.0.0.5"))
    write_tls_config(tls, keys / "nats-tls.conf")
    _, secret = write_route_authorization(keys)
    routes = (route_url(f"nats-{i}.example", 6222, secret) for i in (1, 2))
    env = {
        "NATS_SERVER_NAME": "nats-1",
        "NATS_STORE_DIR": str(tmp_path / "store"),
        "NATS_ROUTES": f"[{', '.join(routes)}]",
    }
    check_config(etc / "nats.conf", env)


def test_systemd_units_name_their_environment_files() -> None:
    units = {p.name: p.read_text() for p in (INFRA / "systemd").glob("*.service")}
    assert set(units) >= {"alnair-nats.service", "alnair-brain.service", "alnair-agent.service"}
    examples = {p.name for p in (INFRA / "systemd").glob("*.env.example")}
    for name, text in units.items():
        files = [
            line.split("=", 1)[1].lstrip("-").rsplit("/", 1)[-1]
            for line in text.splitlines()
            if line.startswith("EnvironmentFile=")
        ]
        assert files, f"{name} has no EnvironmentFile"
        for env_file in files:
            assert f"{env_file}.example" in examples, f"{name}: no example for {env_file}"
