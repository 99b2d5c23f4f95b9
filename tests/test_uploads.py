"""Visitors' uploads are cleaned up (issue 13): files uploaded over real HTTP to the running studio's
/gradio_api/upload are deleted once older than the studio's upload TTL and, oldest first, while together they
exceed its cap; nothing else in (or outside) the upload folder is touched, and the sweep runs on its own."""
from __future__ import annotations

import os
import time
from pathlib import Path

import httpx

from tests.ui_helpers import running_studio

MiB = 1 << 20


def upload(demo, name: str, size: int) -> Path:
    r = httpx.post(demo.local_url.rstrip("/") + "/gradio_api/upload",
                   files=[("files", (name, os.urandom(size), "application/octet-stream"))], timeout=120)
    assert r.status_code == 200, r.text
    (path,) = r.json()
    assert Path(path).is_file()
    return Path(path)


def age(path: Path, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t))


def test_uploads_past_their_age_or_over_the_cap_are_deleted_oldest_first(tmp_path, testdata):
    # the timer is set far out: this test sweeps by hand, so nothing happens between its steps
    with running_studio(tmp_path, upload_ttl_s=600, upload_cap_bytes=3 * MiB, upload_sweep_s=3600) as demo:
        janitor = demo.atelier_uploads
        files = [upload(demo, f"u{i}.bin", MiB) for i in range(4)]
        for f, seconds in zip(files, (1000, 30, 20, 10)):       # u0 is past the 600 s age
            age(f, seconds)
        root = Path(demo.server_app.uploaded_file_dir).resolve()
        not_an_upload = root / "gradio-cache-copy.png"          # e.g. Gradio's cached copy of a result
        not_an_upload.write_bytes(b"x" * MiB)
        age(not_an_upload, 5000)
        outside = tmp_path / "outside.bin"                      # recorded as an upload, but outside the folder
        outside.write_bytes(b"y")
        age(outside, 5000)
        demo.upload_file_set.add(str(outside))

        report = janitor.sweep()
        assert report.deleted == 1 and not files[0].exists() and not files[0].parent.exists()
        assert all(f.exists() for f in files[1:])               # 3 MiB left: at the cap, not over it
        assert not_an_upload.exists() and outside.exists()

        newest = upload(demo, "u4.bin", MiB)                    # 4 MiB: over the cap, the oldest goes
        report = janitor.sweep()
        assert report.deleted == 1 and report.kept_bytes == 3 * MiB
        assert not files[1].exists() and files[2].exists() and files[3].exists() and newest.exists()
        assert str(files[1]) not in demo.upload_file_set and str(newest) in demo.upload_file_set


def test_the_sweep_runs_on_its_own(tmp_path, testdata):
    with running_studio(tmp_path, upload_ttl_s=0, upload_sweep_s=0.2) as demo:
        path = upload(demo, "drop.png", 64 * 1024)
        assert demo.atelier_uploads.wait_sweeps(2, timeout=120), "the janitor did not sweep"
        assert not path.exists()
