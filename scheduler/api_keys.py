"""API keys for the HTTP API: OpenAI's scheme (``Authorization: Bearer KEY``), several keys at once.

- ``--api-key`` (repeatable; also ``PAGEDKV_API_KEY``, comma-separated): the keys that may call
  ``/v1/*`` and, unless admin keys are set, ``/kv_cache``.
- ``--admin-api-key`` (repeatable; also ``PAGEDKV_ADMIN_API_KEY``): the only keys ``/kv_cache``
  accepts when set; they also work on ``/v1/*``.
- ``/health`` and ``/metrics`` stay open (orchestrators and Prometheus probe them without keys), and
  ``/kv_cache/ui``, a static page with no data (it asks for a key and sends it with its own requests).

Tenant privacy: with ``--prefix-cache-isolation api-key`` (the default once keys are set) each key's
requests hash their blocks with the key's fingerprint as a salt, so one tenant's prompt never hits
another tenant's cached blocks. Without it the prefix cache is a side channel: a request whose
prompt prefix another user sent recently comes back faster and reports more ``cached_tokens``.
"""

from __future__ import annotations

import hashlib
import hmac
import os


def fingerprint(secret: str) -> str:
    """A short, stable, non-reversible name for a key or request id (16 hex digits of SHA-256)."""
    return hashlib.sha256(secret.encode()).hexdigest()[:16]


def keys_from_env(name: str) -> list[str]:
    """Comma-separated keys from environment variable ``name`` (empty entries dropped)."""
    return [k.strip() for k in os.environ.get(name, "").split(",") if k.strip()]


class APIKeys:
    """Which bearer tokens may call which routes, and the prefix-cache salt of each caller.

    keys, admin_keys: accepted keys (no keys at all: the API is open). prefix_cache_isolation:
    "api-key" salts each key's prefix cache, "none" shares it; None picks "api-key" when keys are set.
    Raises ValueError for an unknown isolation mode, an empty key or one with surrounding whitespace.
    """

    def __init__(self, keys=(), admin_keys=(), prefix_cache_isolation: str | None = None):
        self._keys = [k.encode() for k in keys]
        self._admin = [k.encode() for k in admin_keys]
        if any(not k for k in self._keys + self._admin):
            raise ValueError("--api-key: keys must not be empty")
        if any(k != k.strip() for k in self._keys + self._admin):  # a presented token is stripped: it could never match
            raise ValueError("--api-key: keys must not begin or end with whitespace")
        if prefix_cache_isolation is None:
            prefix_cache_isolation = "api-key" if self.enabled else "none"
        if prefix_cache_isolation not in ("none", "api-key"):
            raise ValueError(f"--prefix-cache-isolation: must be none or api-key, got {prefix_cache_isolation!r}")
        self.prefix_cache_isolation = prefix_cache_isolation

    @property
    def enabled(self) -> bool:
        return bool(self._keys or self._admin)

    def check(self, authorization: str | None, admin_route: bool) -> str | None:
        """The caller's key fingerprint (None when the route needs no key).

        admin_route: ``/kv_cache``, which takes the admin keys when any are set.
        Raises PermissionError with OpenAI's message when the header is missing or the key is wrong.
        """
        allowed = self._admin if admin_route and self._admin else self._keys + self._admin
        if not allowed:
            return None
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise PermissionError("You didn't provide an API key. You need to provide your API key in an "
                                  "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
        given = token.strip().encode()
        match = False
        for key in allowed:  # compare with every key, in constant time each: no early exit to time
            match |= hmac.compare_digest(given, key)
        if not match:
            if admin_route and any(hmac.compare_digest(given, key) for key in self._keys):
                raise PermissionError("Incorrect API key provided: /kv_cache takes an admin key (--admin-api-key).")
            raise PermissionError("Incorrect API key provided.")
        return fingerprint(given.decode())

    def cache_salt(self, tenant: str | None, cache_salt: str | None) -> str | None:
        """The salt a request's blocks are hashed with: the tenant's fingerprint first when isolated.

        The fingerprint has a fixed length, so no user salt can spell another tenant's prefix.
        """
        if self.prefix_cache_isolation == "none" or tenant is None or cache_salt == "":
            return cache_salt  # "" is refused (Engine), as it is without keys: not turned into the tenant's bare salt
        return f"{tenant}:{cache_salt or ''}"
