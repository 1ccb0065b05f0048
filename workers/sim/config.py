"""The configuration of one simulated worker, and the vLLM version it impersonates.

The CLI and the test harness build one `SimWorkerConfig` per port before any worker exists, and
the worker, its HTTP app and the serving code all read it, so it lives apart from each of them.
`VLLM_VERSION` is here because the worker's fingerprint and `/version` must both name the release
whose wire format the simulator copies (`tests/fixtures/vllm-0.32/`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.sim.engine_types import EngineConfig
from workers.sim.faults import Faults
from workers.sim.profiles import TimingProfile

__all__ = ["VLLM_VERSION", "SimWorkerConfig"]

VLLM_VERSION = "0.32.0"


@dataclass(slots=True)
class SimWorkerConfig:
    """Everything one simulated worker needs; the CLI builds one per port."""

    name: str = "sim-1"
    port: int = 8101
    model: str = "sim-llama"
    profile: str | TimingProfile = "default"
    engine: EngineConfig = field(default_factory=EngineConfig)
    # Used when a request names no max_tokens; always capped by max_model_len - prompt.
    default_max_tokens: int = 64
    faults: Faults = field(default_factory=Faults)
    # KV events as vLLM's `--kv-events-config` publishes them: a ZMQ PUB socket and a ROUTER
    # replay socket on `kv_events_host`. Port 0 takes any free port (see SimWorker.kv_endpoint);
    # `kv_replay_port=None` serves no replay. Publishing turns on the engine's event recording.
    kv_events: bool = False
    kv_events_host: str = "127.0.0.1"
    kv_events_port: int = 0
    kv_replay_port: int | None = 0
    kv_events_topic: str = "kv"
    kv_events_layout: str = "0.32"  # "0.32": maps tagged by "type"; "0.11": positional arrays
    kv_events_buffer_steps: int = 10_000  # batches kept for replay (vLLM's buffer_steps)
    # vLLM's --enable-request-id-headers: every response carries X-Request-Id (off, as in vLLM).
    enable_request_id_headers: bool = False
