"""TLS for NATS: a private CA, a server certificate, a client certificate, and the
job issuer that signs each confined job attempt's own short-lived client certificate.

`write_tls_files` makes them with the `openssl` command (the `cryptography` package is
not a dependency of Alnair); `server_tls_block` is the nats-server `tls {}` block that
uses them. The servers verify clients (mutual TLS): a client must present a
certificate signed by the same CA, on top of its nkey identity (bus/auth.py). The
server certificate is also a client certificate, so servers use it for their cluster
routes.

The job issuer (`jobs-ca.pem`) is an intermediate CA signed by the cluster CA that may
sign client certificates only (`extendedKeyUsage=clientAuth`, `pathlen:0`): an agent
holding its key can admit a job's connection to the TLS layer, and cannot make a server
certificate that clients would trust (TLS stacks refuse a serverAuth leaf under it).
A job's certificate carries no authority of its own: what it may do on the bus is its
token's (brain/credentials.py).

What this module must not do: decide who may publish what (that is bus/auth.py).
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import ssl
import subprocess
import tempfile
import time
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


@dataclass(frozen=True, slots=True)
class JobIssuer:
    """The intermediate CA that signs jobs' client certificates (see above)."""

    cert: Path
    key: Path

    @classmethod
    def in_dir(cls, directory: Path) -> JobIssuer:
        return cls(cert=directory / "jobs-ca.pem", key=directory / "jobs-ca-key.pem")

    def check(self) -> None:
        missing = [str(p) for p in (self.cert, self.key) if not p.is_file()]
        if missing:
            raise BusError(
                f"job TLS issuer files missing: {', '.join(missing)} "
                "(`alnair keys --tls` writes them)"
            )


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


def write_tls_files(
    directory: Path, *, hosts: tuple[str, ...] = (), keep: bool = False
) -> TlsFiles:
    """A new CA, a server certificate valid for `hosts` (plus localhost and the
    loopback addresses) and a client certificate, in `directory`. Keys are written
    readable by their owner only; the CA key stays in `directory` to sign more.

    With `keep`, a CA already there (certificate and key) is kept, and with it the
    client certificate and the job issuer where they are there too: only the server
    certificate is made again (for `hosts`, which may have changed), so that no
    client's files change."""
    openssl = openssl_binary()
    san = _san((*hosts, *DEFAULT_HOSTS))
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    files = TlsFiles.in_dir(directory)
    issuer = JobIssuer.in_dir(directory)
    ca_key = directory / "ca-key.pem"
    keep = keep and files.ca.is_file() and ca_key.is_file()
    if not keep:
        _run(
            [
                *[openssl, "req", "-x509", "-new", "-nodes", "-newkey", "ec"],
                *["-pkeyopt", f"ec_paramgen_curve:{CURVE}", "-keyout", "ca-key.pem"],
                *["-out", "ca.pem", "-days", str(CA_DAYS), "-sha256"],
                *["-subj", "/CN=Alnair NATS CA"],
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
    if not (keep and files.client_cert.is_file() and files.client_key.is_file()):
        _leaf(
            openssl,
            directory,
            cert=files.client_cert,
            key=files.client_key,
            subject="/CN=alnair-client",
            extensions=leaf + "extendedKeyUsage=clientAuth\n",
        )
    if not (keep and issuer.cert.is_file() and issuer.key.is_file()):
        _leaf(
            openssl,
            directory,
            cert=issuer.cert,
            key=issuer.key,
            subject="/CN=Alnair job issuer",
            extensions="basicConstraints=critical,CA:TRUE,pathlen:0\n"
            "keyUsage=critical,keyCertSign\nextendedKeyUsage=clientAuth\n",
        )
    for private in (ca_key, files.server_key, files.client_key, issuer.key):
        os.chmod(private, 0o600)
    (directory / "ca.srl").unlink(missing_ok=True)
    return files


# `openssl ca` rather than `openssl x509 -req`: it takes a start and end time to the
# second (x509 counts whole days), which a short-lived certificate needs.
_CA_CONFIG: Final = """\
[ ca ]
default_ca = job
[ job ]
database = index.txt
serial = serial.txt
new_certs_dir = .
default_md = sha256
policy = any_name
unique_subject = no
x509_extensions = leaf
[ any_name ]
commonName = supplied
[ leaf ]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = clientAuth
"""
# A little slack for clocks that disagree between the agent's node and the servers'.
CLOCK_SKEW_S: Final = 300


def issue_job_certificate(
    issuer: JobIssuer,
    cert: Path,
    key: Path,
    *,
    name: str,
    valid_s: float,
    now: float,
    owner: tuple[int, int] | None = None,
) -> float:
    """A fresh key and a client certificate for `name`, valid from a little before
    `now` for `valid_s`, signed by `issuer`; `cert` holds it followed by the issuer's
    certificate (the chain a server needs to reach the cluster CA). Both files are
    replaced at once (a job reloading them never reads half of one), owned by `owner`
    (uid, gid), the key readable by it alone. Returns when the certificate expires."""
    openssl = openssl_binary()
    not_after = now + valid_s
    with tempfile.TemporaryDirectory(prefix="alnair-cert-") as scratch:
        work = Path(scratch)
        (work / "index.txt").write_text("")
        # A random serial (positive, 127 bits), as `-rand_serial` would pick.
        (work / "serial.txt").write_text(f"{int.from_bytes(os.urandom(16)) >> 1:032X}\n")
        (work / "ca.cnf").write_text(_CA_CONFIG)
        _run(
            [
                *[openssl, "req", "-new", "-nodes", "-newkey", "ec"],
                *["-pkeyopt", f"ec_paramgen_curve:{CURVE}", "-keyout", "key.pem"],
                *["-out", "req.csr", "-subj", f"/CN={name}"],
            ],
            work,
        )
        _run(
            [
                *[openssl, "ca", "-batch", "-notext", "-config", "ca.cnf"],
                *["-cert", str(issuer.cert.resolve()), "-keyfile", str(issuer.key.resolve())],
                *["-in", "req.csr", "-out", "leaf.pem"],
                *["-startdate", _asn1_time(now - CLOCK_SKEW_S)],
                *["-enddate", _asn1_time(not_after)],
            ],
            work,
        )
        chain = (work / "leaf.pem").read_bytes() + issuer.cert.read_bytes()
        for data, target, mode in (
            ((work / "key.pem").read_bytes(), key, 0o400),
            (chain, cert, 0o440),
        ):
            staged = target.with_name(f".{target.name}.new")
            staged.unlink(missing_ok=True)
            descriptor = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(descriptor, "wb") as out:
                out.write(data)
            if owner is not None:
                os.chown(staged, *owner)
            staged.chmod(mode)
            os.replace(staged, target)
    return not_after


JOB_CERT_PREFIX: Final = "job-"
COMMON_NAME_OID: Final = bytes.fromhex("550403")  # 2.5.4.3


def job_certificate_name(job_id: str, attempt: int) -> str:
    """The subject common name of an attempt's own certificate."""
    return f"{JOB_CERT_PREFIX}{job_id}-{attempt}"


def common_name(pem: str) -> str | None:
    """The subject common name of the first certificate in `pem`, or None when it has
    none or cannot be read. A few lines of DER walking: the `cryptography` package is
    not a dependency."""
    footer = "-----END CERTIFICATE-----"
    try:
        der = ssl.PEM_cert_to_DER_cert(pem[: pem.index(footer) + len(footer)])
        _, start, _ = _der(der, 0)  # Certificate
        _, start, end = _der(der, start)  # TBSCertificate
        fields = []
        while start < end:
            tag, value, start = _der(der, start)
            fields.append((tag, value, start))
        if fields and fields[0][0] == 0xA0:  # [0] version
            fields = fields[1:]
        # serialNumber, signature, issuer, validity, subject
        _, start, end = fields[4]
        name = None
        while start < end:  # RelativeDistinguishedName: a SET of attributes
            _, rdn, start = _der(der, start)
            while rdn < end and rdn < start:
                _, attribute, rdn = _der(der, rdn)
                _, oid, after = _der(der, attribute)
                if der[oid:after] == COMMON_NAME_OID:
                    _, text, text_end = _der(der, after)
                    name = der[text:text_end].decode()
        return name
    except (ValueError, IndexError, UnicodeDecodeError):
        return None


def _der(der: bytes, at: int) -> tuple[int, int, int]:
    """(tag, where its value starts, where it ends) of the DER element at `at`."""
    tag, length = der[at], der[at + 1]
    start = at + 2
    if length & 0x80:
        octets = length & 0x7F
        length = int.from_bytes(der[start : start + octets], "big")
        start += octets
    if start + length > len(der):
        raise ValueError("truncated DER")
    return tag, start, start + length


def _asn1_time(when: float) -> str:
    return time.strftime("%Y%m%d%H%M%SZ", time.gmtime(when))


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
