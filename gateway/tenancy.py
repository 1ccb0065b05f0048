"""Tenants at request time: who is calling, what they may ask for, and how their cache is fenced.

Keys are looked up by their sha256 (the config never holds a key); the comparison is a dict
lookup on a digest, which leaks nothing useful by timing. Caps are enforced before any quota is
taken, so a request that could never be served costs the tenant nothing.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Any

from gateway.config import Settings, TenantSettings
from gateway.errors import APIError, bad_request, model_not_found
from gateway.quota import ModelLimits, TenantLimits

ANONYMOUS = "anonymous"


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    cfg: TenantSettings
    limits: TenantLimits
    cache_salt: str  # sent upstream when the tenant is isolated
    namespace: str  # seeds the prefix chain: "" = shared with every non-isolated tenant

    @property
    def priority(self) -> float:
        return self.cfg.priority


def _limits(t: TenantSettings) -> TenantLimits:
    return TenantLimits(
        rpm=t.rpm,
        tpm=t.tpm,
        burst_requests=t.burst_requests,
        burst_tokens=t.burst_tokens,
        max_concurrent=t.max_concurrent,
        per_model={
            m: ModelLimits(
                rpm=q.rpm, tpm=q.tpm, burst_requests=q.burst_requests, burst_tokens=q.burst_tokens
            )
            for m, q in t.model_limits.items()
        },
    )


def _salt(secret: bytes, name: str) -> str:
    return hmac.new(secret, b"kvgate-cache-salt:" + name.encode(), hashlib.sha256).hexdigest()[:32]


class Tenants:
    """The tenant table of one config; rebuilt whole on reload."""

    def __init__(self, settings: Settings) -> None:
        self.enabled = bool(settings.tenants)
        secret = settings.tenancy.cache_salt_secret.encode()
        if not secret:
            # Without an explicit secret, derive one from every key hash: unknown to any client
            # (each knows only its own key), stable until keys change.
            secret = "".join(
                sorted(k for t in settings.tenants.values() for k in t.keys_sha256)
            ).encode()
        self.by_name: dict[str, Tenant] = {}
        self._by_key: dict[str, Tenant] = {}
        for name, cfg in settings.tenants.items():
            tenant = Tenant(
                name=name,
                cfg=cfg,
                limits=_limits(cfg),
                cache_salt=_salt(secret, name),
                namespace=f"tenant:{name}" if cfg.isolate_cache else "",
            )
            self.by_name[name] = tenant
            for k in cfg.keys_sha256:
                self._by_key[k] = tenant
        anon = settings.tenancy.anonymous_tenant
        self.anonymous: Tenant | None = self.by_name.get(anon) if anon else None
        if not self.enabled:
            # Open, single-tenant gateway: everyone is one default tenant with no limits.
            self.anonymous = Tenant(ANONYMOUS, TenantSettings(), TenantLimits(), "", "")

    def authenticate(self, authorization: str | None) -> Tenant:
        key = ""
        if authorization:
            scheme, _, rest = authorization.partition(" ")
            if scheme.lower() == "bearer":
                key = rest.strip()
        if key and self.enabled:
            tenant = self._by_key.get(hashlib.sha256(key.encode()).hexdigest())
            if tenant is None:
                raise APIError(
                    401,
                    "Incorrect API key provided.",
                    "invalid_request_error",
                    code="invalid_api_key",
                )
            return tenant
        if self.anonymous is not None:
            return self.anonymous
        raise APIError(
            401,
            "You didn't provide an API key. Send it as `Authorization: Bearer <key>`.",
            "invalid_request_error",
            code="missing_api_key",
        )


def estimate_prompt_tokens(path_is_chat: bool, data: dict[str, Any], chars_per_token: float) -> int:
    """Cheap upper-ish estimate (no tokenizer): chars / chars_per_token, exact for token ids."""
    if path_is_chat:
        n = 0
        for m in data.get("messages") or ():
            c = m.get("content") if isinstance(m, dict) else None
            if isinstance(c, str):
                n += len(c)
            elif isinstance(c, list):
                for part in c:
                    if isinstance(part, dict) and isinstance(part.get("text"), str):
                        n += len(part["text"])
            n += 8  # role markers of the chat template
        if data.get("tools"):
            n += len(str(data["tools"]))
        return int(n / chars_per_token) + 1
    prompt = data.get("prompt")
    if isinstance(prompt, str):
        return int(len(prompt) / chars_per_token) + 1
    if isinstance(prompt, list) and prompt:
        if isinstance(prompt[0], int):
            return len(prompt)
        if isinstance(prompt[0], str):
            return sum(int(len(p) / chars_per_token) + 1 for p in prompt)
        return sum(len(p) for p in prompt)
    return 1


def apply_caps(
    tenant: Tenant, model: str, data: dict[str, Any], prompt_tokens: int
) -> tuple[int, bool]:
    """Check the model allowlist and token caps; inject/cap max_tokens in `data`.

    Returns (max output tokens reserved, whether `data` changed). Raises the OpenAI error.
    """
    cfg = tenant.cfg
    if cfg.models and model not in cfg.models:
        # Same answer as an unknown model: do not reveal that it exists.
        raise model_not_found(model)
    if cfg.max_input_tokens is not None and prompt_tokens > cfg.max_input_tokens:
        raise bad_request(
            f"This request's prompt is about {prompt_tokens} tokens; the limit for your key is "
            f"{cfg.max_input_tokens} input tokens.",
            "messages" if "messages" in data else "prompt",
        )
    changed = False
    key = "max_completion_tokens" if data.get("max_completion_tokens") is not None else "max_tokens"
    asked = data.get(key)
    if asked is None:
        out = cfg.default_max_tokens
        if cfg.max_output_tokens is not None:
            out = min(out, cfg.max_output_tokens)
        data["max_tokens"] = out
        changed = True
    else:
        out = int(asked)
        if cfg.max_output_tokens is not None and out > cfg.max_output_tokens:
            if cfg.over_max_output == "reject":
                raise bad_request(
                    f"`{key}` is {out}; the limit for your key is {cfg.max_output_tokens}.", key
                )
            out = cfg.max_output_tokens
            data[key] = out
            changed = True
    if tenant.cfg.isolate_cache:
        data["cache_salt"] = tenant.cache_salt
        changed = True
    return out, changed
