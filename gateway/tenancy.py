"""Tenants at request time: who is calling, what they may ask for, and how their cache is fenced.

Keys are looked up by their sha256 (the config never holds a key); the comparison is a dict
lookup on a digest, which leaks nothing useful by timing. Caps are enforced before any quota is
taken, so a request that could never be served costs the tenant nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.config import Settings, TenantSettings
from gateway.errors import APIError, bad_request, model_not_found
from gateway.quota import DEFAULT_LEASE_TTL_S, ModelLimits, TenantLimits
from scoring.chat_inputs import rendered_bytes, utf8_len

_NO_MEDIA: Mapping[str, int] = {}

ANONYMOUS = "anonymous"

log = logging.getLogger("kvgate.tenancy")


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    cfg: TenantSettings
    limits: TenantLimits
    cache_salt: str  # sent upstream when the tenant is isolated
    namespace: str  # seeds the prefix chain: "" = shared with every non-isolated tenant
    # HMAC key this tenant's own `cache_salt` values are mapped under (`client_salt`).
    client_salt_key: bytes = b""
    # Scopes its session ids (`gateway.keying.route_key(session_scope=)`): the tenant's name, so
    # no tenant, shared or isolated, reaches another's sessions; "" for the open gateway's one
    # tenant, whose ids are kept as sent.
    session_scope: str = ""

    @property
    def priority(self) -> float:
        return self.cfg.priority

    def client_salt(self, salt: str) -> str:
        """The `cache_salt` forwarded for this tenant's own `salt`: never the client's value raw.

        Raw, a shared tenant could send any salt, including one the gateway derived for an
        isolated tenant (computable by whoever learns the secret), and share that tenant's vLLM
        prefix cache. Mapped under a key of this tenant's own (`_client_salt_key`), a client salt
        can equal neither an isolated tenant's salt (made under the secret itself, from an input
        no client chooses) nor another tenant's mapped salt (another key), whatever the client
        knows: hitting one would take a 128-bit HMAC preimage. Equal salts of one tenant
        still map equally on every replica, so the tenant keeps separating its own requests (and
        reusing each salt's cache) as vLLM intends.
        """
        msg = salt.encode("utf-8", "surrogatepass")
        return hmac.digest(self.client_salt_key, msg, "sha256")[:16].hex()


def _fence_media_uuids(tenant: Tenant, messages: list[Any]) -> bool:
    """Map every media part's `uuid` under the tenant's own key (as `client_salt` maps salts);
    True when one was.

    vLLM keys its multimodal processor and encoder caches by a part's `uuid` when the client
    gives one, `cache_salt` aside, and serves a part that has a uuid and no data from them: raw,
    a tenant knowing another's uuid drew that tenant's image into its own prompt, learned from
    200 or 400 whether it was sent, or planted its own image under it. Mapped, uuids of one
    tenant still match each other (its own reuse), and never another tenant's."""
    changed = False
    for m in messages:
        content = m.get("content") if type(m) is dict else None
        if type(content) is not list:
            continue
        for part in content:
            if type(part) is dict and type(uid := part.get("uuid")) is str:
                part["uuid"] = tenant.client_salt("\x00uuid:" + uid)
                changed = True
    return changed


def _limits(t: TenantSettings, lease_ttl_s: float = DEFAULT_LEASE_TTL_S) -> TenantLimits:
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
        lease_ttl_s=lease_ttl_s,
    )


def _salt(secret: bytes, name: str) -> str:
    """An isolated tenant's `cache_salt`: one HMAC input domain (`kvgate-cache-salt:`) that no
    client input reaches (`Tenant.client_salt` uses its own)."""
    return hmac.new(secret, b"kvgate-cache-salt:" + name.encode(), hashlib.sha256).hexdigest()[:32]


def _client_salt_key(secret: bytes, name: str) -> bytes:
    """The key a tenant's own salts are mapped under (`Tenant.client_salt`): per tenant, so two
    tenants' equal salts differ, and from a domain of its own (`kvgate-client-salt-key:`)."""
    return hmac.digest(secret, b"kvgate-client-salt-key:" + name.encode(), "sha256")


def salt_secret(settings: Settings) -> bytes:
    """`tenancy.cache_salt_secret`, or without one a secret derived from what the config holds
    and clients should not: the admin key's hash and every tenant key's hash.

    Derived, it is the same on every replica of one config (salts, hence each tenant's cached
    prefixes, survive restarts and are shared across replicas), but it changes when keys do, and
    a client holding every tenant key (the only keyed tenant beside a keyless one) learns it
    unless an admin key is set. Since no client salt is forwarded raw (`Tenant.client_salt`),
    knowing it no longer lets a client reach another tenant's cache through the gateway; the
    explicit secret still belongs in production (`Tenants` warns without it).
    """
    explicit = settings.tenancy.cache_salt_secret
    if explicit:
        return explicit.encode()
    keys = sorted(k for t in settings.tenants.values() for k in t.keys_sha256)
    material = [b"kvgate-derived-salt-secret", settings.admin.key_sha256.encode()]
    return hashlib.sha256(b"\x00".join([*material, *(k.encode() for k in keys)])).digest()


# What may separate "Bearer" from its key, and pad the value: RFC 7230's OWS and RFC 7235's
# 1*SP, taken generously (a tab passes), and nothing else (`str.split()` would take U+00A0 too).
_OWS = " \t"


def bearer_key(authorization: str | None) -> str:
    """The key of an ``Authorization: Bearer <key>`` header ("" if none, or not a usable Bearer
    credential): the one parse, for tenant and admin keys alike (the admin check kept the
    spaces the tenant one strips, so ``Bearer  <key>`` worked for a tenant and was a 401 for
    the admin; a tab after ``Bearer`` was no credential at all, and served as anonymous)."""
    if not authorization:
        return ""
    if authorization.startswith("Bearer "):  # what nearly every client sends: one slice
        return authorization[7:].strip(_OWS)
    value = authorization.strip(_OWS)
    sep = value[6:7]
    if (sep != " " and sep != "\t") or value[:6].lower() != "bearer":
        return ""
    return value[7:].lstrip(_OWS)


@dataclass(frozen=True, slots=True)
class Access:
    """Who a config lets in without a key, as far as opening it up goes: whether any tenant is
    configured (without one, everyone is served, keys or not), and the tenant served to callers
    without a key ("" for none)."""

    keyed: bool
    anonymous: str = ""

    @classmethod
    def of(cls, settings: Settings) -> Access:
        return cls(bool(settings.tenants), settings.tenancy.anonymous_tenant or "")

    def opened_by(self, new: Settings) -> str | None:
        """Why `new` would serve callers this access turned away (None when it would not).

        Only a restart may do that: a live reload also takes what a writer left half done (a
        rewrite that has written the workers and not yet the tenants is a valid config), and a
        gateway that silently dropped its authentication on such a file served anyone until the
        rest landed. Closing (tenants added, the anonymous tenant removed) stays live."""
        if not self.keyed:
            return None
        if not new.tenants:
            return "it configures no [tenants], which would serve every request without an API key"
        anon = new.tenancy.anonymous_tenant
        if anon and not self.anonymous:
            return (
                f"it sets tenancy.anonymous_tenant = {anon!r}, which would serve requests "
                "without an API key"
            )
        return None


class Tenants:
    """The tenant table of one config; rebuilt whole on reload."""

    def __init__(self, settings: Settings) -> None:
        self.enabled = bool(settings.tenants)
        secret = salt_secret(settings)
        if not settings.tenancy.cache_salt_secret and any(
            t.isolate_cache for t in settings.tenants.values()
        ):
            log.warning(
                "tenancy.cache_salt_secret is not set: isolated tenants' cache salts are derived "
                "from the configured key hashes, so they change when keys do (and a client "
                "holding every key, with no admin key set, can compute them); set a long random "
                "secret, the same on every replica"
            )
        self.by_name: dict[str, Tenant] = {}
        self._by_key: dict[str, Tenant] = {}
        for name, cfg in settings.tenants.items():
            tenant = Tenant(
                name=name,
                cfg=cfg,
                limits=_limits(cfg, settings.quota.lease_ttl_s),
                cache_salt=_salt(secret, name),
                namespace=f"tenant:{name}" if cfg.isolate_cache else "",
                client_salt_key=_client_salt_key(secret, name),
                session_scope=name,
            )
            self.by_name[name] = tenant
            for k in cfg.keys_sha256:
                self._by_key[k] = tenant
        anon = settings.tenancy.anonymous_tenant
        self.anonymous: Tenant | None = self.by_name.get(anon) if anon else None
        if not self.enabled:
            # Open, single-tenant gateway: everyone is one default tenant with no limits.
            self.anonymous = Tenant(ANONYMOUS, TenantSettings(), TenantLimits(), "", "")
        # The highest priority any caller can have: a priority reserve nobody can use is idle
        # capacity, not headroom (gateway.app._room).
        everyone = [*self.by_name.values(), *([self.anonymous] if self.anonymous else [])]
        self.top_priority = max(t.priority for t in everyone) if everyone else 0.0

    def authenticate(self, authorization: str | None, api_key: str | None = None) -> Tenant:
        """The tenant a request's credentials name: `authorization` and `api_key` are the
        ``Authorization`` and ``x-api-key`` headers' values, None when not sent.

        Credentials that were sent and name no tenant are a 401, never the anonymous tenant: a
        client sending a key expects to be itself or refused, and one whose header the gateway
        could not parse (``Basic``, a bare key, ``Bearer`` alone) was served and billed as
        anonymous, hiding its misconfiguration. ``x-api-key`` (LiteLLM, Anthropic-style
        clients) counts only as the same key ``Authorization`` carries, or alone. An open
        gateway (no tenants) reads neither: a proxy's own ``Basic`` credentials pass through."""
        anonymous = self.anonymous
        if anonymous is not None and not self.enabled:  # the open gateway's one tenant
            return anonymous
        if authorization is not None:
            key = bearer_key(authorization)
            if not key:
                raise _unusable_credentials()
            if api_key is not None and api_key.strip(_OWS) != key:
                raise APIError(
                    401,
                    "The `Authorization` and `x-api-key` headers carry different API keys. "
                    "Send one key, as `Authorization: Bearer <key>`.",
                    "invalid_request_error",
                    code="invalid_api_key",
                )
        elif api_key is not None:
            key = api_key.strip(_OWS)
            if not key:
                raise _unusable_credentials()
        elif anonymous is not None:
            return anonymous
        else:
            raise APIError(
                401,
                "You didn't provide an API key. Send it as `Authorization: Bearer <key>`.",
                "invalid_request_error",
                code="missing_api_key",
            )
        tenant = self._by_key.get(hashlib.sha256(key.encode()).hexdigest())
        if tenant is None:
            raise APIError(
                401,
                "Incorrect API key provided.",
                "invalid_request_error",
                code="invalid_api_key",
            )
        return tenant


def _unusable_credentials() -> APIError:
    """Credentials sent in a shape no key can be read from: refused as a wrong key is (a client
    told `missing_api_key` would look for a header it did send)."""
    return APIError(
        401,
        "The API key could not be read from the request's credentials. "
        "Send it as `Authorization: Bearer <key>`.",
        "invalid_request_error",
        code="invalid_api_key",
    )


def media_bytes(media_tokens: Mapping[str, int], chars_per_token: float) -> dict[str, int]:
    """Per media kind, the bytes of text the estimate charges a part: what `media_tokens` says
    a part costs, in the unit ``rendered_bytes`` counts in."""
    return {k: math.ceil(n * chars_per_token) for k, n in media_tokens.items()}


def estimate_prompt_tokens(
    path_is_chat: bool,
    data: dict[str, Any],
    chars_per_token: float,
    media: Mapping[str, int] = _NO_MEDIA,
) -> int:
    """Cheap upper-ish estimate (no tokenizer), exact for token ids: UTF-8 bytes / chars_per_token,
    as the route key (``scoring.prefix.text_key``) sizes a prompt; counting characters let 8,000
    CJK characters (24 kB, ~8k+ tokens) past a 2,000-token `max_input_tokens`.

    A chat counts every field its template receives (``scoring.chat_inputs.rendered_bytes``, from
    the one list of rendered fields token mode's route key also builds on), and each media part
    what `media` (``media_bytes``) charges its kind: counted as nothing, 50 images passed a
    2,000-token cap on a vision model that expands each into ~1,000 tokens.
    """
    if path_is_chat:
        return int(rendered_bytes(data, media) / chars_per_token) + 1
    # A fill-in-the-middle model renders `suffix` into every prompt of the request.
    suffix = data.get("suffix")
    extra = int(utf8_len(suffix) / chars_per_token) if type(suffix) is str and suffix else 0
    prompt = data.get("prompt")
    if isinstance(prompt, str):
        return int(utf8_len(prompt) / chars_per_token) + 1 + extra
    if isinstance(prompt, list) and prompt:
        if isinstance(prompt[0], int):
            return len(prompt) + extra
        if isinstance(prompt[0], str):
            return sum(int(utf8_len(p) / chars_per_token) + 1 + extra for p in prompt)
        return sum(len(p) + extra for p in prompt)
    return 1 + extra


# The fields a worker may read as the per-choice output limit. vLLM's chat endpoint uses
# `max_completion_tokens or max_tokens`; its completions endpoint reads `max_tokens` only
# (`max_completion_tokens` is an unknown field there, ignored). Caps apply to every one present:
# a field the worker ignores today is harmless to cap, and one left uncapped is a bypass.
OUTPUT_FIELDS = ("max_completion_tokens", "max_tokens")
# vLLM's (and OpenAI's) /v1/completions default when `max_tokens` is absent. An explicit null,
# and a chat request with neither field, mean "the rest of the context" (max_model_len - prompt).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def output_field(is_chat: bool, data: dict[str, Any]) -> str:
    """The field the worker reads its per-choice output limit from, as vLLM does."""
    if is_chat and data.get("max_completion_tokens") is not None:
        return "max_completion_tokens"
    return "max_tokens"


def prompt_count(is_chat: bool, data: dict[str, Any]) -> int:
    """Prompts in one request: a completions `prompt` may be a batch (strings or token lists),
    each generating its own choices."""
    if is_chat:
        return 1
    prompt = data.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        return len(prompt)
    return 1  # a string, or one prompt of token ids


def choices_per_prompt(data: dict[str, Any]) -> int:
    """Sequences the worker generates per prompt: `n`, or `best_of` when larger (vLLM generates
    best_of and returns the n best). Beam search keeps `n` beams (its beam width)."""
    n = data.get("n") or 1
    best_of = data.get("best_of") or 1
    return max(n, best_of) if isinstance(n, int) and isinstance(best_of, int) else 1


def output_tokens(is_chat: bool, data: dict[str, Any]) -> int:
    """Output tokens a request may generate, for a gateway without tenants (nothing is capped or
    injected): choices x prompts x the per-choice limit the worker will apply; 0 when that limit
    is "the rest of the context", which only the worker knows."""
    key = output_field(is_chat, data)
    per_choice = data.get(key)
    if per_choice is None:
        if is_chat or key in data:
            return 0
        per_choice = COMPLETIONS_DEFAULT_MAX_TOKENS
    if not isinstance(per_choice, int):
        return 0
    return per_choice * choices_per_prompt(data) * prompt_count(is_chat, data)


def apply_caps(
    tenant: Tenant, model: str, data: dict[str, Any], prompt_tokens: int, *, is_chat: bool
) -> tuple[int, bool]:
    """Check the model allowlist, input, choice and output caps; cap or inject the output limit
    in `data` so that what the worker generates is what the tenant is charged for.

    Every output-limit field present is capped (or refused, `over_max_output = "reject"`); when
    the field the worker reads is absent the tenant's `default_max_tokens` (within the cap) is
    injected as `max_tokens`, which both endpoints read, so no request runs to "the rest of the
    context" unreserved. Returns (output tokens to reserve: per-choice limit x choices x prompts,
    whether `data` changed). Raises the OpenAI error before any quota is taken.
    """
    cfg = tenant.cfg
    if cfg.models and model not in cfg.models:
        # Same answer as an unknown model: do not reveal that it exists.
        raise model_not_found(model)
    if cfg.max_input_tokens is not None and prompt_tokens > cfg.max_input_tokens:
        raise bad_request(
            f"This request's prompt is about {prompt_tokens} tokens; the limit for your key is "
            f"{cfg.max_input_tokens} input tokens.",
            "messages" if is_chat else "prompt",
        )
    choices = choices_per_prompt(data)
    if choices > cfg.max_n:
        key = "best_of" if (data.get("best_of") or 0) > (data.get("n") or 1) else "n"
        raise bad_request(
            f"`{key}` is {choices}; the limit for your key is {cfg.max_n} choices per prompt.",
            key,
        )
    changed = False
    cap = cfg.max_output_tokens
    if cap is not None:
        for key in OUTPUT_FIELDS:
            asked = data.get(key)
            if asked is not None and asked > cap:
                if cfg.over_max_output == "reject":
                    raise bad_request(
                        f"`{key}` is {asked}; the limit for your key is {cap} output tokens.", key
                    )
                data[key] = cap
                changed = True
    key = output_field(is_chat, data)
    out = data.get(key)
    if out is None:
        out = cfg.default_max_tokens if cap is None else min(cfg.default_max_tokens, cap)
        data["max_tokens"] = out  # on chat, `max_completion_tokens` is absent here
        changed = True
    if is_chat and _fence_media_uuids(tenant, data["messages"]):
        changed = True
    if tenant.cfg.isolate_cache:
        data["cache_salt"] = tenant.cache_salt
        changed = True
    elif type(salt := data.get("cache_salt")) is str and salt:
        # Never forwarded raw (Tenant.client_salt); parse_request already refused a salt vLLM
        # would refuse, which mapping would otherwise make valid.
        data["cache_salt"] = tenant.client_salt(salt)
        changed = True
    return int(out) * choices * prompt_count(is_chat, data), changed
