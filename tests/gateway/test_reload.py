"""Live reload of tenants and fleet through the config file (no restart)."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import httpx

from gateway.config import load_settings
from tests.gateway.conftest import MODEL, run_gateway


def cfg_text(urls: list[str], keys: list[str]) -> str:
    hashes = ", ".join(f'"{hashlib.sha256(k.encode()).hexdigest()}"' for k in keys)
    workers = "".join(f'[[workers]]\nname = "w{i}"\nurl = "{u}"\n' for i, u in enumerate(urls))
    return (
        '[logging]\nlevel = "warning"\n[probes]\ninterval_s = 0.2\n'
        f"[tenants.t]\nkeys_sha256 = [{hashes}]\n{workers}"
    )


async def test_key_rotation_and_fleet_changes_apply_live(sims, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    a, b = sims(1), sims(1)
    cfg = tmp_path / "kvgate.toml"
    cfg.write_text(cfg_text(a.urls, ["old-key"]))
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}

    async def call(g, key: str) -> httpx.Response:  # type: ignore[no-untyped-def]
        async with httpx.AsyncClient(timeout=10) as c:
            return await c.post(
                g.url + "/v1/chat/completions",
                json=body,
                headers={"authorization": f"Bearer {key}"},
            )

    async with run_gateway(load_settings(cfg), cfg) as g:
        await g.wait_healthy(1)
        assert (await call(g, "old-key")).status_code == 200
        cfg.write_text(cfg_text(a.urls + b.urls, ["new-key"]))
        for _ in range(50):
            if len(g.gw.registry.workers) == 2:
                break
            await asyncio.sleep(0.1)
        assert (await call(g, "old-key")).status_code == 401
        assert (await call(g, "new-key")).status_code == 200
        await g.wait_healthy(2)
        cfg.write_text(cfg_text(b.urls, ["new-key"]))
        for _ in range(50):
            if (
                set(g.gw.registry.workers) == {"w0"}
                and g.gw.registry.workers["w0"].url == b.urls[0]
            ):
                break
            await asyncio.sleep(0.1)
        await g.wait_healthy(1)
        r = await call(g, "new-key")
        assert r.status_code == 200 and r.headers["x-kvgate-worker"] == "w0"
