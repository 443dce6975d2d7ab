"""The tenants file (`--tenants FILE`): who may call the mesh, at which class, how much; and the
bound on each class's waiting queue. docs/tenants.md describes it for users.

    tenants:
      - name: acme
        api_keys: ["sk-acme-1", "sha256:<hex of another key>"]
        default_priority: normal
        max_priority: interactive
        max_concurrent_requests: 8
        tokens_per_minute: 200000
    queues:                       # optional; per class
      interactive: {max_waiting: 64}
    metrics_api_keys: ["sk-scrape"]   # optional; who may read /metrics ([]: anyone)

The gateway reads it for the keys and classes, the scheduler for the quotas and queue bounds;
both must be given the same file (`meshserve up` gives it to both). Keys are kept only as sha256
digests and compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .limits import PRIORITIES, Priority, check_priority

CLASSES: tuple[str, ...] = PRIORITIES  # best first: interactive, normal, background
DEFAULT_CLASS = "normal"


def rank(priority: str) -> int:
    """0 for the best class; a higher number is a lower class."""
    return CLASSES.index(priority)


def key_digest(key: str) -> bytes:
    """A stored key as its sha256 digest: `sha256:<hex>` as written, anything else is a plain key."""
    if key.startswith("sha256:"):
        return bytes.fromhex(key[len("sha256:"):])
    return hashlib.sha256(key.encode()).digest()


def _check_keys(keys: list[str]) -> list[str]:
    for k in keys:
        if not k:
            raise ValueError("an API key must not be empty")
        if k.startswith("sha256:"):
            h = k[len("sha256:"):]
            if len(h) != 64 or any(c not in "0123456789abcdefABCDEF" for c in h):
                raise ValueError("a 'sha256:' key must be followed by 64 hex digits")
    return keys


class Tenant(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    api_keys: list[str] = Field(min_length=1, repr=False)
    default_priority: Priority = DEFAULT_CLASS
    max_priority: Priority = "interactive"
    max_concurrent_requests: int | None = Field(default=None, ge=1)
    tokens_per_minute: int | None = Field(default=None, ge=1)
    # Its prompts' cached blocks are its own: every request of it is cache-salted with its name
    # (cache_salt below), so no other tenant hits them.
    isolate_prefix_cache: bool = False
    # Its share of the workers against other tenants' requests of the same class waiting at once:
    # the scheduler sends next the request of the tenant with the fewest in flight per weight.
    weight: float = Field(default=1.0, gt=0)

    @field_validator("api_keys")
    @classmethod
    def _keys(cls, v):
        return _check_keys(v)

    @model_validator(mode="after")
    def _default_within_max(self):
        if rank(self.default_priority) < rank(self.max_priority):
            raise ValueError(f"default_priority {self.default_priority!r} is above max_priority "
                             f"{self.max_priority!r}")
        return self


def cache_salt(tenant: Tenant | None, requested: str | None) -> str | None:
    """What a request's prefix-cache keys are salted with (prefix_hash.namespace): the request's
    own cache_salt, and its tenant's name when the tenant isolates its cache. The two kinds never
    coincide, so no request's salt opens an isolated tenant's blocks."""
    if tenant is None or not tenant.isolate_prefix_cache:
        return None if requested is None else f"request:{requested}"
    return "tenant:" + json.dumps([tenant.name, requested])


class QueueLimit(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_waiting: int = Field(ge=0)


class TenantsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenants: list[Tenant] = Field(min_length=1)
    queues: dict[Priority, QueueLimit] = Field(default_factory=dict)
    # Who may read /metrics: None, any tenant's key; [], anyone.
    metrics_api_keys: list[str] | None = Field(default=None, repr=False)

    @field_validator("metrics_api_keys")
    @classmethod
    def _keys(cls, v):
        return v if v is None else _check_keys(v)

    @model_validator(mode="after")
    def _unique(self):
        names = [t.name for t in self.tenants]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"tenant names must be unique; repeated: {', '.join(sorted(dup))}")
        owner: dict[bytes, str] = {}
        for t in self.tenants:
            for k in t.api_keys:
                d = key_digest(k)
                if d in owner and owner[d] != t.name:
                    raise ValueError(f"one API key belongs to two tenants: {owner[d]} and {t.name}")
                owner[d] = t.name
        return self

    def tenant(self, name: str) -> Tenant | None:
        return next((t for t in self.tenants if t.name == name), None)


class TenantsFileError(ValueError):
    """A tenants file that cannot be used; the message is one line saying why."""


def load_tenants(path: str | Path) -> TenantsFile:
    try:
        data = yaml.safe_load(Path(path).expanduser().read_text())
    except OSError as e:
        raise TenantsFileError(f"cannot read {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise TenantsFileError(f"{path} is not valid YAML: {' '.join(str(e).split())}") from None
    if not isinstance(data, dict):
        raise TenantsFileError(f"{path}: expected a mapping with a 'tenants' list")
    try:
        return TenantsFile.model_validate(data)
    except ValidationError as e:
        def where(loc) -> str:
            return ".".join(str(x) for x in loc) or "(top level)"

        problems = "; ".join(f"{where(err['loc'])}: {err['msg']}" for err in e.errors())
        raise TenantsFileError(f"{path}: {problems}") from None


class KeyRing:
    """API key -> tenant. Every stored digest is compared (hmac.compare_digest) whatever matches,
    so the time taken says nothing about which key, or how much of one, was right."""

    def __init__(self, entries: list[tuple[str, object]]):
        self._entries = [(key_digest(k), owner) for k, owner in entries]

    def lookup(self, key: str | None):
        if not key:
            return None
        digest = hashlib.sha256(key.encode()).digest()
        found = None
        for stored, owner in self._entries:
            if hmac.compare_digest(stored, digest):
                found = owner
        return found


class ClassNotAllowed(Exception):
    """The request asked for a class above its tenant's max_priority."""


def request_class(asked, tenant: Tenant | None) -> str:
    """A request's class: its `priority` field; else its tenant's default; else normal.
    Raises ValueError for a value that is not a class, ClassNotAllowed above the tenant's maximum."""
    if asked is None:
        return tenant.default_priority if tenant is not None else DEFAULT_CLASS
    asked = check_priority(asked)  # ValueError (limits.LimitError) for a value that is not a class
    if tenant is not None and rank(asked) < rank(tenant.max_priority):
        raise ClassNotAllowed(f"tenant {tenant.name!r} may ask for priority {tenant.max_priority!r} at most, "
                              f"not {asked!r}")
    return asked
