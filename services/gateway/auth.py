"""API keys and request classes at the gateway, from the tenants file (shared/tenants.py).

With a tenants file, every endpoint but /health needs a tenant's key: `Authorization: Bearer <key>`
on HTTP, the same `Authorization` header on a NATS API message. A missing or unknown key is 401
`invalid_api_key`. /metrics takes one of `metrics_api_keys` when the file lists them (an empty
list: no key at all), else any tenant's key. A request's class is `request_class` (its `priority`,
else its tenant's default, else normal); asking above the tenant's max_priority is 403. Quotas and
queue bounds are the scheduler's (services/scheduler/admission.py), which sees every gateway's
requests. Without a tenants file nothing is checked.
"""

from __future__ import annotations

from meshserve.shared.openai_protocol import OpenAIError
from meshserve.shared.tenants import ClassNotAllowed, KeyRing, Tenant, TenantsFile, request_class

AUTH_HEADER = "Authorization"


def bearer(value: str | None) -> str | None:
    """The key of an `Authorization: Bearer <key>` header value."""
    if not value:
        return None
    scheme, _, key = value.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return key.strip() or None


def invalid_key(message: str) -> OpenAIError:
    return OpenAIError(message, 401, code="invalid_api_key")


def rejection_reason(e: OpenAIError) -> str | None:
    """What kind of admission refusal `e` is, for the per-tenant rejection counter; None: not one."""
    if e.code in ("invalid_api_key", "priority_not_allowed", "queue_full"):
        return e.code
    if e.status_code == 429:
        return {"requests": "max_concurrent_requests", "tokens": "tokens_per_minute"}.get(e.type, "rate_limit")
    return None


class Auth:
    def __init__(self, config: TenantsFile | None):
        self.config = config
        self._tenants = KeyRing([(k, t) for t in config.tenants for k in t.api_keys]) if config else None
        metrics = config.metrics_api_keys if config else None
        self._metrics = None if metrics is None else KeyRing([(k, True) for k in metrics])
        self._metrics_open = metrics == []

    @property
    def enabled(self) -> bool:
        return self.config is not None

    def tenant(self, authorization: str | None) -> Tenant | None:
        """The tenant whose key the header carries; None without a tenants file. Raises 401."""
        if self._tenants is None:
            return None
        key = bearer(authorization)
        if key is None:
            raise invalid_key("You didn't provide an API key. Send it in the Authorization header as "
                              "'Authorization: Bearer YOUR_KEY'.")
        tenant = self._tenants.lookup(key)
        if tenant is None:
            raise invalid_key("Incorrect API key provided.")
        return tenant

    def check_metrics(self, authorization: str | None) -> None:
        """Raises 401 unless the header may read /metrics."""
        if self._metrics is None:
            self.tenant(authorization)
        elif not self._metrics_open and not self._metrics.lookup(bearer(authorization)):
            raise invalid_key("/metrics needs one of the tenants file's metrics_api_keys as "
                              "'Authorization: Bearer KEY'.")

    @staticmethod
    def request_class(asked, tenant: Tenant | None) -> str:
        """The class the request runs as; raises 400 for a bad value, 403 above the tenant's maximum."""
        try:
            return request_class(asked, tenant)
        except ClassNotAllowed as e:
            raise OpenAIError(str(e), 403, param="priority", code="priority_not_allowed") from None
        except ValueError as e:
            raise OpenAIError(str(e), param="priority") from None
