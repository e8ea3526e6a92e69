"""TLS for NATS: a private CA, a server certificate and a client certificate.

`write_tls_files` makes them with the `openssl` command (the `cryptography` package is
not a dependency of Alnair); `server_tls_block` is the nats-server `tls {}` block that
uses them. The servers verify clients (mutual TLS): a client must present a
certificate signed by the same CA, on top of its nkey identity (bus/auth.py). The
server certificate is also a client certificate, so servers use it for their cluster
routes.

What this module must not do: decide who may publish what (that is bus/auth.py).
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from schemas.errors import BusError

# P-256: small, fast keys every TLS stack accepts.
CURVE: Final = "prime256v1"
CA_DAYS: Final = 3650
CERT_DAYS: Final = 825  # the longest validity some clients accept for a leaf
DEFAULT_HOSTS: Final = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """The PEM files of one TLS setup; any may be given by the operator instead."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    @classmethod
    def in_dir(cls, directory: Path) -> TlsFiles:
        return cls(
            ca=directory / "ca.pem",
            server_cert=directory / "server.pem",
            server_key=directory / "server-key.pem",
            client_cert=directory / "client.pem",
            client_key=directory / "client-key.pem",
        )

    def check(self) -> None:
        """Raise a BusError naming every file that is missing."""
        missing = [str(p) for p in self.all() if not p.is_file()]
        if missing:
            raise BusError(
                f"TLS files missing: {', '.join(missing)} (`alnair keys --tls` writes them)"
            )

    def all(self) -> tuple[Path, ...]:
        return (self.ca, self.server_cert, self.server_key, self.client_cert, self.client_key)


def openssl_binary() -> str:
    found = shutil.which("openssl")
    if found is None:
        raise BusError(
            "TLS certificates need the `openssl` command, which is not on PATH: install "
            "it (apt-get install openssl), or make the CA and certificates with your own "
            "tools and pass their files (--tls-ca, --tls-cert, --tls-key)"
        )
    return found


def check_hosts(hosts: tuple[str, ...]) -> None:
    """Raise a BusError naming the first entry that is not one host name or address."""
    for host in hosts:
        odd = any(c.isspace() or c in ",/:=" for c in host)
        if not host or (odd and not _is_ip(host)):
            raise BusError(
                f"invalid TLS host {host!r}: give one DNS name or IP address per entry, "
                "without spaces, ports or URLs (e.g. nats-1.example.com,10.0.0.5)"
            )


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _san(hosts: tuple[str, ...]) -> str:
    check_hosts(hosts)
    names = []
    for host in dict.fromkeys(hosts):  # keeps order, drops repeats
        try:
            ipaddress.ip_address(host)
        except ValueError:
            names.append(f"DNS:{host}")
        else:
            names.append(f"IP:{host}")
    return ",".join(names)


def _run(args: list[str], cwd: Path) -> None:
    result = subprocess.run(args, cwd=cwd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise BusError(f"openssl failed ({' '.join(args[1:3])}): {result.stderr.strip()[-1000:]}")


def _leaf(
    openssl: str, directory: Path, *, cert: Path, key: Path, subject: str, extensions: str
) -> None:
    csr = directory / f"{cert.stem}.csr"
    ext = directory / f"{cert.stem}.ext"
    ext.write_text(extensions)
    try:
        _run(
            [
                *[openssl, "req", "-new", "-nodes", "-newkey", "ec"],
                *["-pkeyopt", f"ec_paramgen_curve:{CURVE}", "-keyout", str(key)],
                *["-out", str(csr), "-subj", subject],
            ],
            directory,
        )
        _run(
            [
                *[openssl, "x509", "-req", "-in", str(csr), "-CA", "ca.pem"],
                *["-CAkey", "ca-key.pem", "-CAcreateserial", "-out", str(cert)],
                *["-days", str(CERT_DAYS), "-sha256", "-extfile", str(ext)],
            ],
            directory,
        )
    finally:
        csr.unlink(missing_ok=True)
        ext.unlink(missing_ok=True)


def write_tls_files(directory: Path, *, hosts: tuple[str, ...] = ()) -> TlsFiles:
    """A new CA, a server certificate valid for `hosts` (plus localhost and the
    loopback addresses) and a client certificate, in `directory`. Keys are written
    readable by their owner only; the CA key stays in `directory` to sign more."""
    openssl = openssl_binary()
    san = _san((*hosts, *DEFAULT_HOSTS))
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    files = TlsFiles.in_dir(directory)
    _run(
        [
            *[openssl, "req", "-x509", "-new", "-nodes", "-newkey", "ec"],
            *["-pkeyopt", f"ec_paramgen_curve:{CURVE}", "-keyout", "ca-key.pem"],
            *["-out", "ca.pem", "-days", str(CA_DAYS), "-sha256", "-subj", "/CN=Alnair NATS CA"],
            *["-addext", "basicConstraints=critical,CA:TRUE"],
            *["-addext", "keyUsage=critical,keyCertSign,cRLSign"],
        ],
        directory,
    )
    leaf = "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n"
    _leaf(
        openssl,
        directory,
        cert=files.server_cert,
        key=files.server_key,
        subject="/CN=alnair-nats",
        # clientAuth too: a server presents this certificate on its cluster routes.
        extensions=leaf + f"extendedKeyUsage=serverAuth,clientAuth\nsubjectAltName={san}\n",
    )
    _leaf(
        openssl,
        directory,
        cert=files.client_cert,
        key=files.client_key,
        subject="/CN=alnair-client",
        extensions=leaf + "extendedKeyUsage=clientAuth\n",
    )
    for private in (directory / "ca-key.pem", files.server_key, files.client_key):
        os.chmod(private, 0o600)
    (directory / "ca.srl").unlink(missing_ok=True)
    return files


def server_tls_block(files: TlsFiles, *, indent: str = "", timeout_s: float = 5.0) -> str:
    """A nats-server `tls {}` block: present the server certificate, require clients
    to present one signed by the CA."""
    lines = [
        "tls {",
        f"  cert_file: {json.dumps(str(files.server_cert))}",
        f"  key_file: {json.dumps(str(files.server_key))}",
        f"  ca_file: {json.dumps(str(files.ca))}",
        "  verify: true",
        f"  timeout: {timeout_s:g}",
        "}",
    ]
    return "".join(f"{indent}{line}\n" for line in lines)


def write_tls_config(files: TlsFiles, path: Path) -> Path:
    """The `tls {}` block as a file to include from a nats-server configuration: once
    at the top level (clients) and once inside `cluster {}` (routes)."""
    path.write_text(
        "# Generated by `alnair keys --tls`: include it at the top level of each server's\n"
        "# configuration, and inside its cluster {} block to encrypt the routes too.\n"
        + server_tls_block(files)
    )
    return path
