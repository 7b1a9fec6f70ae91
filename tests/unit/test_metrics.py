"""The Prometheus metrics' shapes (their values are checked against real servers' usage in the
integration tests)."""

from meshlm.metrics import Metrics


def test_token_and_step_times_below_5_ms_land_in_buckets_of_their_own():
    """Every inter-token time and step of a small model fell in the lowest bucket (5 ms), so the histograms
    said nothing (review helper-45)."""
    m = Metrics()
    for seconds in (0.0004, 0.0008, 0.002):
        m.itl.observe(seconds)
        m.step_time.observe(seconds)
    text = m.render().decode() if isinstance(m.render(), bytes) else m.render()
    for name in ("meshlm_inter_token_latency_seconds", "meshlm_step_seconds"):
        assert f'{name}_bucket{{le="0.0005"}} 1.0' in text
        assert f'{name}_bucket{{le="0.001"}} 2.0' in text
        assert f'{name}_bucket{{le="0.0025"}} 3.0' in text


def test_counters_and_histograms_export_no_created_series():
    """prometheus_client's `_created` series (a timestamp typed gauge, with its parent's help) read as a
    second gauge beside every counter and histogram, and the collector-built ones had none (helper-55)."""
    m = Metrics()
    m.requests.labels(status="stop").inc()
    m.ttft.observe(0.1)
    text = m.render().decode()
    assert "meshlm_requests_total" in text and "meshlm_time_to_first_token_seconds_count" in text
    assert "_created" not in text
