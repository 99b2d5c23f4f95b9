"""Visitors' uploads do not pile up in the temp folder (issue 13).

Every file a browser or API client uploads (`/gradio_api/upload`: a start image, a PNG to read, up to
25 MiB each, anonymous on a public studio) lands in Gradio's upload folder (GRADIO_TEMP_DIR, /tmp/gradio by
default) and stays there until the server stops. The janitor sweeps that folder on a timer: an upload is
deleted once it is older than `ttl_s` (its event has long read it by then), and when the uploads together
exceed `cap_bytes` the oldest go first until they fit, so a burst cannot fill the disk before they age out.
It deletes only files the Blocks recorded as uploads, and only inside the upload folder; Gradio's cached
copies of the studio's own results (the gallery) are not touched.
"""
from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("atelier.uploads")


@dataclass
class SweepReport:
    deleted: int = 0
    deleted_bytes: int = 0
    kept: int = 0
    kept_bytes: int = 0


class UploadJanitor:
    def __init__(self, demo, ttl_s: float, cap_bytes: int, every_s: float):
        self._demo = weakref.ref(demo)      # the janitor never keeps a closed studio alive
        self.ttl_s = float(ttl_s)
        self.cap_bytes = int(cap_bytes)
        self.every_s = float(every_s)
        self.sweeps = 0                     # completed sweeps (tests wait on `swept` for the next one)
        self.swept = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def folder(self, demo) -> Path | None:
        app = getattr(demo, "server_app", None)
        d = getattr(app, "uploaded_file_dir", None)
        return Path(d).resolve() if d else None

    def sweep(self, now: float | None = None) -> SweepReport:
        """One pass: delete uploads past their age, then the oldest while the rest exceed the cap."""
        import time

        demo = self._demo()
        report = SweepReport()
        if demo is None:
            return report
        root = self.folder(demo)
        uploads: set[str] = getattr(demo, "upload_file_set", set())
        if root is None:
            return report
        now = time.time() if now is None else now
        files = []
        for name in list(uploads):          # a copy: the upload route adds to the set while this runs
            path = Path(name)
            try:
                resolved = path.resolve()
                st = path.stat()
            except OSError:                 # already gone (Gradio's own cleanup, or a previous sweep)
                uploads.discard(name)
                continue
            if not resolved.is_relative_to(root) or not path.is_file():
                continue
            files.append((st.st_mtime, st.st_size, name, path))
        files.sort()                        # oldest first
        total = sum(size for _, size, _, _ in files)
        for mtime, size, name, path in files:
            if now - mtime > self.ttl_s or total > self.cap_bytes:
                if self._delete(path, root):
                    uploads.discard(name)
                    report.deleted += 1
                    report.deleted_bytes += size
                    total -= size
                    continue
            report.kept += 1
            report.kept_bytes += size
        if report.deleted:
            log.info("deleted %d upload(s), %.1f MiB; %d kept (%.1f MiB)", report.deleted,
                     report.deleted_bytes / 2**20, report.kept, report.kept_bytes / 2**20)
        return report

    @staticmethod
    def _delete(path: Path, root: Path) -> bool:
        try:
            path.unlink()
        except FileNotFoundError:
            return True
        except OSError as exc:
            log.warning("could not delete an old upload: %s", exc.strerror)
            return False
        parent = path.parent                # Gradio keeps each upload in a folder of its own (its hash)
        if parent.resolve() != root and parent.resolve().is_relative_to(root):
            try:
                parent.rmdir()              # only if empty
            except OSError:
                pass
        return True

    def start(self) -> "UploadJanitor":
        self._thread = threading.Thread(target=self._loop, name="atelier-upload-janitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            demo = self._demo()
            if demo is None or not getattr(demo, "is_running", True):
                return
            try:
                self.sweep()
            except Exception:               # never let a cleanup error end the cleanup
                log.exception("upload sweep failed")
            del demo
            with self.swept:
                self.sweeps += 1
                self.swept.notify_all()

    def wait_sweeps(self, n: int, timeout: float) -> bool:
        """Wait until `n` more sweeps have completed (for tests and shutdown)."""
        with self.swept:
            target = self.sweeps + n
            return self.swept.wait_for(lambda: self.sweeps >= target, timeout)


def start_upload_janitor(demo, settings) -> UploadJanitor:
    return UploadJanitor(demo, settings.upload_ttl_s, settings.upload_cap_bytes, settings.upload_sweep_s).start()
