"""Jobs' NATS identities: the brain's auth callout.

Every component of the cluster is a static nkey user (bus/auth.py); a job is not. The
server hands any other connection to the auth callout (`$SYS.REQ.USER.AUTH`), which the
leading brain answers. A job connects with the token of its attempt
(`ALNAIR_JOB_TOKEN`, `<job>:<attempt>:<mac>` under the cluster key, brain/secrets.py),
put in its launch's environment by the brain. The callout admits it only while that
attempt runs, as a user that may use its own job's subjects and nothing else
(`bus.auth.job_permissions`). Once the attempt has ended the token admits nobody.

The users it admits expire `ttl_s` after admission (an hour by default). nats-py closes a
connection whose user expired ('User Authentication Expired') rather than reconnecting
(nats-io/nats.py#1019), so a job's connections renew their user before then: they
reconnect every `ttl_s / 2` (`ALNAIR_JOB_RENEW_S` in the launch, read by
workloads/sdk.py), and the server asks this callout again. While the attempt runs it is
admitted again; once it has ended, a process it left behind with a connection is cut
off at the latest when the user it holds expires.

Under mutual TLS a confined job's connection also presents its attempt's own client
certificate (`CN=job-<job>-<attempt>`, bus/tls.py): a job certificate that names
another attempt than the token is refused, so a certificate kept from an ended attempt
cannot be used with a running one's token.

The callout's answers are JWTs signed with the account key whose public half is the
`issuer` of the server's `auth_callout` block (`callout-issuer.nk` from `alnair keys`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import nkeys
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from brain import secrets
from bus.auth import job_permissions
from bus.client import Bus
from bus.natsjwt import JwtError, authorization_response, parse_auth_request
from bus.tls import JOB_CERT_PREFIX, common_name, job_certificate_name

log = logging.getLogger(__name__)

AUTH_CALLOUT_SUBJECT: Final = "$SYS.REQ.USER.AUTH"
DEFAULT_TTL_S: Final = 3600.0


def load_signer(path: str | Path) -> nkeys.KeyPair:
    return nkeys.from_seed(Path(path).read_bytes().strip())


@dataclass
class JobCredentials:
    """Answers the server's authorization requests for jobs."""

    signer: nkeys.KeyPair
    # The cluster key (read or made on first use).
    key: Callable[[], Awaitable[bytes]]
    # Whether this attempt of this job runs now.
    running: Callable[[str, int], bool]
    # The users' lifetime (see above); None: they never expire.
    ttl_s: float | None = DEFAULT_TTL_S
    clock: Callable[[], float] = time.time
    admitted: int = field(default=0)
    refused: int = field(default=0)

    @property
    def renew_s(self) -> float | None:
        """How often a job's connection should renew its user."""
        return None if self.ttl_s is None else self.ttl_s / 2

    async def serve(self, bus: Bus) -> Subscription:
        return await bus.nc.subscribe(AUTH_CALLOUT_SUBJECT, cb=self._on_request)

    async def _on_request(self, msg: Msg) -> None:
        if not msg.reply:
            return
        try:
            answer = await self.answer(msg.data)
        except JwtError as error:
            log.warning("auth callout: unreadable request: %s", error)
            return  # the server times the client out
        await msg.respond(answer)

    async def answer(self, request_data: bytes) -> bytes:
        request = parse_auth_request(request_data)
        now = self.clock()
        found = secrets.check_job_token(await self.key(), request.token)
        refusal = None
        if found is None:
            refusal = "not a job token of this cluster"
        elif not self.running(*found):
            refusal = f"job {found[0]} attempt {found[1]} is not running"
        else:
            refusal = _certificate_refusal(request.client_cert, *found)
        if refusal is not None or found is None:
            self.refused += 1
            log.info("auth callout: refused %r: %s", request.client_name, refusal)
            return authorization_response(request, self.signer, now=now, error=refusal or "")
        job_id, attempt = found
        self.admitted += 1
        return authorization_response(
            request,
            self.signer,
            now=now,
            name=f"job-{job_id}-{attempt}",
            permissions=job_permissions(job_id, attempt),
            expires_at=None if self.ttl_s is None else now + self.ttl_s,
        )


def _certificate_refusal(pem: str, job_id: str, attempt: int) -> str | None:
    """Why a job's TLS certificate (agents/confine.py) may not come with this token:
    it names another attempt. Other certificates (the cluster's shared client one, an
    unconfined job's) are not the callout's to judge."""
    if not pem:
        return None
    name = common_name(pem)
    if name is None or not name.startswith(JOB_CERT_PREFIX):
        return None
    if name != job_certificate_name(job_id, attempt):
        return f"TLS certificate {name} is not job {job_id} attempt {attempt}'s"
    return None
