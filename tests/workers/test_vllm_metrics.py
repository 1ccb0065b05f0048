from pathlib import Path

import pytest

from workers.vllm_metrics import parse_vllm_metrics, relevant_lines

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-0.32" / "metrics.txt"

# Two data-parallel engines: counts add up, KV usage is their mean.
CURRENT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e9
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 640.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="m"} 7.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",enable_prefix_caching="True",engine="0",num_gpu_blocks="4096",prefix_caching_hash_algo="sha256"} 1.0
"""

OLD = """\
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.8
# TYPE vllm:gpu_prefix_cache_queries_total counter
vllm:gpu_prefix_cache_queries_total{model_name="m"} 10.0
# TYPE vllm:gpu_prefix_cache_hits_total counter
vllm:gpu_prefix_cache_hits_total{model_name="m"} 5.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 1.0
"""


def test_current_names_summed_over_engines() -> None:
    m = parse_vllm_metrics(CURRENT)
    assert (m.running, m.waiting) == (5, 4)
    assert m.kv_usage == pytest.approx(0.375)
    assert (m.block_size, m.num_blocks) == (16, 4096)
    assert (m.prefix_cache_queries, m.prefix_cache_hits, m.preemptions) == (1000, 640, 7)


def test_removed_gpu_names_are_a_fallback_for_old_servers() -> None:
    m = parse_vllm_metrics(OLD)
    assert m.kv_usage == pytest.approx(0.8)
    assert (m.prefix_cache_queries, m.prefix_cache_hits, m.running) == (10, 5, 1)
    assert m.block_size is None


def test_non_vllm_text_yields_empty_state() -> None:
    m = parse_vllm_metrics("# TYPE up gauge\nup 1\n")
    assert (m.running, m.kv_usage, m.num_blocks) == (0, 0.0, None)


def test_label_value_containing_created_does_not_hide_the_sample() -> None:
    # A served model named like a counter's creation-time family.
    text = CURRENT.replace('model_name="m"', 'model_name="ft_created-llama"')
    m = parse_vllm_metrics(text)
    assert (m.running, m.waiting, m.kv_usage) == (5, 4, pytest.approx(0.375))
    assert (m.prefix_cache_queries, m.prefix_cache_hits, m.preemptions) == (1000, 640, 7)
    # The `*_created` families themselves still stay out of the parse.
    assert "vllm:prefix_cache_queries_created" not in relevant_lines(text)


def test_non_finite_samples_are_skipped_and_the_rest_still_read() -> None:
    text = """\
vllm:num_requests_running{engine="0"} +Inf
vllm:num_requests_running{engine="1"} 2.0
vllm:num_requests_waiting{engine="0"} NaN
vllm:num_requests_waiting{engine="1"} 4.0
vllm:kv_cache_usage_perc{engine="0"} NaN
vllm:kv_cache_usage_perc{engine="1"} 0.5
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0"} -Inf
vllm:num_preemptions_total{engine="1"} 7.0
process_start_time_seconds NaN
"""
    m = parse_vllm_metrics(text)
    assert (m.running, m.waiting, m.kv_usage, m.preemptions) == (2, 4, 0.5, 7)
    assert m.process_start is None  # NaN != NaN: it would read as a restart on every probe


def test_recorded_vllm_032_metrics_parse() -> None:
    text = FIXTURE.read_text()
    m = parse_vllm_metrics(text)
    assert m.block_size and m.block_size % 16 == 0
    assert m.num_blocks and m.num_blocks > 0
    assert 0.0 <= m.kv_usage <= 1.0


@pytest.mark.parametrize(
    "text", [CURRENT, OLD, FIXTURE.read_text()], ids=["current", "old", "0.32"]
)
def test_only_the_families_read_reach_the_parser_with_the_same_result(
    text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The line filter (a 13x cheaper scrape on real vLLM text) changes no number."""
    import workers.vllm_metrics as vm

    filtered = vm.parse_vllm_metrics(text)
    if len(text) > 10_000:  # the real exposition: mostly histogram lines, left out
        assert len(vm.relevant_lines(text)) < len(text) / 10
    monkeypatch.setattr(vm, "relevant_lines", lambda t: t)
    assert vm.parse_vllm_metrics(text) == filtered


@pytest.mark.parametrize(
    ("block_size", "num_gpu_blocks", "want"),
    [
        ("16", "9" * 400, (16, None)),  # overflowed every float built on it: 500s (review)
        ("9" * 30, "4096", (None, 4096)),
        ("\uff11\uff16", "\u00b2", (None, None)),  # not ASCII (fullwidth 16, ²): `int` of ² raises
        ("16", str(1 << 41), (16, None)),
        ("256", str(1 << 20), (256, 1 << 20)),
    ],
)
def test_cache_geometry_past_its_bounds_is_unknown(
    block_size: str, num_gpu_blocks: str, want: tuple[int | None, int | None]
) -> None:
    text = (
        f'vllm:cache_config_info{{block_size="{block_size}",engine="0",'
        f'num_gpu_blocks="{num_gpu_blocks}"}} 1.0\n'
    )
    m = parse_vllm_metrics(text)
    assert (m.block_size, m.num_blocks) == want
