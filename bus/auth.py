"""NATS identities and what each may do: nkeys, and the server's authorization block.

Every component connects as its own nkey user, and the server enforces:

- an agent publishes only its node's telemetry, heartbeat and event subjects, and
  reaches only its own JetStream consumer of its own command subject;
- the jobs a node runs share one *job* identity per node (`job-<node>`, passed to them
  as `ALNAIR_NKEY`; never the node's own seed): they may publish job progress, create
  consumers that push job commands to their own inbox (an elastic job's supervisor),
  and start and answer elastic workers (the worker subjects), and nothing of the
  node's: no telemetry, heartbeat, event or command subject. It is not confined to one
  job's subjects (docs/security.md says what that leaves open);
- a tenant publishes only `alnair.api.<tenant>.>` (the brain takes the tenant from
  that subject, so a tenant cannot act as another);
- the operator reads everything and changes nothing (read-only API verbs, reading
  the STATE log);
- the brain may do anything.

Each non-brain identity gets replies on its own inbox prefix, so it cannot read
another's replies.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

import nkeys

from bus.natsjwt import Permissions
from schemas import subjects
from schemas.base import check_name
from schemas.errors import BusError

Role = Literal["brain", "node", "job", "tenant", "operator"]
OPERATOR: Final = "operator"
READ_ONLY_VERBS: Final = ("jobs", "job", "nodes", "queues", "status", "history", "why")
# The account key a brain signs job users with (its auth callout), beside the seeds.
CALLOUT_SEED_FILE: Final = "callout-issuer.nk"
WORKER_SUBJECTS: Final = (f"{subjects.PREFIX}.job.*.exec", f"{subjects.PREFIX}.job.*.workers")


@dataclass(frozen=True, slots=True)
class Identity:
    role: Role
    name: str
    public_key: str
    seed_path: Path
    # Read from a seed already there (`keep`), not made now.
    kept: bool = False

    @property
    def inbox_prefix(self) -> str | None:
        return None if self.role == "brain" else f"_INBOX_{self.role}_{self.name}"


def write_private(path: Path, data: str | bytes) -> None:
    """Write `path` readable and writable by its owner only (seeds, passwords, tokens):
    created so, never readable by others even for a moment."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data.encode() if isinstance(data, str) else data)
    path.chmod(0o600)  # an existing file keeps its mode through os.open


def seed_file(directory: Path, role: Role, name: str) -> Path:
    """Where `alnair keys` (and `alnair up --secure`) write an identity's seed."""
    return directory / f"{role}-{name}.nk"


def create_identity(role: Role, name: str, directory: Path, *, keep: bool = False) -> Identity:
    """A new user nkey, the seed written readable by its owner only; with `keep`, the
    one whose seed is already there, if any."""
    check_name(role, name)
    path = seed_file(directory, role, name)
    if keep:
        public = _existing_public_key(path, nkeys.PREFIX_BYTE_USER)
        if public is not None:
            return Identity(role, name, public, path, kept=True)
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    public = nkeys.from_seed(seed).public_key.decode()
    directory.mkdir(parents=True, exist_ok=True)
    write_private(path, seed)
    return Identity(role, name, public, path)


def _existing_public_key(path: Path, prefix: int) -> str | None:
    """The public key of the seed in `path`, None if there is no file; a file that
    holds no seed of this kind is refused rather than replaced (it may be in use)."""
    try:
        seed = path.read_bytes().strip()
    except FileNotFoundError:
        return None
    except OSError as error:
        raise BusError(f"{path}: cannot read it: {error.strerror or error}") from None
    kind = "an account" if prefix == nkeys.PREFIX_BYTE_ACCOUNT else "a user"
    try:
        public = str(nkeys.from_seed(seed).public_key.decode())
    except Exception:  # nkeys raises several kinds for a malformed seed
        public = ""
    if not public.startswith("A" if prefix == nkeys.PREFIX_BYTE_ACCOUNT else "U"):
        raise BusError(
            f"{path}: not {kind} nkey seed; move it away, or make every identity anew with --rotate"
        )
    return public


def _node_permissions(node: str) -> tuple[list[str], list[str]]:
    consumer = f"agent-{node}"
    stream = subjects.STREAM_COMMANDS
    publish = [
        subjects.node(node, "telemetry"),
        subjects.node(node, "heartbeat"),
        subjects.node(node, "event"),
        f"{subjects.PREFIX}.dlq.>",
        # Its own durable consumer on its own command subject, and nothing else.
        f"$JS.API.CONSUMER.INFO.{stream}.{consumer}",
        f"$JS.API.CONSUMER.CREATE.{stream}.{consumer}",
        f"$JS.API.CONSUMER.CREATE.{stream}.{consumer}.>",
        f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.{consumer}",
        f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}",
        f"$JS.ACK.{stream}.{consumer}.>",
    ]
    # Fault injection (simulated GPUs only) and its jobs' logs are requests to the
    # node's own subjects.
    subscribe = [
        f"_INBOX_node_{node}.>",
        subjects.node(node, "inject"),
        subjects.node(node, "logs"),
    ]
    return publish, subscribe


def _job_permissions(node: str) -> tuple[list[str], list[str]]:
    """The jobs of one node: their supervisors, worker hosts and SDK."""
    stream = subjects.STREAM_COMMANDS
    publish = [
        # Progress, and job commands pushed to the job's own inbox (a consumer of any
        # name, but only over job command subjects; no pulling).
        subjects.ALL_JOB_PROGRESS,
        f"$JS.API.CONSUMER.CREATE.{stream}.*.{subjects.ALL_JOB_COMMANDS}",
        # What a job reports itself (a resize done, a bad input); the brain takes only
        # those kinds there, each about the subject's job (brain/tenants.py).
        subjects.ALL_JOB_EVENTS,
        # Elastic jobs across nodes: worker starts (each signed with the attempt's
        # secret, which only its nodes were given) and the workers' relayed reports.
        *WORKER_SUBJECTS,
        f"{subjects.PREFIX}.dlq.>",
    ]
    return publish, [f"_INBOX_job_{node}.>", *WORKER_SUBJECTS]


def _operator_permissions() -> tuple[list[str], list[str]]:
    state = subjects.STREAM_STATE
    publish = [subjects.api(OPERATOR, verb) for verb in READ_ONLY_VERBS] + [
        # Any node's job logs (`alnair logs`); tenants read theirs through the brain's
        # HTTP API, which checks the job is theirs.
        f"{subjects.PREFIX}.node.*.logs",
        "$JS.API.INFO",
        f"$JS.API.STREAM.INFO.{state}",
        f"$JS.API.CONSUMER.CREATE.{state}",
        f"$JS.API.CONSUMER.CREATE.{state}.>",
        f"$JS.API.CONSUMER.MSG.NEXT.{state}.>",
        f"$JS.API.CONSUMER.DELETE.{state}.>",
    ]
    return publish, [">"]


def permissions(identity: Identity) -> tuple[list[str], list[str]]:
    """(publish allow-list, subscribe allow-list)."""
    if identity.role == "brain":
        return [">"], [">"]
    if identity.role == "node":
        return _node_permissions(identity.name)
    if identity.role == "job":
        return _job_permissions(identity.name)
    if identity.role == "tenant":
        return [f"{subjects.PREFIX}.api.{identity.name}.>"], [f"_INBOX_tenant_{identity.name}.>"]
    return _operator_permissions()


def job_inbox_prefix(job_id: str, attempt: int) -> str:
    return f"_INBOX_job_{job_id}_{attempt}"


def job_permissions(job_id: str, attempt: int) -> Permissions:
    """What one attempt of one job may do (its supervisor, worker hosts, SDK), as the
    brain's auth callout grants it (brain/credentials.py): its own job's subjects only."""
    stream = subjects.STREAM_COMMANDS
    own = [subjects.job(job_id, channel) for channel in ("exec", "workers")]
    publish = (
        subjects.job(job_id, "progress"),
        subjects.job(job_id, "event"),
        *own,
        # Job commands pushed to its own inbox (a consumer of any name, over its own
        # command subject only; no pulling).
        f"$JS.API.CONSUMER.CREATE.{stream}.*.{subjects.job(job_id, 'cmd')}",
        f"{subjects.PREFIX}.dlq.>",
    )
    subscribe = (f"{job_inbox_prefix(job_id, attempt)}.>", *own)
    return Permissions(publish, subscribe, allow_responses=True)


def create_callout_key(directory: Path, *, keep: bool = False) -> tuple[str, Path]:
    """The account nkey the brain signs job users with (auth callout): (public, seed);
    with `keep`, the one already there, if any."""
    path = directory / CALLOUT_SEED_FILE
    if keep:
        public = _existing_public_key(path, nkeys.PREFIX_BYTE_ACCOUNT)
        if public is not None:
            return public, path
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_ACCOUNT)
    public = nkeys.from_seed(seed).public_key.decode()
    directory.mkdir(parents=True, exist_ok=True)
    write_private(path, seed)
    return public, path


def authorization_block(identities: list[Identity], callout_issuer: str | None = None) -> str:
    """The nats-server configuration that admits exactly these identities, and, with a
    callout issuer, whoever the brain's auth callout admits (jobs, with a token)."""
    users = []
    for identity in identities:
        publish, subscribe = permissions(identity)
        rules = f"publish: {{allow: {json.dumps(publish)}}}, "
        rules += f"subscribe: {{allow: {json.dumps(subscribe)}}}"
        if identity.role == "job":
            # A worker host answers the supervisor's requests on another node's inbox:
            # one reply to each request it received, nothing else there.
            rules += ", allow_responses: true"
        users.append(f"    {{nkey: {identity.public_key}, permissions: {{{rules}}}}}")
    callout = ""
    if callout_issuer is not None:
        # Every identity above bypasses the callout; any other connection is the
        # brain's to admit or refuse (a job presenting its attempt's token).
        known = json.dumps([identity.public_key for identity in identities])
        callout = (
            f"  auth_callout {{\n    issuer: {callout_issuer}\n    auth_users: {known}\n  }}\n"
        )
    return "authorization {\n  users = [\n" + ",\n".join(users) + "\n  ]\n" + callout + "}\n"


def write_cluster_keys(
    directory: Path,
    *,
    nodes: list[str],
    tenants: list[str],
    brains: int = 1,
    keep: bool = False,
) -> tuple[list[Identity], Path]:
    """Identities for a whole cluster and the server config file admitting exactly
    them. With `keep`, an identity (and the callout key) whose seed is already in
    `directory` is kept, so that adding a node leaves every other host's seed valid."""
    if OPERATOR in tenants:
        raise BusError(f"{OPERATOR!r} is the operator's identity, not a tenant's name")

    def made(role: Role, name: str) -> Identity:
        return create_identity(role, name, directory, keep=keep)

    identities = [made("brain", f"brain-{i + 1}") for i in range(brains)]
    identities += [made("node", node) for node in nodes]
    identities += [made("job", node) for node in nodes]
    identities += [made("tenant", tenant) for tenant in tenants]
    identities.append(made("operator", OPERATOR))
    issuer, _ = create_callout_key(directory, keep=keep)
    config = directory / "nats-auth.conf"
    config.write_text(
        "# Generated by `alnair keys`: who may connect to NATS and what each may do.\n"
        + authorization_block(identities, issuer)
    )
    return identities, config


def unlisted_seeds(directory: Path, identities: list[Identity]) -> list[Path]:
    """Seeds in `directory` of identities the config no longer admits."""
    listed = {identity.seed_path.name for identity in identities} | {CALLOUT_SEED_FILE}
    return sorted(p for p in directory.glob("*.nk") if p.name not in listed)


def inbox_prefix_for_seed(path: str | Path) -> str | None:
    """The reply-inbox prefix an identity's permissions allow, from its seed file's
    name (`<role>-<name>.nk`, as written here); None for a brain or an unknown name."""
    stem = Path(path).name.removesuffix(".nk")
    role, _, name = stem.partition("-")
    if role in ("node", "job", "tenant", "operator") and name:
        return f"_INBOX_{role}_{name}"
    return None
