"""A job's NATS user expires, and its connection renews it, against a real nats-server
with the brain's auth callout: a connection that renews stays up past the user's
lifetime while its attempt runs; one that does not is closed by the server; once the
attempt has ended, the renewing one is refused and cut off. And a confined job's own
TLS client certificate, from the job issuer, is accepted by a server that verifies
clients."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import pytest

from agents.confine import Confined, JobCertificate, JobUser
from brain.credentials import JobCredentials, load_signer
from brain.secrets import job_token
from bus.auth import CALLOUT_SEED_FILE, Identity, job_inbox_prefix
from bus.client import Bus, ConnectOptions, tls_context
from bus.server import EmbeddedNats
from bus.tls import (
    JobIssuer,
    TlsFiles,
    common_name,
    issue_job_certificate,
    write_tls_files,
)
from cli.config import TlsSettings
from cli.confine import add_brain_args, job_tls_issuer
from cli.up import ClusterKeys, _job_tls_args
from schemas import subjects
from schemas.errors import AlnairError, BusError
from tests.conftest import eventually
from tests.test_auth import keys, open_as, secure_server
from workloads.sdk import job_connect_options

__all__ = ["keys", "secure_server"]  # fixtures, used by name

TTL_S = 6.0  # whole seconds: the server's expiry is a Unix time in seconds


Callout = tuple[JobCredentials, set[tuple[str, int]], bytes]


@pytest.fixture
async def callout(
    secure_server: EmbeddedNats, keys: tuple[dict[str, Identity], Path]
) -> AsyncIterator[Callout]:
    """The brain's auth callout, answering with users that live TTL_S, for the
    attempts in the returned set."""
    async with serve_callout(secure_server, keys[0]) as served:
        yield served


@contextlib.asynccontextmanager
async def serve_callout(
    server: EmbeddedNats, ids: dict[str, Identity], tls: TlsFiles | None = None
) -> AsyncIterator[Callout]:
    brain = await open_as(server, ids["brain:brain-1"], tls)
    key = os.urandom(32)
    running: set[tuple[str, int]] = set()

    async def cluster_key() -> bytes:
        return key

    seed = ids["brain:brain-1"].seed_path.parent / CALLOUT_SEED_FILE
    credentials = JobCredentials(
        load_signer(seed), cluster_key, lambda j, a: (j, a) in running, ttl_s=TTL_S
    )
    await credentials.serve(brain)
    try:
        yield credentials, running, key
    finally:
        await brain.close()


@pytest.mark.timeout(120)
async def test_a_job_connection_renews_its_expiring_user_while_its_attempt_runs(
    secure_server: EmbeddedNats, callout
) -> None:
    credentials, running, key = callout
    running.add(("7", 1))
    token = job_token(key, "7", 1)
    assert credentials.renew_s == TTL_S / 2
    renewing = await Bus.connect(
        ConnectOptions(
            servers=(secure_server.url,),
            name="sdk:7",
            token=token,
            inbox_prefix=job_inbox_prefix("7", 1),
            renew_s=credentials.renew_s,
        )
    )
    said: list[str] = []

    async def on_error(error: Exception) -> None:
        said.append(str(error))

    # Without renewal, as nats-py does on its own: closed for good at expiry.
    plain = await nats.connect(
        secure_server.url,
        token=token,
        inbox_prefix=job_inbox_prefix("7", 1),
        error_cb=on_error,
        allow_reconnect=False,
    )
    try:
        await eventually(lambda: plain.is_closed, timeout_s=TTL_S * 5)
        assert "authentication expired" in str(plain.last_error).lower(), (plain.last_error, said)
        # The renewing one has outlived the user it was first admitted as.
        await eventually(
            lambda: renewing.renewals >= 2 and renewing.nc.is_connected, timeout_s=TTL_S * 5
        )
        assert not renewing.nc.is_closed
        await renewing.nc.publish(subjects.job("7", "progress"), b"{}")
        await renewing.nc.flush(timeout=5)
        assert credentials.admitted >= 3

        # The attempt ends: its next renewal is refused, and it is off the bus.
        running.clear()
        await eventually(lambda: not renewing.nc.is_connected, timeout_s=TTL_S * 5)
        await eventually(lambda: credentials.refused >= 1, timeout_s=TTL_S * 5)
    finally:
        await renewing.close()
        if not plain.is_closed:
            await plain.close()
    gc.collect()  # the refused transports, under this test's filters


def test_a_job_reads_its_renewal_interval_from_its_launch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ALNAIR_JOB_TOKEN", "7:1:mac")
    monkeypatch.setenv("ALNAIR_JOB_RENEW_S", "1800")
    assert job_connect_options("nats://x", "sdk:7").renew_s == 1800.0
    monkeypatch.delenv("ALNAIR_JOB_RENEW_S")
    assert job_connect_options("nats://x", "sdk:7").renew_s is None
    monkeypatch.setenv("ALNAIR_JOB_RENEW_S", "soon")
    with pytest.raises(ValueError, match="ALNAIR_JOB_RENEW_S: a positive number"):
        job_connect_options("nats://x", "sdk:7")


@pytest.mark.parametrize(
    ("given", "expected"),
    [("600", 600.0), ("0", 0.0), ("-1", None), ("5", None), ("inf", None), ("x", None)],
)
def test_the_brains_credential_lifetime_is_checked(given: str, expected: float | None) -> None:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_brain_args(parser)
    if expected is None:
        with pytest.raises(argparse.ArgumentError, match="--job-credential-ttl"):
            parser.parse_args(["--job-credential-ttl", given])
    else:
        assert parser.parse_args(["--job-credential-ttl", given]).job_credential_ttl == expected


# -- a confined job's own TLS client certificate ---------------------------------------


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return write_tls_files(tmp_path_factory.mktemp("tls"))


def _openssl(*args: str) -> str:
    done = subprocess.run(["openssl", *args], capture_output=True, text=True, check=False)
    return done.stdout + done.stderr


async def test_a_job_certificate_from_the_issuer_is_short_lived_and_accepted(
    tls_server: EmbeddedNats, tls_files: TlsFiles, tmp_path: Path
) -> None:
    issuer = JobIssuer.in_dir(tls_files.ca.parent)
    issuer.check()
    cert, key = tmp_path / "tls-cert.pem", tmp_path / "tls-key.pem"
    now = 1_900_000_000.0  # any time: validity is what is checked here
    expires = issue_job_certificate(
        issuer, cert, key, name="job-7-1", valid_s=3600, now=now, owner=None
    )
    assert expires == now + 3600
    text = _openssl(
        "x509", "-in", str(cert), "-noout", "-subject", "-enddate", "-ext", "extendedKeyUsage"
    )
    assert "CN = job-7-1" in text and "TLS Web Client Authentication" in text, text
    assert "notAfter=Mar 17 18:46:40 2030 GMT" in text, text
    assert (key.stat().st_mode & 0o777, cert.stat().st_mode & 0o777) == (0o400, 0o440)
    # The issuer signs client certificates only: not one a client would take for a server.
    assert "unsuitable certificate purpose" in _openssl(
        "verify", "-CAfile", str(tls_files.ca), "-purpose", "sslserver", str(issuer.cert)
    )

    issue_job_certificate(issuer, cert, key, name="job-7-1", valid_s=3600, now=time.time())
    bus = await Bus.connect(
        ConnectOptions(
            servers=(tls_server.url,),
            name="sdk:7",
            tls_ca=str(tls_files.ca),
            tls_cert=str(cert),
            tls_key=str(key),
        )
    )
    try:
        await bus.nc.publish(subjects.job("7", "progress"), b"{}")
        await bus.nc.flush(timeout=5)
    finally:
        await bus.close()


def test_an_agent_takes_the_job_issuer_as_two_files(tls_files: TlsFiles, tmp_path: Path) -> None:
    issuer = JobIssuer.in_dir(tls_files.ca.parent)
    assert job_tls_issuer(f"{issuer.cert},{issuer.key}") == issuer
    with pytest.raises(AlnairError, match="--job-tls-issuer: expected CERT,KEY"):
        job_tls_issuer(str(issuer.cert))
    with pytest.raises(BusError, match=r"job TLS issuer files missing: .*nope\.pem"):
        job_tls_issuer(f"{issuer.cert},{tmp_path / 'nope.pem'}")


def test_up_gives_the_job_issuer_to_agents_that_confine_under_tls(
    tls_files: TlsFiles, tmp_path: Path
) -> None:
    keys = ClusterKeys(tmp_path, [], {}, "c", "o", "cl", tenant_users=tmp_path / "t.yaml")
    tls = TlsSettings(str(tls_files.ca), str(tls_files.client_cert), str(tls_files.client_key))
    issuer = JobIssuer.in_dir(tls_files.ca.parent)
    assert _job_tls_args(keys, tls) == ["--job-tls-issuer", f"{issuer.cert},{issuer.key}"]
    assert _job_tls_args(keys, None) == []  # no TLS
    unconfined = dataclasses.replace(keys, tenant_users=None)  # not root: jobs unconfined
    assert _job_tls_args(unconfined, tls) == []


def test_an_attempts_certificate_is_renewed_past_half_its_life(
    tls_files: TlsFiles, tmp_path: Path
) -> None:
    certificate = JobCertificate(
        JobIssuer.in_dir(tls_files.ca.parent),
        tmp_path / "tls-cert.pem",
        tmp_path / "tls-key.pem",
        name="job-7-1",
        owner=(os.getuid(), os.getgid()),
        ttl_s=3600,
    )
    now = time.time()
    certificate.issue(now)
    confined = Confined(("x",), {}, _user(), tmp_path, None, certificate)
    first = certificate.cert.read_bytes()
    assert not confined.renew_certificate(now + 1799)
    assert confined.renew_certificate(now + 1800)
    assert certificate.expires_at == now + 1800 + 3600
    assert certificate.cert.read_bytes() != first
    confined.finished = True  # the attempt has ended: nothing more to renew
    assert not confined.renew_certificate(now + 10_000)


def _user() -> JobUser:
    return JobUser("a", "a", os.getuid(), os.getgid(), "/")


@pytest.fixture
def secure_tls_server(
    tmp_path: Path, keys: tuple[dict[str, Identity], Path], tls_files: TlsFiles
) -> Iterator[EmbeddedNats]:
    """Nkey identities, the auth callout, and TLS that requires client certificates."""
    server = EmbeddedNats(data_dir=tmp_path / "nats-tls", config_file=keys[1], tls=tls_files)
    server.start()
    try:
        yield server
    finally:
        server.stop()


async def test_a_job_certificate_is_admitted_only_with_its_own_attempts_token(
    secure_tls_server: EmbeddedNats, keys, tls_files: TlsFiles, tmp_path: Path
) -> None:
    """The server hands the callout the certificate it verified: a job's certificate
    with its own attempt's token is admitted; with another running attempt's token it
    is refused; the cluster's shared client certificate is left to the token."""
    issuer = JobIssuer.in_dir(tls_files.ca.parent)
    cert, key = tmp_path / "tls-cert.pem", tmp_path / "tls-key.pem"
    issue_job_certificate(issuer, cert, key, name="job-7-1", valid_s=600, now=time.time())
    async with serve_callout(secure_tls_server, keys[0], tls_files) as (credentials, running, k):
        running.update({("7", 1), ("8", 1)})

        async def connect(job: str, cert_file: Path, key_file: Path) -> nats.NATS:
            options = ConnectOptions(
                servers=(secure_tls_server.url,),
                name=f"sdk:{job}",
                tls_ca=str(tls_files.ca),
                tls_cert=str(cert_file),
                tls_key=str(key_file),
            )
            return await nats.connect(
                secure_tls_server.url,
                token=job_token(k, job, 1),
                inbox_prefix=job_inbox_prefix(job, 1),
                tls=tls_context(options),
                allow_reconnect=False,
                max_reconnect_attempts=0,
                connect_timeout=10,
            )

        own = await connect("7", cert, key)
        await own.publish(subjects.job("7", "progress"), b"{}")
        await own.flush(timeout=5)
        await own.close()
        with pytest.raises(Exception) as refused:  # noqa: PT011 - nats-py raises its own kinds
            await connect("8", cert, key)
        assert "authorization violation" in str(refused.value).lower()
        del refused
        shared = await connect("8", tls_files.client_cert, tls_files.client_key)
        await shared.close()
        assert (credentials.admitted, credentials.refused) == (2, 1)
    gc.collect()  # the refused transport, under this test's filters


def test_a_certificates_common_name_is_read_without_a_library(tls_files: TlsFiles) -> None:
    assert common_name(tls_files.client_cert.read_text()) == "alnair-client"
    issuer = JobIssuer.in_dir(tls_files.ca.parent)
    # A chain file: the first certificate's.
    assert common_name(issuer.cert.read_text() + tls_files.ca.read_text()) == "Alnair job issuer"
    assert common_name("not a certificate") is None
    assert common_name("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n") is None
