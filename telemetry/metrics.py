"""Prometheus metrics for the studio: latency per stage, images made, jobs by outcome,
memory and queue gauges. Served as text at `/metrics` for Prometheus/Grafana.

Each `StudioMetrics` owns its registry (not prometheus_client's global one), so
several apps in one process (tests) do not collide.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the HTTP route)

from telemetry.memory import MemoryReading

# StyleGAN images take milliseconds, SDXL at 50 steps tens of seconds: buckets span both
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)


class StudioMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.stage_seconds = Histogram("atelier_stage_latency_seconds", "Time spent in one stage of a generation job",
                                       ["backend", "stage"], buckets=LATENCY_BUCKETS, registry=r)
        self.job_seconds = Histogram("atelier_generation_latency_seconds", "Wall time of a finished generation job",
                                     ["backend"], buckets=LATENCY_BUCKETS, registry=r)
        self.step_seconds = Histogram("atelier_step_latency_seconds", "Time of one step (batch or denoising step)",
                                      ["backend"], buckets=LATENCY_BUCKETS, registry=r)
        self.images = Counter("atelier_images_generated", "Images generated", ["backend"], registry=r)
        self.jobs = Counter("atelier_jobs", "Generation jobs by outcome", ["backend", "outcome"], registry=r)
        self.queue_waiting = Gauge("atelier_queue_waiting", "Jobs waiting for the GPU", registry=r)
        self.queue_running = Gauge("atelier_queue_running", "Jobs running on the GPU", registry=r)
        self.mem_allocated = Gauge("atelier_vram_allocated_bytes", "torch allocator: allocated bytes", registry=r)
        self.mem_reserved = Gauge("atelier_vram_reserved_bytes", "torch allocator: reserved bytes", registry=r)
        self.mem_peak = Gauge("atelier_vram_peak_bytes", "torch allocator peak since the last job started", registry=r)
        self.device_used = Gauge("atelier_device_memory_used_bytes", "whole device (NVML), all processes", registry=r)
        self.device_total = Gauge("atelier_device_memory_total_bytes", "device memory size", registry=r)
        self.process_rss = Gauge("atelier_process_rss_bytes", "resident memory of this process (CPU runs)", registry=r)

    def observe_job(self, backend: str, outcome: str, timings_ms: dict[str, float], images: int = 0,
                    step_ms: list[float] | tuple[float, ...] = ()) -> None:
        self.jobs.labels(backend, outcome).inc()
        if outcome != "done":
            return
        for stage, ms in timings_ms.items():
            self.stage_seconds.labels(backend, stage).observe(ms / 1e3)
        self.job_seconds.labels(backend).observe(sum(timings_ms.values()) / 1e3)
        for ms in step_ms:
            self.step_seconds.labels(backend).observe(ms / 1e3)
        self.images.labels(backend).inc(images)

    def set_memory(self, r: MemoryReading) -> None:
        if r.kind == "cuda":
            self.mem_allocated.set(r.allocated)
            self.mem_reserved.set(r.reserved)
            self.mem_peak.set(r.peak)
        if r.rss is not None:
            self.process_rss.set(r.rss)
        if r.device_used is not None:
            self.device_used.set(r.device_used)
        if r.device_total is not None:
            self.device_total.set(r.device_total)

    def set_queue(self, waiting: int, running: int) -> None:
        self.queue_waiting.set(waiting)
        self.queue_running.set(running)

    def render(self) -> bytes:
        return generate_latest(self.registry)
