"""Who is calling the HTTP API: bearer tokens mapped to tenants, some of them operators.

The tokens file (JSON or YAML) lists each token with its tenant:

    tokens:
      - {token: "...", tenant: alice}
      - {token: "...", tenant: operator, operator: true}

A tenant sees and touches only its own jobs; an operator may also read every tenant's
jobs and events, read `/metrics`, and drain or resume nodes. The tenant is taken from
the token, never from the request.
"""

from __future__ import annotations

import hmac
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from bus.auth import write_private
from schemas.api import OPERATOR_TENANT
from schemas.base import TenantName, describe_invalid
from schemas.errors import AlnairError
from schemas.yamlfile import load_yaml, read_text

MIN_TOKEN_CHARS: Final = 16
DEFAULT_TENANT: Final = "default"


class TokenFileError(AlnairError, ValueError):
    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"tokens file {path}: {reason}")
        self.path = path


class TokenEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    token: str = Field(min_length=MIN_TOKEN_CHARS, max_length=512)
    tenant: TenantName
    operator: bool = False


class TokenFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    tokens: tuple[TokenEntry, ...] = Field(min_length=1)


@dataclass(frozen=True, slots=True)
class Caller:
    tenant: str
    operator: bool = False


class TokenTable:
    def __init__(self, entries: tuple[TokenEntry, ...]) -> None:
        seen: set[str] = set()
        for entry in entries:
            if entry.token in seen:
                raise ValueError(f"token for tenant {entry.tenant} is listed twice")
            seen.add(entry.token)
        self._entries = entries

    @classmethod
    def load(cls, path: Path) -> TokenTable:
        try:
            data = load_yaml(read_text(path))
        except OSError as error:
            raise TokenFileError(path, f"cannot read it: {error.strerror or error}") from None
        except yaml.YAMLError as error:
            raise TokenFileError(path, f"not valid JSON or YAML: {error}") from None
        try:
            return cls(TokenFile.model_validate(data).tokens)
        except ValidationError as error:
            raise TokenFileError(path, describe_invalid(error, "file")) from None
        except ValueError as error:
            raise TokenFileError(path, str(error)) from None

    def caller(self, token: str) -> Caller | None:
        """The caller a token names; compares against every entry in constant time each."""
        found: Caller | None = None
        presented = token.encode()
        for entry in self._entries:
            if hmac.compare_digest(presented, entry.token.encode()):
                found = Caller(tenant=entry.tenant, operator=entry.operator)
        return found

    def token_for(self, tenant: str, *, operator: bool = False) -> str | None:
        """A token of this tenant (for the banner and tests), if the file has one."""
        return next(
            (e.token for e in self._entries if e.tenant == tenant and e.operator == operator),
            None,
        )


def ensure_tokens_file(path: Path) -> TokenTable:
    """Load the tokens file, first writing one (tenant `default` and an operator) if missing.

    The new file is readable by its owner only: the tokens are the credentials.
    """
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        content = TokenFile(
            tokens=(
                TokenEntry(token=secrets.token_urlsafe(24), tenant=DEFAULT_TENANT),
                TokenEntry(token=secrets.token_urlsafe(24), tenant=OPERATOR_TENANT, operator=True),
            )
        )
        tmp = path.with_name(path.name + ".tmp")
        write_private(tmp, content.model_dump_json(indent=2) + "\n")
        tmp.replace(path)
    return TokenTable.load(path)
