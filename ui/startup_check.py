"""A patient version of Gradio's "is the server up" check, for loaded machines.

`Blocks.launch` asks `gradio.networking.url_ok(local_url)` whether the server it just started answers,
and raises "When localhost is not accessible, a shareable link must be created" when not. Gradio's
check gives up at the first HEAD that takes over 3 s: on a loaded 2-core machine (CI beside a CPU hog,
a busy Space at start) the freshly started server is often slower than that, and the studio then
refuses to start although nothing is wrong. This one polls until the server answers, for as long as
`deadline_s`, and treats a slow or refused connection as "not yet" rather than "never".
"""
from __future__ import annotations

import time
import warnings

STARTUP_DEADLINE_S = 120.0
_OK = (200, 401, 301, 302, 303, 307, 308)       # what Gradio's own check accepts (auth, redirects)


def patient_url_ok(url: str, deadline_s: float = STARTUP_DEADLINE_S, poll_s: float = 0.25,
                   request_timeout_s: float = 10.0) -> bool:
    import httpx

    end = time.monotonic() + deadline_s
    while True:
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore")
                if httpx.head(url, timeout=request_timeout_s, verify=False).status_code in _OK:
                    return True
        except (ConnectionError, httpx.TransportError):
            pass                                 # not listening yet, or too busy to answer in time
        if time.monotonic() >= end:
            return False
        time.sleep(poll_s)                       # a poll interval; the deadline decides, not this


def install() -> None:
    """Make Gradio's launch use the patient check (idempotent; process-wide, as Gradio's own is)."""
    from gradio import networking

    if networking.url_ok is not patient_url_ok:
        networking.url_ok = patient_url_ok
