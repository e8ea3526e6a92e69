"""The few NATS JWTs auth callout needs, encoded and decoded by hand (no JWT library
here): the server's authorization request (decoded, signature checked), and the
authorization response carrying a user JWT (encoded, signed with the callout's
account nkey). Formats: nats-io/jwt v2 (`ed25519-nkey` signatures, base64url without
padding, the claims under `nats` with a `type` and `version` 2).
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Final

import nacl.exceptions
import nacl.signing
import nkeys

HEADER: Final = {"typ": "JWT", "alg": "ed25519-nkey"}
NO_LIMIT: Final = -1


class JwtError(ValueError):
    pass


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def encode(claims: dict[str, Any], signer: nkeys.KeyPair) -> str:
    """A signed JWT of `claims` (`iss` is set to the signer; `jti` to their hash)."""
    body = dict(claims, iss=signer.public_key.decode(), jti="")
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).digest()
    body["jti"] = base64.b32encode(digest).decode().rstrip("=")
    head = _b64(json.dumps(HEADER).encode()) + "." + _b64(json.dumps(body).encode())
    return head + "." + _b64(signer.sign(head.encode()))


def decode(token: str) -> dict[str, Any]:
    """The claims of a JWT whose signature verifies against its own `iss`."""
    try:
        head, body, signature = token.split(".")
        header = json.loads(_unb64(head))
        claims: dict[str, Any] = json.loads(_unb64(body))
    except (ValueError, json.JSONDecodeError) as error:
        raise JwtError(f"not a JWT: {error}") from None
    if header.get("alg") != HEADER["alg"]:
        raise JwtError(f"unexpected JWT algorithm {header.get('alg')!r}")
    issuer = str(claims.get("iss", ""))
    try:
        _verify_key(issuer).verify(f"{head}.{body}".encode(), _unb64(signature))
    except (ValueError, nacl.exceptions.CryptoError) as error:
        raise JwtError(f"JWT signature does not verify against {issuer!r}: {error}") from None
    return claims


def _verify_key(public: str) -> nacl.signing.VerifyKey:
    """An nkey public key (base32: a prefix byte, 32 key bytes, a CRC16) as a verifier."""
    raw = base64.b32decode(public + "=" * (-len(public) % 8))
    if len(raw) != 35 or nkeys.crc16(bytearray(raw[:33])) != int.from_bytes(raw[33:], "little"):
        raise ValueError("not an nkey public key")
    return nacl.signing.VerifyKey(raw[1:33])


@dataclass(frozen=True, slots=True)
class AuthRequest:
    """What the server asks about one connecting client."""

    server_id: str
    user_nkey: str
    token: str
    client_name: str
    # The client's TLS certificate (PEM) as the server verified it; "" without TLS.
    client_cert: str = ""


def parse_auth_request(data: bytes) -> AuthRequest:
    claims = decode(data.decode())
    nats = claims.get("nats", {})
    if nats.get("type") != "authorization_request":
        raise JwtError(f"not an authorization request: {nats.get('type')!r}")
    options = nats.get("connect_opts", {})
    tls = nats.get("client_tls") or {}
    # The leaf of the chain the server verified (else of what the client sent).
    chains = tls.get("verified_chains") or [tls.get("certs") or []]
    leaf = chains[0][0] if chains and chains[0] else ""
    return AuthRequest(
        server_id=str(nats.get("server_id", {}).get("id", "")),
        user_nkey=str(nats.get("user_nkey", "")),
        token=str(options.get("auth_token", "")),
        client_name=str(options.get("name", "")),
        client_cert=str(leaf),
    )


@dataclass(frozen=True, slots=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    # May answer one reply to each request it received (a worker host).
    allow_responses: bool = False


def authorization_response(
    request: AuthRequest,
    signer: nkeys.KeyPair,
    *,
    now: float,
    name: str = "",
    permissions: Permissions | None = None,
    expires_at: float | None = None,
    error: str = "",
    account: str = "$G",
) -> bytes:
    """The callout's answer: a user JWT with these permissions, or `error`."""
    nats: dict[str, Any] = {"type": "authorization_response", "version": 2}
    if error:
        nats["error"] = error
    else:
        assert permissions is not None
        user: dict[str, Any] = {
            "pub": {"allow": list(permissions.publish)},
            "sub": {"allow": list(permissions.subscribe)},
            "subs": NO_LIMIT,
            "data": NO_LIMIT,
            "payload": NO_LIMIT,
            "type": "user",
            "version": 2,
        }
        if permissions.allow_responses:
            user["resp"] = {"max": 1, "ttl": 0}
        user_claims: dict[str, Any] = {
            "sub": request.user_nkey,
            "aud": account,
            "name": name,
            "iat": int(now),
            "nats": user,
        }
        if expires_at is not None:
            user_claims["exp"] = int(expires_at)
        nats["jwt"] = encode(user_claims, signer)
    response = {"sub": request.user_nkey, "aud": request.server_id, "iat": int(now), "nats": nats}
    return encode(response, signer).encode()
