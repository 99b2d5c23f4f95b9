"""This browser's results across runs: the last N images with their parameters, kept in the browser
(`gr.BrowserState`, the page's localStorage) so they survive a reload. No Gradio here.

The stored list is only a record of paths under the studio's output folder: a path that is gone, or that
points anywhere else (a stored value is the browser's, so it is checked like any input), is dropped
before it is shown."""
from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any, Iterable

HISTORY_MAX = 48              # images kept per browser; the oldest go first
HISTORY_KEY = "atelier-history"
# what of an image's parameters history keeps (enough to send them back; not the per-image timings)
_DROP = ("latency_ms", "peak_vram_bytes", "device", "dtype")


def entry(path: str, caption: str, params: dict[str, Any]) -> dict[str, Any]:
    return {"path": str(path), "caption": caption, "params": {k: v for k, v in params.items() if k not in _DROP}}


def add(history: list | None, items: Iterable, limit: int = HISTORY_MAX) -> list[dict[str, Any]]:
    """`items` (the latest job's ResultItems, first first) in front of `history`, without repeats,
    cut to `limit`."""
    new = [entry(it.path, it.caption, it.params) for it in items]
    seen = {e["path"] for e in new}
    kept = [e for e in (history or []) if isinstance(e, dict) and e.get("path") not in seen]
    return (new + kept)[:limit]


def _inside(path: str, root: Path) -> bool:
    try:
        p = Path(path).resolve()
        return p.is_file() and p.is_relative_to(root)
    except (OSError, ValueError, TypeError):
        return False


def valid(history: list | None, output_dir: str | Path) -> list[dict[str, Any]]:
    """The stored entries that still name a file under `output_dir`, in order."""
    root = Path(output_dir).resolve()
    return [e for e in (history or []) if isinstance(e, dict) and isinstance(e.get("path"), str)
            and isinstance(e.get("params"), dict) and _inside(e["path"], root)]


def gallery(history: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(e["path"], e.get("caption") or "") for e in history]


def browser_secret(cache_dir: str | Path) -> str:
    """The key the stored history is encrypted with, kept in the cache folder so a restart of the studio
    can still read what browsers stored (Gradio's default is a new random key per process)."""
    f = Path(cache_dir) / "ui-history-secret"
    try:
        text = f.read_text().strip()
        if len(text) >= 16:
            return text
    except OSError:
        pass
    key = secrets.token_urlsafe(24)
    try:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.touch(mode=0o600)
        f.write_text(key)
    except OSError:        # a read-only cache: history then lasts as long as this process
        pass
    return key
