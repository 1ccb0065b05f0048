"""A reload that touches `[routing.token_mode]` keeps the tokenizers it does not change.

Review finding: every model's tokenizer was loaded again, on the event loop, for any edit of the
section (`offload_bytes` too): three 128k-vocabulary tokenizers held every stream and probe for
2.5 s, and each lost its warm prefix-ids cache.
"""

from __future__ import annotations

from gateway.config import TokenModeSettings
from gateway.keying import load_keyers
from tests.gateway.conftest import MODEL, run_gateway, settings_for


def test_unchanged_models_keep_their_keyer_and_changed_ones_load() -> None:
    was = TokenModeSettings(models={"a": "sim", "b": "sim"})
    running = load_keyers(was)
    now = TokenModeSettings(models={"a": "sim", "b": "sim", "c": "sim"}, offload_bytes=1)
    keyers = load_keyers(now, running, was)
    assert keyers["a"] is running["a"] and keyers["b"] is running["b"]
    assert set(keyers) == {"a", "b", "c"}
    # Another cache size: every keyer is built again with it; a model gone is gone.
    bigger = TokenModeSettings(models={"a": "sim"}, cache_tokens=4096)
    again = load_keyers(bigger, keyers, now)
    assert set(again) == {"a"} and again["a"] is not keyers["a"]
    # No running keyers (the start): all load.
    assert load_keyers(was)["a"] is not running["a"]


async def test_a_reload_of_offload_bytes_keeps_the_running_tokenizers() -> None:
    s = settings_for([], routing={"token_mode": {"models": {MODEL: "sim"}}})
    async with run_gateway(s) as g:
        before = g.gw.token_keyers[MODEL]
        tm = s.routing.token_mode.model_copy(update={"offload_bytes": 1})
        new = s.model_copy(update={"routing": s.routing.model_copy(update={"token_mode": tm})})
        g.gw.apply(new)
        assert g.gw.settings.routing.token_mode.offload_bytes == 1
        assert g.gw.token_keyers[MODEL] is before
