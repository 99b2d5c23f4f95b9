"""Live telemetry for the studio's side panel.

`JobTracker` follows one session's job (stage, step i/N, step times, it/s,
ETA, the last job's latency per stage). The generation thread writes to it
through `on_progress`; the UI timer reads `snapshot()`. Both sides only take a
lock around a few field updates, so a progress callback costs microseconds.

`MemoryHistory` keeps the device's memory over the last minutes. Memory is a
property of the device, not of a session, so one history is shared by every
session; it samples at most every `min_interval_s`, however many browser tabs
poll it.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

from core.types import ProgressEvent
from telemetry.memory import MemoryReading, read_memory

IDLE, QUEUED, RUNNING, DONE, STOPPED, FAILED = "idle", "queued", "running", "done", "stopped", "failed"
RATE_WINDOW = 10          # it/s and ETA from the mean of the last steps: smooth, yet follows changes


@dataclass(frozen=True)
class JobSnapshot:
    """An immutable copy of a tracker's state, safe to render from another thread."""

    state: str = IDLE
    kind: str = ""                      # "images", "style-mix", "interpolate", "diffusion"
    stage: str = ""
    step: int = 0
    total: int = 0
    last_step_ms: float | None = None
    it_per_s: float | None = None
    eta_s: float | None = None
    elapsed_s: float = 0.0
    step_ms: tuple[float, ...] = ()     # this job's step times (the last ones kept), for the chart
    stage_ms: dict = field(default_factory=dict)        # the running job's finished stages so far
    last_stage_ms: dict = field(default_factory=dict)   # the last finished job's latency per stage
    last_total_ms: float | None = None
    last_images: int = 0
    last_peak_bytes: int | None = None
    last_state: str = ""                # DONE, or STOPPED when the last timed job was stopped with images kept
    message: str = ""
    preview_seq: int = 0                # bumps when a new preview image arrives

    @property
    def active(self) -> bool:
        return self.state in (QUEUED, RUNNING)

    @property
    def fraction(self) -> float:
        return min(1.0, self.step / self.total) if self.total else 0.0


class JobTracker:
    """One session's current and last job. Thread-safe; every method is O(1) except `snapshot`."""

    def __init__(self, history: int = 2048):
        self._lock = threading.Lock()
        self._step_ms: deque[float] = deque(maxlen=history)
        self._state = IDLE
        self._kind = ""
        self._stage = ""
        self._step = 0
        self._total = 0
        self._started = 0.0
        self._ended = 0.0
        self._stage_ms: dict[str, float] = {}
        self._last_stage_ms: dict[str, float] = {}
        self._last_total_ms: float | None = None
        self._last_images = 0
        self._last_peak: int | None = None
        self._last_state = ""
        self._message = ""
        self._preview = None
        self._preview_seq = 0
        self._job = None

    # -- writers (generation side) -------------------------------------------------
    def queued(self, kind: str = "", message: str = "") -> None:
        with self._lock:
            self._state, self._kind, self._message = QUEUED, kind, message
            self._stage, self._step, self._total = "", 0, 0
            self._step_ms.clear()
            self._stage_ms = {}

    def start(self, kind: str = "", job=None) -> None:
        """`job` (a core.types.Job) lets snapshots show the stage it is in, steps or not."""
        with self._lock:
            self._job = job
            self._state, self._kind, self._message = RUNNING, kind or self._kind, ""
            self._stage, self._step, self._total = "load", 0, 0
            self._step_ms.clear()
            self._stage_ms = {}
            self._preview = None
            self._started = time.perf_counter()

    def on_progress(self, ev: ProgressEvent) -> None:
        """The Job's progress callback: runs on the generation thread once per step."""
        with self._lock:
            self._stage, self._step, self._total = ev.stage, int(ev.step), int(ev.total)
            if ev.step_ms is not None:
                self._step_ms.append(float(ev.step_ms))
            if ev.preview is not None:
                self._preview = ev.preview
                self._preview_seq += 1
            if ev.message:
                self._message = ev.message

    def finish(self, state: str, timings_ms: dict[str, float], images: int = 0, peak_bytes: int | None = None,
               message: str = "") -> None:
        with self._lock:
            self._state, self._message = state, message
            self._ended = time.perf_counter()
            self._stage_ms = dict(timings_ms)
            self._job = None
            self._preview = None        # the job is over: do not keep its last preview image alive
            if state == DONE or (state == STOPPED and images > 0):
                # a finished job replaces "the last job's latency", and so does a stopped one that kept the
                # images it finished (timed per image, labelled stopped); one that kept none would read as fast
                self._last_state = state
                self._last_stage_ms = dict(timings_ms)
                self._last_total_ms = sum(timings_ms.values())
                self._last_images = images
                self._last_peak = peak_bytes

    # -- readers (UI side) ----------------------------------------------------------
    def latest_preview(self) -> tuple[int, object]:
        with self._lock:
            return self._preview_seq, self._preview

    @property
    def state(self) -> str:
        return self._state

    def snapshot(self, max_points: int = 240) -> JobSnapshot:
        with self._lock:
            steps = list(self._step_ms)
            state, step, total = self._state, self._step, self._total
            stage, stage_ms = self._stage, self._stage_ms
            if self._job is not None and state == RUNNING:
                # the Job updates these on its own thread; reading a str and copying a dict is atomic in CPython
                stage, stage_ms = self._job.stage_name, dict(self._job.timings_ms)
            now = time.perf_counter()
            elapsed = (now - self._started) if state == RUNNING else (self._ended - self._started if self._started else 0.0)
            snap = dict(state=state, kind=self._kind, stage=stage, step=step, total=total,
                        stage_ms=stage_ms, last_stage_ms=dict(self._last_stage_ms),
                        last_total_ms=self._last_total_ms, last_images=self._last_images,
                        last_peak_bytes=self._last_peak, last_state=self._last_state, message=self._message,
                        preview_seq=self._preview_seq)
        last = steps[-1] if steps else None
        window = steps[-RATE_WINDOW:]
        mean_ms = sum(window) / len(window) if window else None
        it_per_s = 1000.0 / mean_ms if mean_ms else None
        eta = (total - step) * mean_ms / 1000.0 if (mean_ms and state == RUNNING and total) else None
        return JobSnapshot(last_step_ms=last, it_per_s=it_per_s, eta_s=eta, elapsed_s=max(0.0, elapsed),
                           step_ms=tuple(downsample(steps, max_points)), **snap)


def downsample(values: list[float], max_points: int) -> list[float]:
    """At most `max_points` values, each the max of its bucket (a spike stays visible)."""
    n = len(values)
    if n <= max_points:
        return list(values)
    out = []
    for i in range(max_points):
        a, b = i * n // max_points, (i + 1) * n // max_points
        out.append(max(values[a:b]))
    return out


@dataclass(frozen=True)
class MemorySample:
    t: float                  # time.time()
    used: int                 # allocator bytes on CUDA, process RSS on CPU
    reserved: int | None      # CUDA allocator reserved; None on CPU


class MemoryHistory:
    """The device's memory over the last `window_s` seconds, shared by all sessions."""

    def __init__(self, device=None, window_s: float = 300.0, min_interval_s: float = 0.5,
                 reader=read_memory):
        self.device = device
        self.window_s = window_s
        self.min_interval_s = min_interval_s
        self._read = reader
        self._lock = threading.Lock()
        self._samples: deque[MemorySample] = deque(maxlen=int(window_s / max(min_interval_s, 0.05)) + 2)
        self._last: MemoryReading | None = None
        self._last_t = 0.0

    def sample(self) -> MemoryReading:
        """The current reading; reads the device at most every `min_interval_s` and records it."""
        now = time.time()
        with self._lock:
            if self._last is not None and now - self._last_t < self.min_interval_s:
                return self._last
        reading = self._read(self.device)
        used = reading.allocated if reading.kind == "cuda" else (reading.rss or 0)
        with self._lock:
            self._last, self._last_t = reading, now
            self._samples.append(MemorySample(now, int(used), reading.reserved if reading.kind == "cuda" else None))
            while self._samples and now - self._samples[0].t > self.window_s:
                self._samples.popleft()
        return reading

    def series(self, max_points: int = 240) -> list[MemorySample]:
        with self._lock:
            samples = list(self._samples)
        if len(samples) <= max_points:
            return samples
        stride = len(samples) / max_points
        return [samples[int(i * stride)] for i in range(max_points)]
