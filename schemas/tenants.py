"""The tenant map: which Unix user (and group) each tenant's jobs run as on a node.

Given to brains (a tenant with no entry is refused at submit, by name) and to agents
(which start each job as its tenant's user). Parsing only, from the file's text; the
callers read the file. An error names the file, the tenant and what is wrong.

```yaml
tenants:
  default: {user: alnair-default}
  research: {user: alnair-research, group: research}   # group: the user's own if left out
```
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

import yaml

from schemas.base import check_name
from schemas.errors import AlnairError, InvalidName
from schemas.yamlfile import load_yaml

# What useradd accepts on most distributions (and no leading dash).
_UNIX_NAME: Final = re.compile(r"^[a-z_][a-z0-9_.-]{0,31}$")
EXAMPLE: Final = "tenants:\n  default: {user: alnair-default}"


class TenantMapError(AlnairError, ValueError):
    """A tenant map that cannot be used; says where and what is wrong."""


@dataclass(frozen=True, slots=True)
class TenantUser:
    tenant: str
    user: str
    # None: the user's primary group.
    group: str | None = None


@dataclass(frozen=True, slots=True)
class TenantMap:
    users: tuple[TenantUser, ...]
    source: str = ""

    def get(self, tenant: str) -> TenantUser | None:
        return next((u for u in self.users if u.tenant == tenant), None)

    @property
    def tenants(self) -> frozenset[str]:
        return frozenset(u.tenant for u in self.users)


def _entry(tenant: object, value: object, where: str) -> TenantUser:
    if not isinstance(tenant, str):
        # YAML reads `no`, `on`, `1` as a boolean or a number, not as the name written.
        raise TenantMapError(
            f"{where}: tenant name {tenant!r} is not text (YAML reads it as "
            f"{type(tenant).__name__}): quote it, as in 'no': {{user: ...}}"
        )
    for key in ("user", "group"):
        if isinstance(value, dict) and key in value and not isinstance(value[key], str):
            raise TenantMapError(
                f"{where}: tenant {tenant}: {key} {value[key]!r} is not text (YAML reads "
                f"it as {type(value[key]).__name__}): quote it"
            )
    try:
        name = check_name("tenant", str(tenant))
    except InvalidName as error:
        raise TenantMapError(f"{where}: {error}") from None
    if not isinstance(value, dict) or "user" not in value:
        raise TenantMapError(f"{where}: tenant {name}: expected {{user: NAME[, group: NAME]}}")
    unknown = set(value) - {"user", "group"}
    if unknown:
        raise TenantMapError(f"{where}: tenant {name}: unknown keys {', '.join(sorted(unknown))}")
    for key in ("user", "group"):
        if key in value and not _UNIX_NAME.match(str(value[key])):
            raise TenantMapError(
                f"{where}: tenant {name}: {key} {value[key]!r} is not a valid Unix name"
            )
    if str(value["user"]) == "root":
        raise TenantMapError(f"{where}: tenant {name}: jobs may not run as root")
    group = value.get("group")
    return TenantUser(name, str(value["user"]), str(group) if group is not None else None)


def parse_tenant_map(text: str, *, where: str = "tenant map") -> TenantMap:
    try:
        data = load_yaml(text)
    except yaml.YAMLError as error:
        raise TenantMapError(f"{where}: not valid YAML: {error}") from None
    if (
        not isinstance(data, dict)
        or set(data) != {"tenants"}
        or not isinstance(data["tenants"], dict)
    ):
        raise TenantMapError(f"{where}: expected a 'tenants' mapping, e.g.\n{EXAMPLE}")
    users = tuple(_entry(t, v, where) for t, v in data["tenants"].items())
    return TenantMap(users, source=where)


def render_tenant_map(users: tuple[TenantUser, ...]) -> str:
    lines = ["tenants:"]
    for u in users:
        group = f", group: {u.group}" if u.group else ""
        lines.append(f"  {u.tenant}: {{user: {u.user}{group}}}")
    return "\n".join(lines) + "\n"
