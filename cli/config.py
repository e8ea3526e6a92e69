"""Where the CLI finds a cluster: `--nats`, then `ALNAIR_NATS`, then the file `alnair up`
writes in the Alnair home (`ALNAIR_HOME`, default ~/.alnair)."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final, NamedTuple

from bus.auth import Role, seed_file
from schemas.api import OPERATOR_TENANT
from schemas.errors import BusError, ClusterNotFound

CLUSTER_FILE: Final = "cluster.json"


class TlsSettings(NamedTuple):
    """A client's TLS files: the CA that signed the servers, its own certificate, key."""

    ca: str
    cert: str | None = None
    key: str | None = None


def alnair_home() -> Path:
    return Path(os.environ.get("ALNAIR_HOME") or Path.home() / ".alnair").expanduser()


@dataclass(frozen=True, slots=True)
class ClusterInfo:
    nats: tuple[str, ...]
    pid: int
    started_at: float
    home: str
    # The identity other commands on this machine use by default (`up --secure`).
    client_nkey: str | None = None
    # TLS files other commands on this machine use by default (`up --tls`).
    tls: TlsSettings | None = None

    def write(self, home: Path) -> Path:
        home.mkdir(parents=True, exist_ok=True)
        path = home / CLUSTER_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(
            json.dumps(
                {
                    "nats": list(self.nats),
                    "pid": self.pid,
                    "started_at": self.started_at,
                    "home": self.home,
                    "client_nkey": self.client_nkey,
                    "tls": list(self.tls) if self.tls else None,
                },
                indent=2,
            )
        )
        tmp.replace(path)
        return path


def read_cluster(home: Path) -> ClusterInfo | None:
    path = home / CLUSTER_FILE
    try:
        data = json.loads(path.read_text())
        info = ClusterInfo(
            nats=tuple(data["nats"]),
            pid=int(data["pid"]),
            started_at=float(data["started_at"]),
            home=str(data.get("home", home)),
            client_nkey=data.get("client_nkey"),
            tls=TlsSettings(*data["tls"]) if data.get("tls") else None,
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return info if _alive(info.pid) else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def resolve_nats(explicit: str | None) -> tuple[str, ...]:
    if explicit:
        return tuple(u.strip() for u in explicit.split(",") if u.strip())
    env = os.environ.get("ALNAIR_NATS")
    if env:
        return tuple(u.strip() for u in env.split(",") if u.strip())
    home = alnair_home()
    info = read_cluster(home)
    if info is not None:
        return info.nats
    raise ClusterNotFound(
        f"no cluster found: nothing running per {home / CLUSTER_FILE}. Start one with "
        "`make up` (or `alnair up`), or point at one with --nats URL or ALNAIR_NATS"
    )


def remove_cluster_file(home: Path, pid: int) -> None:
    info = read_cluster(home)
    if info is not None and info.pid == pid:
        (home / CLUSTER_FILE).unlink(missing_ok=True)


def now() -> float:
    return time.time()


def resolve_nkey(explicit: str | None, *, tenant: str | None = None) -> str | None:
    """`--nkey`, then `ALNAIR_NKEY`, then the local secure cluster's identity: the seed
    `alnair up --secure` wrote for `tenant` (`operator-operator.nk` for the operator,
    `tenant-<name>.nk`) when there is one, else its client's."""
    if explicit:
        return explicit
    if os.environ.get("ALNAIR_NKEY"):
        return os.environ["ALNAIR_NKEY"]
    if os.environ.get("ALNAIR_NATS"):
        return None
    info = read_cluster(alnair_home())
    if info is None or info.client_nkey is None:
        return None
    if tenant is not None:
        role: Role = "operator" if tenant == OPERATOR_TENANT else "tenant"
        own = seed_file(Path(info.client_nkey).parent, role, tenant)
        if own.is_file():
            return str(own)
    return info.client_nkey


def resolve_tls(
    ca: str | None = None, cert: str | None = None, key: str | None = None
) -> TlsSettings | None:
    """`--tls-ca/--tls-cert/--tls-key`, then `ALNAIR_TLS_CA/_CERT/_KEY`, then the local
    cluster's (`alnair up --tls`); None for plain connections."""
    env = os.environ
    ca = ca or env.get("ALNAIR_TLS_CA")
    cert = cert or env.get("ALNAIR_TLS_CERT")
    key = key or env.get("ALNAIR_TLS_KEY")
    if ca or cert or key:
        if not ca:
            raise BusError("TLS: a client certificate needs --tls-ca (or ALNAIR_TLS_CA) too")
        return TlsSettings(ca, cert, key)
    if env.get("ALNAIR_NATS"):
        return None
    info = read_cluster(alnair_home())
    return info.tls if info is not None else None
