"""Runs one session's generation job on a worker thread and reports while it runs.

The Gradio event is a generator: it starts the worker, then wakes a few times
a second to yield progress and previews, and ends with the saved results.
Stop sets the job's cancel token; the pipeline stops at its next step, so a job
stops within one step and the GPU is free for the next one. What it finished
before the stop (StyleGAN's done batches) comes back in a cancelled result and
is saved and shown like a finished job's images, labelled as stopped.
"""
from __future__ import annotations

import contextvars
import logging
import threading
import uuid
import weakref
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Iterator

from core.device import pick_device, synchronizer
import core.errors as errors
from core.errors import AtelierError, Cancelled
from core.pnginfo import save_png
from core.types import GenerationRequest, Job, ProgressEvent, StyleGANParams
from pipelines.services import Services
from pipelines.stylegan import write_animation
from telemetry.live import DONE, FAILED, STOPPED, MemoryHistory
from telemetry.metrics import StudioMetrics
from ui import zerogpu
from ui.access import redact_paths
from ui.compare import run_comparison
from ui.controls import JobSpec, seeds_used
from ui.state import GpuQueue, ResultItem, SessionState, Ticket

log = logging.getLogger("atelier.ui")
DEFAULT_BACKEND = "stylegan"   # the backend the studio opens on; /readyz waits for its default model
MAX_GALLERY = 200          # more images than this are saved, but the gallery shows the first ones


@dataclass
class Progress:
    """One update from a running job, for the event generator to turn into component updates."""

    done: bool = False
    preview: Any = None                        # a new PIL preview, or None when unchanged
    items: list[ResultItem] = field(default_factory=list)
    state: str = ""                            # DONE | STOPPED | FAILED once done
    message: str = ""
    error: Exception | None = None
    quiet: bool = False                        # nothing to show (a stale event of a stopped job)


class StudioRuntime:
    """What the studio shares across sessions: services, the GPU queue board, memory history, metrics.
    Built once per app by build_app; nothing here is module-level."""

    def __init__(self, services: Services, poll_s: float = 0.25):
        self.services = services
        self.settings = services.settings
        try:
            self.device = pick_device(self.settings.device)
        except AtelierError:
            self.device = pick_device(None)
        self.queue = GpuQueue()
        self.memory = MemoryHistory(self.device)
        self.metrics = StudioMetrics()
        # what a visitor reads in an error: public mode names no server path
        self.visitor_text: Callable[[str], str] = redact_paths if self.settings.public else str
        self.gpu_lock = threading.Lock()       # a worker abandoned by its event still holds the GPU until it ends
        # ZeroGPU: the job body runs in a worker process that holds a GPU for a duration sized from the request
        self.bridge: zerogpu.GpuBridge | None = None
        self._gpu_call: Callable | None = None
        if zerogpu.on_zerogpu():
            self.bridge = zerogpu.GpuBridge()
            self._gpu_call = zerogpu.decorate(self._run_in_gpu_worker, zerogpu.gpu_seconds)
        self.poll_s = poll_s
        # weak: Gradio owns the sessions (and expires them); this map only finds one when its tab closes
        self._sessions: weakref.WeakValueDictionary[str, SessionState] = weakref.WeakValueDictionary()
        self._sessions_lock = threading.Lock()
        # The browser's tickets still on the board -> the session hash of the tab that queued them. A closed tab's
        # are found here by its hash: Gradio drops its queued events, so nothing of the tab comes back to leave
        # the board, and the SessionState remembered at page load is not always the object that queued them.
        self._waiting: dict[int, tuple[Ticket, str | None]] = {}
        # shutdown (SIGTERM): no new jobs once draining; the running ones are tracked so drain() can wait
        self.draining = threading.Event()
        self._active: set[Job] = set()
        self._active_cv = threading.Condition()
        # readiness (/readyz): the default model's id once known, and the start-up warm-up if one was asked for
        self._default_id: str | None = None
        self._warmup: threading.Thread | None = None
        self._warmup_failed = False

    # -- readiness (/readyz) ----------------------------------------------------------------
    def readiness(self) -> tuple[bool, str]:
        """(ready, short reason): ready when not draining and the model manager holds the default model
        (DEFAULT_BACKEND's default) after one completed generation with it, a job's or the warm-up's.
        The reason names no model and no path: /readyz answers it without a sign-in."""
        if self.draining.is_set():
            return False, "shutting down"
        if self._default_id is None:
            try:
                self._default_id = self.services.catalogue.default(DEFAULT_BACKEND).id
            except AtelierError:
                return False, "no default model is installed"
        if self.bridge is not None:   # ZeroGPU: models load in the GPU worker for each call, none stays here
            return True, "ready"
        if self.services.manager.holds_warm(DEFAULT_BACKEND, self._default_id):
            return True, "ready"
        if self._warmup_failed:
            return False, "the default model failed to warm up"
        if (self._warmup is not None and self._warmup.is_alive()) or self.active_jobs():
            return False, "loading the default model"
        return False, "the default model is not loaded yet (no generation has run)"

    def start_warmup(self) -> threading.Thread:
        """Load the default model and generate one image with it on a background thread (`--warmup`), so
        /readyz turns 200 without waiting for a first visitor."""
        def warm():
            try:
                with self.gpu_lock:
                    if self.draining.is_set():
                        return
                    req = GenerationRequest(DEFAULT_BACKEND, None, StyleGANParams(seeds=(0,), batch_size=1))
                    pipe = self.services.manager.get(req)
                    if getattr(getattr(getattr(pipe, "loaded", None), "G", None), "c_dim", 0):
                        req = replace(req, params=replace(req.params, class_index=0))   # a conditional model
                    self.services.manager.generate(req)
            except Exception as exc:   # the studio still serves; /readyz says the warm-up failed
                self._warmup_failed = True
                log.error("warm-up of the default model failed: %s", self.visitor_text(str(exc)))

        self._warmup = threading.Thread(target=warm, name="atelier-warmup", daemon=True)
        self._warmup.start()
        return self._warmup

    # -- shutdown ---------------------------------------------------------------------
    def active_jobs(self) -> list[Job]:
        with self._active_cv:
            return list(self._active)

    def drain(self, grace_s: float = 30.0, cancel_wait_s: float = 30.0) -> dict[str, int]:
        """Stop taking new jobs; let running ones finish for up to `grace_s` seconds, then cancel the rest
        (they stop at their next step) and wait up to `cancel_wait_s` for them. Returns how many
        finished, were cancelled, and were still running when it gave up."""
        self.draining.set()
        with self._active_cv:
            running = len(self._active)
            self._active_cv.wait_for(lambda: not self._active, timeout=max(grace_s, 0))
            cancelled = list(self._active)
            for job in cancelled:
                job.cancel()
            self._active_cv.wait_for(lambda: not self._active, timeout=max(cancel_wait_s, 0))
            left = len(self._active)
        return {"finished": running - len(cancelled), "cancelled": len(cancelled) - left, "left": left}

    # -- sessions (so that closing a tab stops its job) -----------------------------
    def remember(self, session_hash: str | None, session: SessionState) -> None:
        if session_hash:
            with self._sessions_lock:
                self._sessions[session_hash] = session

    def forget(self, session_hash: str | None) -> None:
        """The tab closed (Gradio's unload): stop its running job and take its waiting ones off the board.
        Gradio drops a closed tab's queued events, so their `run` never comes round to leave the board itself:
        without this their places would stay taken (and count against --queue-size) for good. Gradio may have
        deleted the tab's session state first (its delete_callback cancels the tickets): those are found too."""
        with self._sessions_lock:
            session = self._sessions.pop(session_hash, None) if session_hash else None
            tickets = [t for t, owner in self._waiting.values() if session_hash and owner == session_hash]
        if session is not None:
            session.cancel()
        for t in tickets:
            t.cancelled = True
        self.release_cancelled()

    def release_cancelled(self) -> int:
        """Take every cancelled browser ticket that still waits off the board (a Stop, a closed tab, an expired
        session); forget the ones that no longer wait. Returns how many places were given back."""
        with self._sessions_lock:
            tickets = [t for t, _owner in self._waiting.values()]
        freed = 0
        for t in tickets:
            if t.cancelled and self.queue.withdraw(t):
                freed += 1
            if t.cancelled or not self.queue.is_waiting(t):
                with self._sessions_lock:
                    self._waiting.pop(t.id, None)
        return freed

    # -- running a job ----------------------------------------------------------------
    def enqueue(self, session: SessionState, kind: str) -> Ticket:
        """A place in the GPU queue for a job this session is about to submit."""
        ticket = self.queue.join()
        session.tickets[ticket.id] = ticket
        with self._sessions_lock:
            for tid in [tid for tid, (t, _o) in self._waiting.items() if not self.queue.is_waiting(t)]:
                del self._waiting[tid]         # started or left since: nothing to release
            self._waiting[ticket.id] = (ticket, _event_session_hash())
        session.tracker.queued(kind)
        return ticket

    def withdraw(self, session: SessionState) -> None:
        """Take this session's cancelled tickets off the board, so others move up at once. They stay in
        the session's map: when their event comes round, `run` sees them cancelled and ends it."""
        for t in session.tickets.values():
            if t.cancelled:
                self.queue.leave(t)

    def run(self, session: SessionState, spec: JobSpec, ticket_id: int | None = None) -> Iterator[Progress]:
        """Run `spec` for `session`. `ticket_id` is the place its Generate click took (None from the API:
        take one now). A ticket cancelled while it waited ends the event at once."""
        ticket = session.tickets.get(int(ticket_id)) if ticket_id else None
        if self.draining.is_set():             # shutting down (SIGTERM): no new jobs
            if ticket is not None:
                self.queue.leave(ticket)
                session.tickets.pop(ticket.id, None)
            msg = "The studio is shutting down and takes no new jobs."
            session.tracker.finish(FAILED, {}, message=msg)
            yield Progress(done=True, state=FAILED, message=msg)
            return
        if ticket is None:
            ticket = self.enqueue(session, spec.kind)
        if ticket.cancelled:
            self.queue.leave(ticket)
            session.tickets.pop(ticket.id, None)
            # a newer job of this session may be waiting or running by now: leave its display alone
            quiet = session.job is not None or session.waiting_ticket() is not None
            if not quiet:
                session.tracker.finish(STOPPED, {}, message="Stopped before it started.")
            yield Progress(done=True, state=STOPPED, message="Stopped before it started.", quiet=quiet)
            return
        self.queue.start(ticket)
        tracker = session.tracker
        device = pick_device(spec.request.device or self.services.manager.default_device)
        job = Job(on_progress=tracker.on_progress, sync=synchronizer(device))
        session.job = job                      # Stop now reaches the job ...
        session.tickets.pop(ticket.id, None)   # ... so the ticket can go
        if ticket.cancelled:                   # Stop landed between the check above and now
            job.cancel()
        tracker.start(spec.kind, job)
        box: dict[str, Any] = {}

        def work():
            try:
                _work()
            finally:
                with self._active_cv:
                    self._active.discard(job)
                    self._active_cv.notify_all()

        def _work():
            with self.gpu_lock:
                if job.cancelled:       # stopped while an abandoned worker still held the GPU
                    box["error"] = Cancelled("cancelled by the user")
                    return
                try:
                    if self._gpu_call is not None:
                        box["items"], box["result"] = self._call_gpu_worker(spec, job, tracker)
                    else:
                        box["items"], box["result"] = self._execute(spec, job, tracker)
                except BaseException as exc:   # handed to the event thread, which reports it
                    box["error"] = exc

        # the thread runs in a copy of this context: ZeroGPU reads the visitor's request (for quotas) from it
        worker = threading.Thread(target=contextvars.copy_context().run, args=(work,),
                                  name=f"atelier-job-{ticket.id}", daemon=True)
        with self._active_cv:
            self._active.add(job)
        if self.draining.is_set():             # drain() began after the check above: stop at the first step
            job.cancel()
        worker.start()
        seen_preview = tracker.latest_preview()[0]
        try:
            while worker.is_alive():
                worker.join(self.poll_s)
                if self.bridge is not None:
                    self._relay_gpu_worker(job, tracker)
                seq, preview = tracker.latest_preview()
                if seq != seen_preview:
                    seen_preview = seq
                    yield Progress(preview=preview)
                else:
                    yield Progress()
            yield self._conclude(session, spec, job, box)
        finally:
            if worker.is_alive():   # the event was abandoned (tab closed, client gone): do not leave work running
                job.cancel()
            self.queue.leave(ticket)
            if session.job is job:
                session.job = None

    def _conclude(self, session: SessionState, spec: JobSpec, job: Job, box: dict) -> Progress:
        tracker = session.tracker
        backend = spec.request.backend
        err = box.get("error")
        snap = tracker.snapshot()
        result = box.get("result")
        if isinstance(err, Cancelled) or (err is None and getattr(result, "cancelled", False)):
            msg = f"Stopped at step {snap.step}/{snap.total}." if snap.total else "Stopped."
            items: list[ResultItem] = (box.get("items") or []) if err is None else []
            if not items:
                tracker.finish(STOPPED, job.timings_ms, message=msg)
                self.metrics.observe_job(backend, "stopped", job.timings_ms)
                return Progress(done=True, state=STOPPED, message=msg)
            # Stop keeps what is finished: the images done before the stop are saved, shown and timed
            p = spec.request.params
            asked = len(p.seeds) if backend == "stylegan" else int(getattr(p, "batch_size", len(items)))
            total_ms = sum(job.timings_ms.values())
            msg = f"{msg.rstrip('.')}: kept {len(items)} of {asked} images in {total_ms / 1000:.2f} s"
            if len(items) > MAX_GALLERY:
                msg += f" (showing the first {MAX_GALLERY}; all saved in {Path(items[0].path).parent})"
            tracker.finish(STOPPED, job.timings_ms, images=len(items), peak_bytes=getattr(result, "peak_memory_bytes", None),
                           message=msg)
            self.metrics.observe_job(backend, "stopped", job.timings_ms)
            session.results = items
            session.selected = 0
            return Progress(done=True, state=STOPPED, message=msg, items=items)
        if isinstance(err, ImportError):   # a backend whose optional packages are missing
            err = AtelierError(f"the {backend} backend cannot run here: {err}. Install the packages in requirements.txt")
        if err is not None:
            if not isinstance(err, AtelierError):
                log.exception("generation failed", exc_info=err)
            msg = str(err) if isinstance(err, AtelierError) else f"unexpected error: {type(err).__name__}: {err}"
            msg = self.visitor_text(msg)
            # drop the traceback: its frames hold whatever the failed job had (a refused model's tensors)
            err = err.with_traceback(None)
            box.pop("error", None)
            tracker.finish(FAILED, job.timings_ms, message=msg)
            self.metrics.observe_job(backend, "failed", job.timings_ms)
            return Progress(done=True, state=FAILED, message=msg, error=err)
        if spec.kind == "compare":
            comp = result
            peak = max(comp.reference.peak_bytes, comp.candidate.peak_bytes) or None
            msg = comp.summary()
            tracker.finish(DONE, job.timings_ms, images=2 * len(comp.reference.images), peak_bytes=peak, message=msg)
            self.metrics.observe_job(backend, "done", job.timings_ms, images=2 * len(comp.reference.images))
            session.comparison = comp
            return Progress(done=True, state=DONE, message=msg)
        items: list[ResultItem] = box["items"]
        total_ms = sum(job.timings_ms.values())
        n = len(items) if spec.kind != "images" else len(result.images)
        what = {"style-mix": "style-mix grid", "interpolate": "animation"}.get(spec.kind, "image" if n == 1 else "images")
        msg = f"Done: {n} {what} in {total_ms / 1000:.2f} s" if spec.kind in ("images", "diffusion") else f"Done: {what} in {total_ms / 1000:.2f} s"
        if spec.kind == "diffusion" and items:   # a random seed (empty field) is only known from here
            msg += f" · {seeds_used([it.params for it in items])}"
        if len(items) > MAX_GALLERY:
            msg += f" (showing the first {MAX_GALLERY}; all saved in {Path(items[0].path).parent})"
        notes = list(getattr(result, "notes", []) or []) + skipped_toggles(spec.request.flags, getattr(result, "optimizations", None))
        if notes:
            msg += " — " + "; ".join(notes)
        peak = getattr(result, "peak_memory_bytes", None)
        tracker.finish(DONE, job.timings_ms, images=n, peak_bytes=peak, message=msg)
        self.metrics.observe_job(backend, "done", job.timings_ms, images=n, step_ms=[e.step_ms for e in job.trace if e.step_ms])
        session.results = items
        session.selected = 0 if items else None
        return Progress(done=True, state=DONE, message=msg, items=items)

    # -- ZeroGPU: the same work in a worker process -------------------------------------
    def _run_in_gpu_worker(self, spec: JobSpec) -> dict:
        """The job body as ZeroGPU runs it, in a forked worker that holds the GPU. Takes and returns only
        picklable data; errors travel back as (type, message), since ZeroGPU keeps only a type's name."""
        job = Job(on_progress=self.bridge.report, sync=synchronizer(pick_device(spec.request.device or
                                                                                self.services.manager.default_device)))
        stop = threading.Event()
        self.bridge.watch_cancel(job, stop)
        out: dict = {}
        try:
            out["ok"] = self._execute(spec, job, None)
        except Cancelled:
            out["cancelled"] = True
        except AtelierError as exc:
            out["error"] = (type(exc).__name__, str(exc))
        finally:
            stop.set()
        out["timings"] = dict(job.timings_ms)
        return out

    def _call_gpu_worker(self, spec: JobSpec, job: Job, tracker):
        self.bridge.begin()
        out = self._gpu_call(spec)
        for name, ms in out.get("timings", {}).items():
            job.timings_ms[name] = job.timings_ms.get(name, 0.0) + ms
        self._relay_gpu_worker(job, tracker)
        if out.get("cancelled"):
            raise Cancelled("cancelled by the user")
        if "error" in out:
            cls_name, message = out["error"]
            cls = getattr(errors, cls_name, AtelierError)
            raise (cls if isinstance(cls, type) and issubclass(cls, AtelierError) else AtelierError)(message)
        return out["ok"]

    def _relay_gpu_worker(self, job: Job, tracker) -> None:
        """Studio side, while a ZeroGPU call runs: pass Stop to the worker and its steps to the panel."""
        if job.cancelled:
            self.bridge.cancel_event.set()

        def on_event(stage, step, total, step_ms, message):
            ev = ProgressEvent(stage, step, total, step_ms, None, message)
            job.trace.append(ev)
            tracker.on_progress(ev)
        self.bridge.drain(on_event)

    # -- the work itself, on the worker thread ----------------------------------------
    def _out_path(self, stem: str, suffix: str = ".png") -> Path:
        folder = Path(self.settings.output_dir) / datetime.now().strftime("%Y-%m-%d")
        return folder / f"{datetime.now().strftime('%H%M%S')}-{uuid.uuid4().hex[:6]}-{stem}{suffix}"

    def _execute(self, spec: JobSpec, job: Job, tracker) -> tuple[list[ResultItem], Any]:
        manager = self.services.manager
        req = spec.request
        if spec.kind == "compare":
            return [], run_comparison(manager, req, job)
        if spec.kind in ("images", "diffusion"):
            result = manager.generate(req, job)
            # A stopped job returns a cancelled result holding the images it finished (StyleGAN: the batches
            # done before the stop; diffusion: none, a half-denoised batch is noise). Those are kept as usual.
            if result.cancelled and not result.images:
                return [], result
            with job.stage("save"):
                items = []
                for i, img in enumerate(result.images):
                    meta = dict(result.metadata[i]) if i < len(result.metadata) else {"backend": req.backend}
                    seed = meta.get("seed", i)
                    path = save_png(img, self._out_path(f"seed{seed}"), meta)
                    caption = f"seed {seed}" if req.backend == "stylegan" else f"seed {seed} · {meta.get('steps', '')} steps"
                    if meta.get("class_name"):       # a conditional StyleGAN: the class it drew, by its short name
                        caption += f" · {str(meta['class_name']).rsplit('/', 1)[-1]}"
                    if result.cancelled:
                        caption += " · stopped job"
                    items.append(ResultItem(str(path), meta, caption))
            return items, result
        with job.stage("load"):
            pipe = manager.get(req)
        p = req.params
        base = {"backend": "stylegan", "model": pipe.model_id, "model_hash": pipe.loaded.sha256[:10],
                "arch": pipe.loaded.arch, "truncation_psi": float(p.truncation_psi),
                "truncation_centre": pipe.truncation_centre(p),
                "truncation_cutoff": p.truncation_cutoff, "noise_mode": p.noise_mode,
                "class_index": p.class_index, "flags": req.flags.to_dict(), "device": str(pipe.device)}
        if spec.kind == "style-mix":
            mix = spec.mix
            with job.stage("synthesis"):
                grid, _raw = pipe.style_mix(list(mix.rows), list(mix.cols), mix.layers, p, job)
            with job.stage("save"):
                meta = {**base, "mode": "style-mix", "row_seeds": list(mix.rows), "col_seeds": list(mix.cols),
                        "layers": list(mix.layers), "seeds": list(mix.cols)}
                path = save_png(grid, self._out_path("stylemix"), meta)
            manager.mark_warm(req)
            return [ResultItem(str(path), meta, f"style mix {len(mix.rows)}×{len(mix.cols)}, layers {mix.layers[0]}–{mix.layers[1]}")], None
        if spec.kind == "interpolate":
            seeds = list(p.seeds)
            with job.stage("synthesis"):
                frames = pipe.interpolate(seeds, spec.frames_per_seed, p, space=spec.space, job=job)
            with job.stage("encode"):
                path = write_animation(frames, self._out_path("interp", "." + spec.animation_format), fps=spec.fps)
            manager.mark_warm(req)
            meta = {**base, "mode": "interpolate", "seeds": seeds, "frames_per_seed": spec.frames_per_seed,
                    "space": spec.space, "fps": spec.fps, "frames": len(frames)}
            return [ResultItem(str(path), meta, f"{len(frames)} frames through seeds {seeds}")], None
        raise AtelierError(f"unknown job kind {spec.kind!r}")


def _event_session_hash() -> str | None:
    """The session hash of the tab whose Gradio event is running on this thread (None outside one)."""
    try:
        from gradio.context import LocalContext
    except ImportError:
        return None
    return getattr(LocalContext.request.get(None), "session_hash", None)


def skipped_toggles(flags, report: dict | None) -> list[str]:
    """'fp8 not applied: <reason>' for every toggle the request asked for that did not run."""
    if not report:
        return []
    asked = flags.requested()
    return [f"{name} not applied: {rep.get('reason', 'no reason given')}" for name, rep in report.items()
            if name in asked and isinstance(rep, dict) and not rep.get("applied", True)]
