"""Live reconfiguration applies whole, to every component, and only what changed.

Operator-surface review findings, each a test that failed before its fix:
- a reload of anything (one routing weight) reset the fleet to the file's [[workers]], dropping
  workers added through /admin/workers and bringing back ones removed there;
- a tokenizer that exists but does not load was half-applied: every other section changed, the
  reload counted as a success, and the file, fixed in place, was never loaded again;
- a removed worker's series stayed on /metrics (queue delay, probes) or came back when a request
  still running on it ended;
- an admin key pasted in place of its digest loaded (and locked the operator out), a non-ASCII
  one made every admin endpoint a 500;
- under a stateless policy a removed or re-pointed worker kept its prefix-cache credit and
  session pins in the shared routing state, which kv_aware then trusted;
- `timeouts.connect_s`, `cluster.share_learned` and `autoscale.slot_s` reloads changed nothing
  and said nothing.
"""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path

import httpx
import pytest

from gateway.app import Gateway
from gateway.config import ConfigError, load_settings
from scoring.views import RouteRequest
from tests.gateway.conftest import MODEL, run_gateway, settings_for, until
from tests.gateway.test_token_mode_e2e import rebuild_tokenizer

ADMIN = "admin-secret"
AUTH = {"authorization": f"Bearer {ADMIN}"}
ADMIN_SHA = hashlib.sha256(ADMIN.encode()).hexdigest()


def cfg_text(url: str, prefix_weight: float, tokenizer: Path | None = None) -> str:
    text = (
        '[logging]\nlevel = "warning"\n[probes]\ninterval_s = 0.2\n'
        f'[admin]\nkey_sha256 = "{ADMIN_SHA}"\n'
        f"[routing.weights]\nprefix = {prefix_weight}\n"
    )
    if tokenizer is not None:
        text += f'[routing.token_mode.models]\n"{MODEL}" = "{tokenizer}"\n'
    return text + f'[[workers]]\nname = "w0"\nurl = "{url}"\n'


async def test_a_weight_reload_keeps_the_fleet_the_admin_api_made(sims, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    a, b = sims(1), sims(1)
    cfg = tmp_path / "kvgate.toml"
    cfg.write_text(cfg_text(a.urls[0], 1.0))
    async with run_gateway(load_settings(cfg), cfg) as g, httpx.AsyncClient(timeout=10) as c:
        await g.wait_healthy(1)
        r = await c.post(
            g.url + "/admin/workers", json={"name": "w-admin", "url": b.urls[0]}, headers=AUTH
        )
        assert r.status_code == 201, r.text
        cfg.write_text(cfg_text(a.urls[0], 2.0))
        assert (await c.post(g.url + "/admin/reload", headers=AUTH)).status_code == 200
        assert g.gw.settings.routing.weights.prefix == 2.0
        assert sorted(g.gw.registry.workers) == ["w-admin", "w0"]
        # A change to [[workers]] itself: the file sets the fleet again.
        cfg.write_text(cfg_text(b.urls[0], 2.0))
        assert (await c.post(g.url + "/admin/reload", headers=AUTH)).status_code == 200
        assert sorted(g.gw.registry.workers) == ["w0"]
        assert g.gw.registry.workers["w0"].spec.url == b.urls[0]


async def test_a_tokenizer_that_does_not_load_rejects_the_reload_whole(tmp_path: Path) -> None:
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")  # passes the validator: the file exists
    path = tmp_path / "kvgate.toml"
    path.write_text(cfg_text("http://127.0.0.1:9", 1.0))
    gw = Gateway(load_settings(path), path)
    await gw.start()
    try:
        assert gw.watcher is not None
        path.write_text(cfg_text("http://127.0.0.1:9", 2.0, tok))
        assert not gw.watcher.reload()
        assert gw.metrics.config_reload_errors._value.get() == 1
        assert gw.settings.routing.weights.prefix == 1.0  # nothing of it applied
        assert MODEL not in gw.token_keyers
        rebuild_tokenizer(tok)  # fixed in place; the file itself unchanged
        assert gw.watcher.reload()
        assert MODEL in gw.token_keyers and gw.settings.routing.weights.prefix == 2.0
    finally:
        await gw.stop()


async def test_a_removed_worker_leaves_no_series_behind(sims) -> None:  # type: ignore[no-untyped-def]
    fast, slow = sims(1), sims(1, "--time-scale", "30")
    s = settings_for(fast.urls + slow.urls, admin={"key_sha256": ADMIN_SHA})
    body = {
        "model": MODEL,
        "max_tokens": 60,
        "stream": True,
        "messages": [{"role": "user", "content": "hello there"}],
    }
    async with run_gateway(s) as g, httpx.AsyncClient(timeout=30) as c:
        await g.wait_healthy(2)
        assert (await c.post(g.url + "/admin/workers/w0/drain", headers=AUTH)).status_code == 200
        async with c.stream("POST", g.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200 and resp.headers["x-kvgate-worker"] == "w1"
            chunks = resp.aiter_bytes()
            await chunks.__anext__()  # running on w1
            assert (await c.delete(g.url + "/admin/workers/w1", headers=AUTH)).status_code == 200
            async for _ in chunks:  # it ends on the removed worker
                pass
        await until(lambda: g.gw._in_flight() == 0, 10, "stream released")
        text = (await c.get(g.url + "/metrics")).text
    ghosts = [
        line.split(" ")[0]
        for line in text.splitlines()
        if 'worker="w1"' in line and not line.startswith(("#", "kvgate_requests"))
    ]
    assert ghosts == []


def test_the_admin_key_must_be_a_digest(tmp_path: Path) -> None:
    cfg = tmp_path / "k.toml"
    for bad in ("my-admin-password", "é" * 64):
        cfg.write_text(f'[admin]\nkey_sha256 = "{bad}"\n')
        with pytest.raises(ConfigError, match="64 hex digits"):
            load_settings(cfg)
    cfg.write_text(f'[admin]\nkey_sha256 = "{ADMIN_SHA.upper()}"\n')
    assert load_settings(cfg).admin.key_sha256 == ADMIN_SHA


def test_a_worker_re_pointed_under_a_stateless_policy_is_forgotten() -> None:
    old_url, new_url = "http://127.0.0.1:9", "http://127.0.0.1:10"
    gw = Gateway(settings_for([old_url]))
    chain = (11, 22, 33, 44)
    route = RouteRequest(model=MODEL, chain=chain, dense_blocks=4, session_id="s1")
    gw.policy.on_dispatch("w0", route)
    assert gw.routing_state.index.match(chain).get("w0") == 4
    gw.apply(settings_for([old_url], routing={"policy": "round_robin"}))
    gw.apply(settings_for([new_url], routing={"policy": "round_robin"}))  # a new server
    gw.apply(settings_for([new_url], routing={"policy": "kv_aware"}))
    assert gw.routing_state.index.match(chain).get("w0", 0) == 0
    assert gw.routing_state.sessions.lookup("s1", time.monotonic()) is None


async def test_connect_s_applies_live() -> None:
    gw = Gateway(settings_for([], timeouts={"connect_s": 2.0}))
    await gw.start()
    try:
        gw.apply(settings_for([], timeouts={"connect_s": 0.25}))
        assert gw.upstream.connect_s == 0.25  # type: ignore[attr-defined]
        assert gw.prober is not None and gw.prober.connect_s == 0.25
    finally:
        await gw.stop()


def test_share_learned_says_it_needs_a_restart(caplog: pytest.LogCaptureFixture) -> None:
    gw = Gateway(settings_for([], cluster={"enabled": True, "share_learned": True}))
    caplog.set_level(logging.WARNING)
    gw.apply(settings_for([], cluster={"enabled": True, "share_learned": False}))
    assert any("share_learned" in r.getMessage() for r in caplog.records)


def test_a_new_autoscale_slot_width_reaches_models_already_seen() -> None:
    gw = Gateway(settings_for([], autoscale={"slot_s": 1.0}))
    gw.autoscale.observe_ttft(MODEL, 0.1)
    gw.apply(settings_for([], autoscale={"slot_s": 5.0}))
    st = gw.autoscale._models[MODEL]
    assert st.ttft.slot_s == 5.0 and st.wait.slot_s == 5.0
