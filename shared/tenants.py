"""API keys -> tenants, each with its own limits and its own prefix-cache salt.

Keys come from a TOML file (`--api-keys-file`) or `KVMESH_API_KEYS` ("tenant=key,..."). Only
their sha256 digests are kept, and a presented key is compared against every entry with
`hmac.compare_digest` (no early exit), so neither timing nor logs reveal a key. With no keys
configured, auth is off and every request runs as the tenant "anonymous".

    [tenants.acme]
    keys = ["sk-acme-1", "sk-acme-2"]
    requests_per_second = 5      # token bucket; 0 or absent: unlimited
    tokens_per_minute = 60000    # prompt + n x max_tokens charged on admission; unused
                                 # refunded
    max_concurrent = 8           # sequences in flight at once across every gateway (a
                                 # request with n completions counts n)
    max_in_flight_tokens = 50000 # prompt + n x max_tokens of its requests in flight
    highest_priority = -10       # the most urgent priority it may send (lower runs first);
                                 # absent: 0, so no key can push ahead of normal traffic
    weight = 2.0                 # its share of each scheduler against other tenants; 1.0

    [defaults]                   # each limit, for every tenant that does not set it
    max_concurrent = 64
    max_in_flight_tokens = 200000

With auth off, "anonymous" may send any priority (one user: no one else to push aside).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, replace

import tomllib

from shared.errors import KvmeshError, Reason

ANONYMOUS = "anonymous"
ANY_PRIORITY = -(2**31)
_SALT_CONTEXT = b"kvmesh prefix-cache salt\x00"


@dataclass(frozen=True)
class TenantLimits:
    requests_per_second: float = 0.0  # 0: unlimited
    tokens_per_minute: float = 0.0
    max_concurrent: int = 0  # sequences (n each) in flight
    max_in_flight_tokens: int = 0  # prompt + n x max_tokens in flight

    @property
    def unlimited(self) -> bool:
        return not (
            self.requests_per_second
            or self.tokens_per_minute
            or self.max_concurrent
            or self.max_in_flight_tokens
        )


# A tenant's limits in the keys file, each its own or [defaults]'s: name -> type.
_LIMIT_FIELDS: dict[str, type] = {f.name: type(f.default) for f in fields(TenantLimits)}


@dataclass(frozen=True)
class Tenant:
    name: str
    limits: TenantLimits = field(default_factory=TenantLimits)
    admin: bool = False  # may call ModelAdmin (add schedulers, move traffic)
    highest_priority: int = 0  # the lowest priority value its requests may carry
    weight: float = 1.0  # its fair share of a scheduler's batch and KV pool, against other tenants

    def check_priority(self, priority: int) -> None:
        if priority < self.highest_priority:
            raise KvmeshError(
                Reason.PERMISSION_DENIED,
                f"priority {priority} is above what tenant {self.name!r} may ask for (the "
                f"most urgent it may send is {self.highest_priority}; lower runs first)",
            )

    @property
    def cache_salt(self) -> bytes:
        """Derived here from the tenant, never taken from a client: tenants never share
        cached blocks, so one cannot time another's prompts through the prefix cache."""
        return hashlib.sha256(_SALT_CONTEXT + self.name.encode()).digest()[:16]


class ApiKeys:
    def __init__(self, entries: Iterable[tuple[str, Tenant]] = ()) -> None:
        self._entries = [(_digest(key), tenant) for key, tenant in entries]
        self.anonymous = Tenant(ANONYMOUS, highest_priority=ANY_PRIORITY)

    def default_max_concurrent(self, limit: int) -> None:
        """Every tenant without its own `max_concurrent` (and anonymous) gets `limit`."""
        if limit <= 0:
            return

        def bounded(tenant: Tenant) -> Tenant:
            if tenant.limits.max_concurrent:
                return tenant
            return replace(tenant, limits=replace(tenant.limits, max_concurrent=limit))

        self._entries = [(digest, bounded(tenant)) for digest, tenant in self._entries]
        self.anonymous = bounded(self.anonymous)

    @property
    def enabled(self) -> bool:
        return bool(self._entries)

    @property
    def tenants(self) -> list[Tenant]:
        return list({t.name: t for _, t in self._entries}.values())

    @classmethod
    def from_toml(cls, path: str) -> ApiKeys:
        with open(path, "rb") as handle:
            try:
                document = tomllib.load(handle)
            except tomllib.TOMLDecodeError as error:
                raise KvmeshError(Reason.INVALID_ARGUMENT, f"{path}: {error}") from None
        entries: list[tuple[str, Tenant]] = []
        defaults = document.get("defaults", {})
        unknown = set(defaults) - set(_LIMIT_FIELDS) if isinstance(defaults, dict) else {"?"}
        if unknown:
            raise KvmeshError(
                Reason.INVALID_ARGUMENT,
                f"{path}: [defaults] takes {', '.join(_LIMIT_FIELDS)}; not {sorted(unknown)}",
            )
        for name, table in document.get("tenants", {}).items():
            keys = table.get("keys", [])
            if not keys or not all(isinstance(k, str) and k for k in keys):
                raise KvmeshError(
                    Reason.INVALID_ARGUMENT, f"{path}: tenant {name!r} needs a non-empty keys list"
                )
            limits = TenantLimits(
                **{
                    limit: kind(table.get(limit, defaults.get(limit, 0)))
                    for limit, kind in _LIMIT_FIELDS.items()
                }
            )
            admin = table.get("admin", False) is True
            highest_priority = int(table.get("highest_priority", 0))
            weight = float(table.get("weight", 1.0))
            if weight <= 0:
                raise KvmeshError(
                    Reason.INVALID_ARGUMENT, f"{path}: tenant {name!r} needs a weight above 0"
                )
            tenant = Tenant(name, limits, admin, highest_priority, weight)
            entries += [(key, tenant) for key in keys]
        return cls(entries)

    @classmethod
    def configured(cls, path: str | None) -> ApiKeys:
        """From `--api-keys-file PATH`, else `KVMESH_API_KEYS`; none: auth off."""
        if path:
            return cls.from_toml(path)
        return cls.from_env(os.environ.get("KVMESH_API_KEYS", ""))

    def require_admin(self, metadata: Iterable[tuple[str, str | bytes]] | None, what: str) -> None:
        """With auth on: UNAUTHENTICATED without a valid key, PERMISSION_DENIED for a tenant
        that is not an admin. With auth off: nothing."""
        if not self.enabled:
            return
        tenant = self.authenticate(metadata)
        if not tenant.admin:
            raise KvmeshError(Reason.PERMISSION_DENIED, f"tenant {tenant.name!r} may not {what}")

    @classmethod
    def from_env(cls, text: str) -> ApiKeys:
        """ "tenant=key,tenant=key": tenants without limits."""
        entries = []
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, sep, key = item.partition("=")
            if not sep or not name or not key:
                raise KvmeshError(
                    Reason.INVALID_ARGUMENT,
                    "KVMESH_API_KEYS takes tenant=key pairs, comma-separated",
                )
            entries.append((key, Tenant(name)))
        return cls(entries)

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Tenant:
        if not self.enabled:
            return self.anonymous
        presented = _presented_key(metadata or ())
        if presented is None:
            raise KvmeshError(
                Reason.UNAUTHENTICATED,
                "an API key is required: send 'authorization: Bearer KEY' metadata",
            )
        digest = _digest(presented)
        found: Tenant | None = None
        for key_digest, tenant in self._entries:  # every entry, whatever matched
            if hmac.compare_digest(digest, key_digest):
                found = tenant
        if found is None:
            raise KvmeshError(Reason.UNAUTHENTICATED, "the API key is not valid")
        return found


def _presented_key(metadata: Iterable[tuple[str, str | bytes]]) -> str | None:
    for name, value in metadata:
        text = value.decode(errors="replace") if isinstance(value, bytes) else value
        if name == "authorization":
            scheme, _, token = text.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
        elif name == "x-api-key" and text:
            return text
    return None


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def end_user_digest(tenant: str, user: str) -> str:
    """A stable name for a client's end user (`GenerateRequest.user`) that logs and traces can
    carry: one user's requests group together, the value given never appears, and two tenants'
    same user string do not match. Empty when no user was given."""
    if not user:
        return ""
    return hashlib.sha256(f"{tenant}\0{user}".encode()).hexdigest()[:16]
