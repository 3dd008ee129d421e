"""Prometheus metrics, written in the text exposition format by hand (no extra dependency).

Thread-safe: the engine thread records token timings while the event loop counts requests.
Label sets are bounded (endpoints are route templates, never raw URLs).
"""

from __future__ import annotations

import bisect
import itertools
import threading
from collections import defaultdict
from typing import Any

from colibri.engine import EngineClient

_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75,
                    1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class Histogram:
    """A cumulative-bucket histogram (Prometheus semantics). An observation is counted once,
    in the first bucket that holds it (beyond the last: in the total only), and the buckets
    are cumulated when rendered: one bisection per observation, not a pass over them."""

    def __init__(self, buckets: tuple[float, ...] = _LATENCY_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bucket
        self.total = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.total += 1
        self.sum += value
        # NaN holds in no bucket (bisect would put it in the first)
        i = bisect.bisect_left(self.buckets, value) if value == value else len(self.buckets)
        self.counts[i] += 1

    def cumulative(self) -> list[int]:
        """Observations <= each bucket's upper bound."""
        return list(itertools.accumulate(self.counts[:-1]))

    def render(self, name: str) -> list[str]:
        pairs = zip(self.buckets, self.cumulative(), strict=True)
        lines = [f'{name}_bucket{{le="{b}"}} {c}' for b, c in pairs]
        lines.append(f'{name}_bucket{{le="+Inf"}} {self.total}')
        lines.append(f"{name}_sum {self.sum}")
        lines.append(f"{name}_count {self.total}")
        return lines


class Metrics:
    """Every number /metrics exports."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = defaultdict(int)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.aborted = 0
        self.waiting = 0
        self.running = 0
        self.ttft = Histogram()
        self.itl = Histogram()
        self.e2e = Histogram()
        self.batch_seqs = Histogram(_BATCH_BUCKETS)
        self.batch_tokens = Histogram(_BATCH_BUCKETS)
        self.engine: EngineClient | None = None  # read at render time

    def attach(self, engine: EngineClient) -> None:
        """Export engine's counters; call before the engine starts (its steps are
        observed from the first)."""
        self.engine = engine
        engine.observe_steps(self.observe_step)

    # -- recorders ---------------------------------------------------------------------
    def count_request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, status)] += 1

    def add_prompt_tokens(self, n: int) -> None:
        with self._lock:
            self.prompt_tokens += n

    def add_token(self, itl: float | None, ttft: float | None) -> None:
        """One generated token; itl/ttft are the latencies it closes, when it closes one."""
        with self._lock:
            self.generation_tokens += 1
            if itl is not None:
                self.itl.observe(itl)
            if ttft is not None:
                self.ttft.observe(ttft)

    def add_e2e(self, seconds: float) -> None:
        with self._lock:
            self.e2e.observe(seconds)

    def add_aborted(self) -> None:
        with self._lock:
            self.aborted += 1

    def observe_step(self, n_seqs: int, n_tokens: int) -> None:
        """One engine step: sequences and tokens it carried."""
        with self._lock:
            self.batch_seqs.observe(n_seqs)
            self.batch_tokens.observe(n_tokens)

    def set_queue(self, waiting: int, running: int) -> None:
        with self._lock:
            self.waiting = waiting
            self.running = running

    # -- exposition --------------------------------------------------------------------
    def render(self) -> str:
        """The text exposition format (version 0.0.4)."""
        with self._lock:
            out: list[str] = []

            def head(name: str, kind: str, doc: str) -> None:
                out.append(f"# HELP {name} {doc}")
                out.append(f"# TYPE {name} {kind}")

            head("colibri_requests_total", "counter", "HTTP requests by endpoint and status.")
            for (endpoint, status), n in sorted(self.requests.items()):
                out.append(f'colibri_requests_total{{endpoint="{endpoint}",status="{status}"}} {n}')
            head("colibri_prompt_tokens_total", "counter", "Prompt tokens processed.")
            out.append(f"colibri_prompt_tokens_total {self.prompt_tokens}")
            head("colibri_generation_tokens_total", "counter", "Tokens generated.")
            out.append(f"colibri_generation_tokens_total {self.generation_tokens}")
            head("colibri_requests_aborted_total", "counter",
                 "Requests stopped early (client gone, server draining).")
            out.append(f"colibri_requests_aborted_total {self.aborted}")
            out += self._render_engine()
            head("colibri_requests_waiting", "gauge", "Requests waiting in the queue.")
            out.append(f"colibri_requests_waiting {self.waiting}")
            head("colibri_requests_running", "gauge", "Requests being generated.")
            out.append(f"colibri_requests_running {self.running}")
            head("colibri_model_loaded", "gauge", "1 when the model is loaded and ready.")
            loaded = self.engine is not None and self.engine.health() in ("ready", "stopping")
            out.append(f"colibri_model_loaded {int(loaded)}")
            head("colibri_time_to_first_token_seconds", "histogram",
                 "From arrival in the queue to the first generated token.")
            out += self.ttft.render("colibri_time_to_first_token_seconds")
            head("colibri_inter_token_latency_seconds", "histogram",
                 "Between consecutive generated tokens of one sequence.")
            out += self.itl.render("colibri_inter_token_latency_seconds")
            head("colibri_e2e_request_latency_seconds", "histogram",
                 "From arrival in the queue to the last token.")
            out += self.e2e.render("colibri_e2e_request_latency_seconds")
            head("colibri_batch_size_sequences", "histogram", "Sequences per engine step.")
            out += self.batch_seqs.render("colibri_batch_size_sequences")
            head("colibri_batch_size_tokens", "histogram", "Tokens per engine step.")
            out += self.batch_tokens.render("colibri_batch_size_tokens")
            return "\n".join(out) + "\n"

    def _render_engine(self) -> list[str]:
        """The scheduler and KV cache numbers under vLLM's names, so gateways that route on
        them (queue depth, KV usage) work unchanged."""
        engine = self.engine
        stats = engine.stats() if engine is not None else None
        if not stats or engine is None:
            return []
        self.waiting, self.running = int(stats["waiting"]), int(stats["running"])
        name = engine.info.name.replace("\\", "").replace('"', "")
        lab = f'{{model_name="{name}"}}'
        rows = [
            ("vllm:num_requests_running", "gauge", "Sequences in the running batch.",
             "running"),
            ("vllm:num_requests_waiting", "gauge", "Sequences waiting to be scheduled.",
             "waiting"),
            ("vllm:kv_cache_usage_perc", "gauge", "Share of KV cache blocks in use (0-1).",
             "kv_usage"),
            ("vllm:prefix_cache_queries_total", "counter",
             "Prompt tokens looked up in the prefix cache.", "prefix_queries"),
            ("vllm:prefix_cache_hits_total", "counter",
             "Prompt tokens found in the prefix cache.", "prefix_hits"),
            ("vllm:num_preemptions_total", "counter",
             "Sequences preempted (blocks freed, recomputed later).", "preemptions"),
            ("colibri_kv_cache_blocks_free", "gauge", "Free KV cache blocks.", "kv_free"),
            ("colibri_kv_cache_blocks_total", "gauge", "KV cache blocks in the pool.",
             "kv_total"),
            ("colibri_engine_step_seconds_total", "counter",
             "Time in engine steps (scheduling, forward pass, sampling, detokenizing).",
             "step_s"),
            ("colibri_engine_forward_seconds_total", "counter",
             "Time in the forward pass (the C core) within engine steps.", "forward_s"),
            ("vllm:spec_decode_num_drafts_total", "counter",
             "Sequence steps that carried drafted tokens (speculative decoding).",
             "spec_drafts"),
            ("vllm:spec_decode_num_draft_tokens_total", "counter",
             "Tokens drafted and verified.", "spec_draft_tokens"),
            ("vllm:spec_decode_num_accepted_tokens_total", "counter",
             "Drafted tokens the model agreed with (kept).", "spec_accepted_tokens"),
            ("colibri_spec_decode_mean_accepted_length", "gauge",
             "Drafted tokens accepted per sequence step that carried drafts, since start.",
             "spec_mean_accepted"),
        ]
        out: list[str] = []
        for name, kind, doc, key in rows:
            out.append(f"# HELP {name} {doc}")
            out.append(f"# TYPE {name} {kind}")
            out.append(f"{name}{lab if name.startswith('vllm:') else ''} {stats[key]}")
        return out + self._render_expert_cache()

    def _render_expert_cache(self) -> list[str]:
        """Expert cache counters per layer, and its occupancy (nothing when it is off)."""
        mon = self.engine.expert_cache() if self.engine is not None else None
        st = mon.stats() if mon is not None else None
        out: list[str] = self._render_gpu_tier(mon)
        if st is None:
            return out
        for key, doc in _EXPERT_COUNTERS:
            name = f"colibri_expert_cache_{key}_total"
            scale = 1e-9 if key == "stall_seconds" else 1.0
            vals = st["stall_ns" if key == "stall_seconds" else key]
            out += [f"# HELP {name} {doc}", f"# TYPE {name} counter"]
            out += [f'{name}{{layer="{i}"}} {float(v) * scale:g}' for i, v in enumerate(vals)]
        tot = mon.totals()
        for key, doc in (("hit_rate", "Share of expert uses found resident, since start."),
                         ("resident_bytes", "Bytes of experts resident or loading now."),
                         ("budget_bytes", "Bytes the expert cache may hold.")):
            name = f"colibri_expert_cache_{key}"
            out += [f"# HELP {name} {doc}", f"# TYPE {name} gauge", f"{name} {tot[key]:g}"]
        return out


    @staticmethod
    def _render_gpu_tier(mon: Any) -> list[str]:
        """The GPU tier's counters (routed experts on a GPU beside the CPU), else nothing."""
        ts = mon.tier_stats() if mon is not None else None
        if ts is None:
            return []
        out: list[str] = []
        for key, doc in _TIER_GAUGES:
            name = f"colibri_gpu_tier_{key}"
            out += [f"# HELP {name} {doc}", f"# TYPE {name} gauge", f"{name} {ts[key]}"]
        # every counter the tier keeps, those without a description here too
        for key in mon.tier_counter_names():
            name = f"colibri_gpu_tier_{key}_total"
            doc = _TIER_COUNTERS.get(key, f"The GPU tier's {key.replace('_', ' ')}, since start.")
            out += [f"# HELP {name} {doc}", f"# TYPE {name} counter", f"{name} {ts[key]}"]
        return out


_TIER_GAUGES = (
    ("experts_on_device", "Routed experts held in GPU memory now."),
    ("device_expert_bytes", "Bytes of the routed experts held in GPU memory now."),
    ("upload_buffer_bytes", "GPU memory of the buffers that experts copied for one step go "
                            "through."),
)

_TIER_COUNTERS = {
    "hits": "Expert selections computed by an expert in GPU memory.",
    "misses": "Expert selections computed on the CPU beside the GPU.",
    "uploads": "Experts copied to the GPU by heat.",
    "upload_bytes": "Bytes of experts copied to the GPU by heat.",
    "evictions": "Experts dropped from the GPU for hotter ones.",
    "steps": "Engine steps the GPU tier counted.",
    "step_uploads": "Experts on the CPU copied to the GPU for one step, where the cost model "
                    "predicted their rows repay the copy.",
    "step_upload_bytes": "Bytes of experts copied to the GPU for one step.",
    "step_upload_rows": "Expert selections computed by experts copied to the GPU for their step.",
}

_EXPERT_COUNTERS = (
    ("hits", "Expert uses found resident."),
    ("misses", "Expert uses that had to wait for a load."),
    ("loads", "Experts loaded (on demand and prefetched)."),
    ("evictions", "Experts evicted."),
    ("prefetch_issued", "Experts read ahead (prefetched)."),
    ("prefetch_used", "Prefetched experts used before eviction."),
    ("prefetch_wasted", "Prefetched experts evicted unused."),
    ("prefetch_late", "Expert uses that waited for a prefetch in flight."),
    ("bytes_read", "Bytes of experts read from the model files."),
    ("stall_seconds", "Forward-pass time spent waiting for expert loads."),
    ("reader_loads", "Expert misses loaded by the reader threads (not in memory, or the file "
     "not open yet)."),
    ("prefetch_cancelled", "Prefetches dropped before their read started (the layer began "
     "first, or a nearer layer's prediction left them out)."),
    ("prefetch_far", "Prefetches queued two layers ahead."),
    ("overlapped", "Experts computed while another expert of their wave was still loading."),
    ("prefetch_busy", "Prefetches not started because loads the forward pass waits for kept "
     "the storage busy."),
    ("prefetch_aborted", "Prefetch reads stopped part-way for a load the forward pass waits "
     "for."),
    ("prefetch_spared", "Prefetches not started because the expert they would evict was "
     "likelier to be used."),
    ("predicted", "Experts a layer's router picked ahead, on an earlier layer's input."),
    ("predicted_right", "Experts picked ahead that the layer then routed to."),
)


def parse_metrics(text: str) -> dict[str, float]:
    """Samples of a text exposition as {name{labels}: value} (used by tests and scripts)."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        samples[key] = float(value)
    return samples
