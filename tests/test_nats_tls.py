"""NATS over TLS: certificates from `bus.tls`, a server that verifies its clients, a
client that connects with the CA and its certificate, and the ones that are refused."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from pathlib import Path
from typing import Any

import nats
import pytest

from bus.client import TLS_HINT, Bus, ConnectOptions
from bus.server import EmbeddedNats
from bus.tls import TlsFiles, write_tls_files
from schemas import subjects
from schemas.dlq import DeadLetter
from schemas.errors import BusError


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return write_tls_files(tmp_path_factory.mktemp("tls"), hosts=("nats.example",))


def tls_options(server: EmbeddedNats, files: TlsFiles, **overrides: object) -> ConnectOptions:
    fields: dict[str, object] = {
        "servers": (server.url,),
        "name": "tls-client",
        "tls_ca": str(files.ca),
        "tls_cert": str(files.client_cert),
        "tls_key": str(files.client_key),
    }
    fields.update(overrides)
    return ConnectOptions(**fields)  # type: ignore[arg-type]


def plaintext_exchange(host: str, port: int) -> tuple[bytes, bytes]:
    """Speak plain NATS protocol: (the server's greeting, what it answers to
    CONNECT + PING before closing)."""
    with socket.create_connection((host, port), timeout=5) as sock:
        greeting = sock.recv(4096)
        sock.sendall(b'CONNECT {"verbose":false,"pedantic":false}\r\nPING\r\n')
        answer = b""
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while chunk := sock.recv(4096):
                answer += chunk
        return greeting, answer


async def test_tls_client_works_and_others_are_refused(
    tls_server: EmbeddedNats, tls_files: TlsFiles
) -> None:
    assert tls_server.url.startswith("tls://")
    bus = await Bus.connect(tls_options(tls_server, tls_files))
    try:
        await bus.ensure_streams()  # JetStream over TLS
        letter = DeadLetter(
            subject="s", reason="r", received_at=1.0, by="t", payload_bytes=0, payload_preview=""
        )
        subject = subjects.node("n1", "event")
        assert await bus.publish_durable(subject, letter, msg_id="tls-1") == 1
        assert await bus.last_seq(subjects.STREAM_EVENTS) == 1
    finally:
        await bus.close()

    # A plaintext client is told TLS is required, and its CONNECT gets no PONG.
    greeting, answer = await asyncio.to_thread(plaintext_exchange, tls_server.host, tls_server.port)
    assert greeting.startswith(b"INFO ") and b'"tls_required":true' in greeting
    assert b"PONG" not in answer

    # A client that does not trust the CA, and one without a certificate, fail.
    assert await _connects(tls_options(tls_server, tls_files))
    for refused in (
        tls_options(tls_server, tls_files, tls_ca=None, tls_cert=None, tls_key=None),
        tls_options(tls_server, tls_files, tls_cert=None, tls_key=None),
    ):
        assert not await _connects(refused)


async def _connects(options: ConnectOptions) -> bool:
    try:
        nc = await nats.connect(
            list(options.servers),
            tls=_context(options),
            allow_reconnect=False,
            connect_timeout=5,
        )
    except (OSError, TimeoutError, nats.errors.Error):
        return False
    try:
        # A missing client certificate may pass the handshake (TLS 1.3 checks it
        # after) and be refused at the first exchange.
        await nc.flush(timeout=5)
    except (OSError, TimeoutError, nats.errors.Error):
        return False
    finally:
        await nc.close()
    return True


def _context(options: ConnectOptions) -> object:
    import ssl

    from bus.client import tls_context

    return tls_context(options) if options.tls_ca else ssl.create_default_context()


def test_bad_tls_settings_are_named(tmp_path: Path, tls_files: TlsFiles) -> None:
    from bus.client import tls_context

    with pytest.raises(BusError, match="both a client certificate and its key"):
        tls_context(ConnectOptions(servers=(), name="x", tls_ca="ca", tls_cert="c"))
    missing = str(tmp_path / "nope.pem")
    with pytest.raises(BusError, match=r"nope\.pem"):
        tls_context(ConnectOptions(servers=(), name="x", tls_ca=missing))
    with pytest.raises(BusError, match=r"invalid TLS host 'nats://h:4222'"):
        write_tls_files(tmp_path / "t", hosts=("nats://h:4222",))


async def test_certificates_made_again_keep_the_ca_and_every_clients_files(
    tmp_path: Path,
) -> None:
    """A NATS host added to --tls-hosts gets a new server certificate from the same CA:
    clients keep the files they have."""
    directory = tmp_path / "tls"
    first = write_tls_files(directory, hosts=("nats-1.example",), keep=True)
    kept_paths = (first.ca, first.client_cert, first.client_key, directory / "jobs-ca.pem")
    before = {path: path.read_bytes() for path in (*kept_paths, first.server_cert)}
    again = write_tls_files(directory, hosts=("nats-1.example", "nats-2.example"), keep=True)
    assert all(path.read_bytes() == before[path] for path in kept_paths)
    assert again.server_cert.read_bytes() != before[first.server_cert]

    server = EmbeddedNats(data_dir=tmp_path / "nats", tls=again)
    server.start()
    try:
        bus = await Bus.connect(tls_options(server, first))  # the client's old files
        await bus.close()
    finally:
        server.stop()
    rotated = write_tls_files(directory, hosts=("nats-1.example",))
    assert rotated.ca.read_bytes() != before[first.ca]


async def test_a_failed_handshake_is_named_not_waited_on_for_ever(
    tls_server: EmbeddedNats, tls_files: TlsFiles, tmp_path: Path
) -> None:
    """nats-py waits for ever after a first connection's failed TLS handshake
    (nats-io/nats.py#718): a CLI or a job's SDK with the wrong CA hung. Each is told."""
    other = write_tls_files(tmp_path / "other")
    # Without a certificate, the client reads the server's alert, or (as often under
    # load) only the connection it closed: named alike (`_DroppedBeforeTls`).
    closed = r"(\[SSL: |the server closed the connection before TLS was up)"
    for wrong, said in (
        ({"tls_ca": None, "tls_cert": None, "tls_key": None}, r"\[SSL: "),  # trusts no CA of ours
        ({"tls_ca": str(other.ca)}, r"\[SSL: "),  # trusts another
        ({"tls_cert": None, "tls_key": None}, closed),  # no certificate for a verifying server
    ):
        options = tls_options(tls_server, tls_files, max_reconnect_attempts=1, **wrong)
        with pytest.raises(BusError, match=said + r".*\(TLS: is the CA given"):
            # The deadline only keeps a regression from hanging the suite.
            await asyncio.wait_for(Bus.connect(options), timeout=60)


async def test_a_tls_connection_the_server_only_closes_is_named_as_a_tls_refusal(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A first connection whose every attempt the server closed (a reset, a broken pipe)
    before TLS was up, no TLS error read: the TLS hint, not a bare "no servers
    available". Without TLS, a reset is only what it is."""

    async def closed_twice(**kwargs: Any) -> None:
        await kwargs["error_cb"](ConnectionResetError("Connection lost"))
        await kwargs["error_cb"](BrokenPipeError(32, "Broken pipe"))
        raise nats.errors.NoServersError()

    monkeypatch.setattr(nats, "connect", closed_twice)
    ca = str(write_tls_files(tmp_path).ca)
    tls = ConnectOptions(
        servers=("tls://127.0.0.1:1",), name="c", tls_ca=ca, max_reconnect_attempts=1
    )
    with pytest.raises(BusError) as refused:
        await Bus.connect(tls)
    assert str(refused.value) == (
        "cannot connect to NATS at tls://127.0.0.1:1: the server closed the connection before "
        "TLS was up (BrokenPipeError: [Errno 32] Broken pipe)" + TLS_HINT
    )
    plain = ConnectOptions(servers=("nats://127.0.0.1:1",), name="c", max_reconnect_attempts=1)
    with pytest.raises(BusError) as refused:
        await Bus.connect(plain)
    assert str(refused.value) == (
        "cannot connect to NATS at nats://127.0.0.1:1: nats: no servers available for connection"
    )


async def test_a_component_connects_once_its_server_shakes_hands(
    tls_files: TlsFiles, tmp_path: Path
) -> None:
    """A component (trying for ever) whose server first presents a certificate it does
    not trust connects once the server comes back with one it does."""
    other = write_tls_files(tmp_path / "other", hosts=("nats.example",))
    server = EmbeddedNats(data_dir=tmp_path / "nats", tls=other)
    server.start()
    try:
        failed = asyncio.Event()
        connecting = asyncio.ensure_future(Bus.connect(tls_options(server, tls_files)))
        handler = _SeeingHandshakes(failed)
        logging.getLogger("bus.client").addHandler(handler)
        try:
            await asyncio.wait_for(failed.wait(), timeout=60)
        finally:
            logging.getLogger("bus.client").removeHandler(handler)
        server.stop()
        server.tls = tls_files
        server.start()
        bus = await asyncio.wait_for(connecting, timeout=60)
        await bus.close()
    finally:
        server.stop()


class _SeeingHandshakes(logging.Handler):
    def __init__(self, failed: asyncio.Event) -> None:
        super().__init__()
        self.failed = failed

    def emit(self, record: logging.LogRecord) -> None:
        if "TLS handshake failed" in record.getMessage():
            self.failed.set()
