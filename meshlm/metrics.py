"""Prometheus metrics, one registry per engine (two engines in a process must not collide)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# A token or a step of a small model on a fast machine takes well under 5 ms: every one fell in the lowest
# bucket of the above, and the histograms said nothing
_TOKEN_BUCKETS = (0.0005, 0.001, 0.0025, *_LATENCY_BUCKETS)


class Metrics:
    def __init__(self) -> None:
        # prometheus_client adds a `_created` series (a start timestamp, typed gauge, with its parent's help)
        # to every counter and histogram: in the text format it read as a second, unrelated gauge, and the
        # collector-built counters have none (review helper-55). A switch of the library's, process-wide.
        disable_created_metrics()
        r = self.registry = CollectorRegistry()
        self.requests = Counter("meshlm_requests", "Sequences by final status: each choice of a request "
                                "(n) and each prompt of a batched completion counts once", ["status"], registry=r)
        self.rejected = Counter("meshlm_rejected_requests", "Requests answered with an error before any sequence ran "
                                "(a 400, 404, 413, 429, 503 ...), by HTTP status", ["status"], registry=r)
        self.prompt_tokens = Counter("meshlm_prompt_tokens", "Prompt tokens of every sequence queued (a request "
                                     "with n choices counts its prompt n times)", registry=r)
        self.cached_tokens = Counter("meshlm_cached_prompt_tokens", "Prompt tokens served from cache", registry=r)
        self.generation_tokens = Counter("meshlm_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("meshlm_time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("meshlm_inter_token_latency_seconds", "Time between tokens of a stream", buckets=_TOKEN_BUCKETS, registry=r)
        self.step_time = Histogram("meshlm_step_seconds", "Engine step duration", buckets=_TOKEN_BUCKETS, registry=r)
        self.queue_depth = Gauge("meshlm_queue_depth", "Sequences waiting to be admitted", registry=r)
        self.batch_size = Gauge("meshlm_batch_size", "Sequences running in the last step", registry=r)
        self.kv_bytes = Gauge("meshlm_kv_cache_bytes", "KV bytes allocated on the leader (running sequences and cached "
                              "blocks alike; never above --kv-cache-memory)", registry=r)
        self.kv_blocks_used = Gauge("meshlm_kv_blocks_used", "KV blocks held by running sequences", registry=r)
        self.kv_blocks_cached = Gauge("meshlm_kv_blocks_cached", "KV blocks findable by the prefix cache", registry=r)
        self.preemptions = Counter("meshlm_preemptions", "Sequences preempted for recompute", registry=r)
        self.steps_ahead = Counter("meshlm_steps_planned_ahead", "Decode steps planned and launched while the "
                                   "previous step ran (--async-scheduling; a pipeline's, ids to follow)", registry=r)
        self.spec_verifies = Counter("meshlm_spec_verify_steps", "Speculating rows verified (one per row per step)",
                                     registry=r)
        self.spec_drafted = Counter("meshlm_spec_draft_tokens", "Draft tokens verified by the target", registry=r)
        self.spec_accepted = Counter("meshlm_spec_accepted_tokens", "Draft tokens the target accepted", registry=r)
        self.spec_emitted = Counter("meshlm_spec_emitted_tokens", "Tokens emitted by verify steps (accepted drafts "
                                    "plus the target's own token); / verify steps = mean accepted length", registry=r)
        self.spec_accepted_at = Counter("meshlm_spec_accepted_per_position", "Drafts accepted, by draft position "
                                        "(0: the first draft)", ["position"], registry=r)
        self.disagg_handoffs = Counter("meshlm_disagg_handoffs", "Transfers from a prefill server (a prompt's, or "
                                       "those of prompts sharing its blocks)", registry=r)
        self.disagg_joined = Counter("meshlm_disagg_joined", "Prompts that waited on a running transfer of their "
                                     "blocks instead of starting one", registry=r)
        self.disagg_fallbacks = Counter("meshlm_disagg_fallbacks", "Handoffs that ended early, by why: the rest of the "
                                        "prompt was prefilled here", ["reason"], registry=r)
        self.disagg_kv_bytes = Counter("meshlm_disagg_kv_bytes", "KV bytes exchanged with other servers",
                                       ["direction"], registry=r)
        self.disagg_transfer_time = Histogram("meshlm_disagg_transfer_seconds", "Handoff time, from the request "
                                              "to its last KV block", buckets=_LATENCY_BUCKETS, registry=r)
        self.disagg_jobs = Counter("meshlm_disagg_prefill_jobs", "Prefill jobs this server took, by outcome",
                                   ["outcome"], registry=r)
        self.spec_verify_step_time = Histogram("meshlm_spec_verify_step_seconds", "Duration of steps that verified "
                                               "drafts", buckets=_LATENCY_BUCKETS, registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class PrefixCacheCollector:
    """Reads prefix-cache counters at scrape time (the cache itself stays free of Prometheus).

    `blocks()`: the engine's current block manager (a restart makes a new one, sharing its stats);
    `rank`: the leader's RankState, for block bytes and its SSD tier."""

    def __init__(self, blocks, rank) -> None:
        self.blocks = blocks
        self.rank = rank

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        blocks, ssd = self.blocks(), self.rank.ssd
        stats = blocks.stats
        hits = CounterMetricFamily("meshlm_prefix_cache_hits", "Blocks found, by tier", labels=["tier"])
        hits.add_metric(["ram"], stats.hits_ram)
        hits.add_metric(["ssd"], stats.hits_ssd)
        hits.add_metric(["received"], stats.hits_received)
        yield hits
        # In tokens, as vLLM's prefix_cache_queries and prefix_cache_hits: their ratio is the hit rate (the
        # block counts above and the lookup misses below are in other units)
        yield CounterMetricFamily("meshlm_prefix_cache_query_tokens",
                                  "Prompt tokens looked up in the prefix cache, at their first admission",
                                  value=stats.query_tokens)
        yield CounterMetricFamily("meshlm_prefix_cache_hit_tokens",
                                  "Of the prompt tokens looked up, those served from the cache (usage's cached_tokens)",
                                  value=stats.hit_tokens)
        yield CounterMetricFamily(
            "meshlm_prefix_cache_partial_tokens", "Tokens reused from the front of a block (matches ending inside one)",
            value=stats.partial_tokens,
        )
        yield CounterMetricFamily("meshlm_prefix_cache_misses", "Lookups with no cached block", value=stats.misses)
        yield CounterMetricFamily(
            "meshlm_prefix_cache_load_failures", "Blocks found that some rank could not load (recomputed instead)",
            value=stats.load_failures,
        )
        ev = CounterMetricFamily("meshlm_prefix_cache_evictions", "Blocks evicted, by tier", labels=["tier"])
        ev.add_metric(["ram"], stats.evictions)
        ev.add_metric(["ssd"], ssd.evictions if ssd else 0)
        yield ev
        size = GaugeMetricFamily("meshlm_prefix_cache_bytes", "Bytes of findable blocks, by tier", labels=["tier"])
        size.add_metric(["ram"], blocks.num_cached * self.rank.store.shape.block_bytes)
        size.add_metric(["ssd"], ssd.nbytes if ssd else 0)
        yield size
        yield CounterMetricFamily("meshlm_prefix_cache_ssd_dropped", "SSD block files rejected as torn, garbled or foreign",
                                  value=ssd.dropped if ssd else 0)


class RankTimesCollector:
    """Every rank's seconds by phase (meshlm/step_times.py), read at scrape time: `rank_times()` is the
    executor's, workers' figures as of their last ACK. / meshlm_step_seconds_count = per step."""

    def __init__(self, rank_times) -> None:
        self.rank_times = rank_times

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        from meshlm.step_times import PHASES

        family = CounterMetricFamily("meshlm_rank_seconds", "Seconds each rank spent per phase of its steps "
                                     "(build, device, schedule, sample, emit, control, wait, link)",
                                     labels=["rank", "phase"])
        for rank, totals in sorted(self.rank_times().items()):
            for phase, seconds in zip(PHASES, totals):
                family.add_metric([str(rank), phase], seconds)
        yield family


class AllReduceCollector:
    """Every rank's tensor-parallel sums through shared memory (transport/local_reduce.py), read at scrape
    time (a worker's as of its last ack): how many, their seconds, and the part of those spent waiting for
    the other ranks (the skew between ranks; the rest is copying and adding). Part of
    meshlm_rank_seconds' device phase."""

    def __init__(self, stats) -> None:
        self.stats = stats

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        counts = CounterMetricFamily("meshlm_all_reduce", "Shared-memory all-reduces each rank took part in",
                                     labels=["rank"])
        family = CounterMetricFamily("meshlm_all_reduce_seconds", "Each rank's seconds in shared-memory "
                                     "all-reduces, all of it (total) and waiting for the other ranks' parts "
                                     "(waiting)", labels=["part", "rank"])
        for rank, (count, seconds, waiting) in sorted(self.stats().items()):
            counts.add_metric([str(rank)], count)
            family.add_metric(["total", str(rank)], seconds)
            family.add_metric(["waiting", str(rank)], waiting)
        yield counts
        yield family


class ContextBlocksCollector:
    """Sequences kept whole on one context-parallel rank (--cp-min-tokens, kv/context_blocks.py), read at
    scrape time: `blocks()` is the engine's current ContextBlocks."""

    def __init__(self, blocks) -> None:
        self.blocks = blocks

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        blocks = self.blocks()
        placed = CounterMetricFamily("meshlm_cp_whole_sequences", "Sequences kept whole on one context-parallel "
                                     "rank (shorter than --cp-min-tokens), by the rank holding them", labels=["rank"])
        held = GaugeMetricFamily("meshlm_cp_whole_blocks", "KV blocks whole sequences hold now, by rank",
                                 labels=["rank"])
        for rank, (n, b) in enumerate(zip(blocks.whole_stats.placed, blocks.whole_blocks())):
            placed.add_metric([str(rank)], n)
            held.add_metric([str(rank)], b)
        yield placed
        yield held
