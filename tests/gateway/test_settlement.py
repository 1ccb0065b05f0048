"""What a request costs (gateway.settlement.charge): the rules the settlement applies, directly;
the end-to-end suites (tests/quota, tests/faults) check that the walk applies them once."""

from __future__ import annotations

import pytest

from gateway.call import Account, Call, Usage
from gateway.config import TenantSettings
from gateway.quota import TenantLimits
from gateway.quota_gate import Ticket
from gateway.settlement import charge, usage_record
from gateway.tenancy import Tenant
from scoring.views import RouteRequest


def account(discount: float = 0.0, reserved: int | None = 900) -> Account:
    tenant = Tenant("t", TenantSettings(cached_token_discount=discount), TenantLimits(), "salt", "")
    ticket = None if reserved is None else Ticket(tenant, "r1", "m", reserved, None, None)
    return Account(tenant, ticket, prompt_estimate=100, tokens=500)


def call(*, stream: bool = True, **kw: object) -> Call:
    c = Call("r1", "m", "/v1/chat/completions", b"{}", stream, False, RouteRequest("m"))
    for k, v in kw.items():
        setattr(c, k, v)
    return c


def test_reported_usage_is_charged_with_the_tenants_cached_discount() -> None:
    u = Usage(prompt_tokens=1000, completion_tokens=50, cached_tokens=800)
    assert charge(account(), call(usage=u, events=60)) == 1050
    assert charge(account(discount=0.5), call(usage=u, events=60)) == 1050 - 400


def test_a_stream_broken_before_its_usage_pays_prompt_plus_streamed_tokens() -> None:
    # 12 events: the role event and the [DONE] are not tokens.
    assert charge(account(), call(events=12, outcome="upstream_broken")) == 100 + 10
    assert charge(account(), call(events=1, outcome="client_disconnect")) == 100


def test_a_stream_abandoned_before_its_first_token_pays_its_prompt() -> None:
    # The worker had the prompt (the walk settles only then): its prefill was spent.
    assert charge(account(), call(events=0, outcome="client_disconnect")) == 100


def test_a_whole_response_cut_off_mid_generation_pays_its_reservation() -> None:
    for outcome in ("upstream_timeout", "client_disconnect"):
        assert charge(account(), call(stream=False, outcome=outcome)) == 900
        assert charge(account(reserved=None), call(stream=False, outcome=outcome)) == 500


def test_nothing_generated_is_not_charged() -> None:
    assert charge(account(), call(events=0, outcome="upstream_4xx", status=400)) is None
    assert charge(account(), call(stream=False, outcome="upstream_4xx", status=400)) is None


def test_the_usage_record_names_tenant_request_and_charge() -> None:
    u = Usage(prompt_tokens=10, completion_tokens=5, cached_tokens=0)
    rec = usage_record(account(), call(usage=u, worker="w1", status=200, outcome="ok"), 15)
    assert {k: rec[k] for k in ("request_id", "tenant", "worker", "charged_tokens")} == {
        "request_id": "r1",
        "tenant": "t",
        "worker": "w1",
        "charged_tokens": 15,
    }
    assert rec["prompt_tokens"] == 10 and rec["completion_tokens"] == 5


@pytest.mark.parametrize("count", [1e308, 2.0**41, 1 << 41, -1, "9", [9]])
def test_a_usage_count_no_request_has_is_no_usage(count: object) -> None:
    # Review finding: 1e308 was taken whole; charging it overflowed a metric's float after the
    # ticket was closed and leaked the tenant's lease. Such a usage is charged as a missing one.
    assert Usage.from_json({"prompt_tokens": 3, "completion_tokens": count}) is None
    assert Usage.from_json({"prompt_tokens": 3, "completion_tokens": 2.0}) == Usage(3, 2, 0)


def test_a_worker_count_past_what_the_request_holds_is_charged_at_its_bound(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Review finding: a worker reporting prompt_tokens 10**12 for a 5-token prompt was charged
    # whole, and its tenant (100k tokens a minute) refused for 19 years. The prompt is believed
    # up to 32x the estimate (100) plus 4,096; the completion up to the output limit sent (400).
    huge = Usage(prompt_tokens=10**12, completion_tokens=50, cached_tokens=0)
    assert charge(account(), call(usage=huge, worker="w1")) == 100 * 32 + 4096 + 50
    assert "w1" in caplog.text and "more than the request can hold" in caplog.text
    long = Usage(prompt_tokens=90, completion_tokens=10**9, cached_tokens=90)
    assert charge(account(), call(usage=long)) == 90 + 400
    assert charge(account(discount=1.0), call(usage=long)) == 400  # the cached 90 discounted
    # A stream cut with a live usage past the bounds: the same bounds.
    live = b'{"prompt_tokens": 1000000000000, "completion_tokens": 1000000000000}'
    cut = call(events=5, outcome="upstream_broken", live_usage=live)
    assert charge(account(), cut) == 100 * 32 + 4096 + 400
    # Within the bounds nothing changes: 4x an estimate's error and more is believed.
    fine = Usage(prompt_tokens=7000, completion_tokens=400, cached_tokens=0)
    assert charge(account(), call(usage=fine)) == 7400


def test_an_unknown_output_limit_leaves_the_completion_count_as_reported() -> None:
    # An open gateway's request without max_tokens: vLLM's default (the rest of the context)
    # is unknown here, so only the prompt is bounded.
    acct = account()
    acct.tokens = acct.prompt_estimate
    u = Usage(prompt_tokens=100, completion_tokens=30_000, cached_tokens=0)
    assert charge(acct, call(usage=u)) == 30_100
