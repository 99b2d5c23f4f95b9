"""Per-session state and the shared GPU queue board.

A `SessionState` lives in one `gr.State`: Gradio gives every browser session
its own copy, so one session's job, progress and Stop never reach another's.
The `GpuQueue` is shared (there is one GPU); it only knows tickets, which lets
the side panel say "position 2 of 3" without exposing whose jobs those are.
"""
from __future__ import annotations

import itertools
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

from core.types import Job
from telemetry.live import JobTracker


@dataclass
class Ticket:
    id: int
    cancelled: bool = False


class GpuQueue:
    """Tickets waiting for, and holding, the GPU. Positions are 1-based."""

    def __init__(self):
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)   # notified whenever a ticket joins, starts or leaves
        self._ids = itertools.count(1)
        self._waiting: list[int] = []
        self._running: set[int] = set()

    def join(self) -> Ticket:
        with self._lock:
            t = Ticket(next(self._ids))
            self._waiting.append(t.id)
            self._changed.notify_all()
            return t

    def try_join(self, max_waiting: int | None) -> Ticket | None:
        """A ticket, or None at once when `max_waiting` tickets already wait (None or 0 = unbounded). One
        check-and-join under the lock, so concurrent callers never overfill the queue."""
        with self._lock:
            if max_waiting and len(self._waiting) >= max_waiting:
                return None
            t = Ticket(next(self._ids))
            self._waiting.append(t.id)
            self._changed.notify_all()
            return t

    def start(self, ticket: Ticket) -> None:
        with self._lock:
            if ticket.id in self._waiting:
                self._waiting.remove(ticket.id)
            self._running.add(ticket.id)
            self._changed.notify_all()

    def leave(self, ticket: Ticket) -> None:
        with self._lock:
            if ticket.id in self._waiting:
                self._waiting.remove(ticket.id)
            self._running.discard(ticket.id)
            self._changed.notify_all()

    def withdraw(self, ticket: Ticket) -> bool:
        """Take `ticket` off the board if it still waits (a started one is left to its job); True if it did."""
        with self._lock:
            if ticket.id not in self._waiting:
                return False
            self._waiting.remove(ticket.id)
            self._changed.notify_all()
            return True

    def is_waiting(self, ticket: Ticket) -> bool:
        with self._lock:
            return ticket.id in self._waiting

    def position(self, ticket: Ticket | None) -> int | None:
        """1 = next to run; None when not waiting."""
        with self._lock:
            if ticket is None or ticket.id not in self._waiting:
                return None
            return self._waiting.index(ticket.id) + 1

    def counts(self) -> tuple[int, int]:
        """(waiting, running)."""
        with self._lock:
            return len(self._waiting), len(self._running)

    def wait_for(self, predicate, timeout: float) -> bool:
        """Block until predicate(waiting, running) holds (checked on every change) or `timeout` seconds pass;
        returns whether it holds."""
        with self._changed:
            return self._changed.wait_for(lambda: predicate(len(self._waiting), len(self._running)), timeout)


@dataclass
class ResultItem:
    path: str                 # the PNG/GIF written under the output folder (with its parameters embedded)
    params: dict              # what went into the file's metadata
    caption: str = ""


@dataclass
class SessionState:
    """Everything one browser session owns. Mutated in place by the event handlers."""

    tracker: JobTracker = field(default_factory=JobTracker)
    id: str = field(default_factory=lambda: uuid.uuid4().hex)   # owner of the models this visitor added
    job: Job | None = None                                   # the running job
    tickets: dict[int, Ticket] = field(default_factory=dict)  # this session's jobs not yet started, by id
    results: list[ResultItem] = field(default_factory=list)
    selected: int | None = None
    comparison: Any = None                     # the last ui.compare.Comparison of this session
    timer_interval: float = 0.0        # what the panel's timer was last set to
    seed_texts: dict[str, str] = field(default_factory=dict)   # the seed field's text per backend, kept across switches
    # whose seed the page's seed field holds: the page opens on StyleGAN; a backend switch or a restore gives
    # the field to that backend (ui/form.py: a diffusion request with StyleGAN's untouched default is random)
    seed_backend: str = "stylegan"

    def __deepcopy__(self, memo):
        # gr.State deep-copies its initial value for each new session; locks cannot be copied,
        # and a new session must start empty anyway
        return SessionState()

    def cancel(self) -> bool:
        """Stop this session's jobs: the running one and any still waiting. True if there was one."""
        hit = False
        for t in self.tickets.values():
            if not t.cancelled:
                t.cancelled = True
                hit = True
        if self.job is not None and not self.job.cancelled:
            self.job.cancel()
            hit = True
        return hit

    def waiting_ticket(self) -> Ticket | None:
        """The first of this session's jobs still waiting (not cancelled), for its queue position."""
        return next((t for t in self.tickets.values() if not t.cancelled), None)

    def selected_item(self) -> ResultItem | None:
        if self.selected is None or not (0 <= self.selected < len(self.results)):
            return None
        return self.results[self.selected]


def new_session() -> SessionState:
    return SessionState()
