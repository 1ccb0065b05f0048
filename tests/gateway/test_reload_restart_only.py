"""A reload leaves what it cannot change as it runs, and `--host`/`--port` survive reloads.

Review findings: a reload that changed [server] logged "takes effect after a restart" but
installed the new section, so its body limit, headers and drain grace applied at once, and with
`--processes` a restarted child (which runs the start's values) disagreed with its siblings: the
same request got 200 or 413 by process. And `--port` was applied to the first load only, so every
reload read a [server] without it and warned that [server] had changed.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway import cli
from gateway.config import load_settings
from tests.gateway.conftest import (
    MODEL,
    chat_completion,
    run_gateway,
    serve_app,
    settings_for,
    stub_app,
)


async def _ok(request: Request) -> Response:
    return JSONResponse(chat_completion())


async def test_a_reload_keeps_the_running_restart_only_sections(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with serve_app(stub_app(_ok)) as url:
        s = settings_for([url])
        async with run_gateway(s) as g, httpx.AsyncClient(timeout=30) as c:
            await g.wait_healthy(1)
            new = s.model_copy(
                update={
                    "server": s.server.model_copy(update={"max_body_bytes": 1024}),
                    "probes": s.probes.model_copy(update={"interval_s": 3.0}),
                }
            )
            g.gw.apply(new)
            assert "[server] changed: takes effect after a restart" in caplog.text
            assert g.gw.settings.server == s.server  # as it runs
            assert g.gw.settings.probes.interval_s == 3.0  # the rest applies
            body = {
                "model": MODEL,
                "max_tokens": 1,
                "messages": [{"role": "user", "content": "x" * 4000}],
            }
            r = await c.post(g.url + "/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text


def test_host_and_port_flags_reach_every_load_of_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf = tmp_path / "kvgate.toml"
    conf.write_text("[server]\nport = 8000\n")
    for key in ("HOST", "PORT"):  # restored (removed) after the test, whatever serve sets
        monkeypatch.setenv(f"KVGATE_SERVER__{key}", "unset")
        monkeypatch.delenv(f"KVGATE_SERVER__{key}")
    loads: list[Any] = []

    class _Stop(Exception):
        pass

    def load(path: str) -> Any:
        loads.append(load_settings(path))
        raise _Stop

    monkeypatch.setattr(cli, "_load", load)
    args = argparse.Namespace(child=None, config=str(conf), host="127.0.0.2", port=9123)
    with pytest.raises(_Stop):
        cli.cmd_serve(args)
    reloaded = load_settings(str(conf))  # what the config watcher reads on a reload
    for s in (*loads, reloaded):
        assert (s.server.host, s.server.port) == ("127.0.0.2", 9123)
