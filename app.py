"""Atelier: `python app.py` starts the studio UI; `python app.py SUBCOMMAND` runs the CLI."""
from __future__ import annotations

import argparse
import os
import sys


def _serve(argv: list[str]) -> int:
    from core.settings import Settings
    from pipelines.services import build_services

    p = argparse.ArgumentParser(prog="app.py", description="Start the Atelier studio.")
    p.add_argument("--host", default=None, help="listen address (default 127.0.0.1; 0.0.0.0 on Spaces)")
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--share", action="store_true", help="create a public Gradio share link")
    p.add_argument("--auth", default=None, help="user:password (or env ATELIER_AUTH)")
    p.add_argument("--device", default=None)
    p.add_argument("--model", action="append", default=[], help="extra model path or hub id (repeatable)")
    p.add_argument("--queue-size", type=int, default=None)
    a = p.parse_args(argv)
    auth = tuple(a.auth.split(":", 1)) if a.auth and ":" in a.auth else None
    if a.auth and auth is None:
        print("error: --auth must be user:password", file=sys.stderr)
        return 2
    host = a.host
    if host is None and os.environ.get("SPACE_ID"):
        host = "0.0.0.0"   # Hugging Face Spaces routes to the container's port
    settings = Settings.from_env(host=host, port=a.port, share=a.share or None, auth=auth, device=a.device,
                                 extra_models=tuple(a.model) or None, queue_max_size=a.queue_size)
    services = build_services(settings)
    from ui.studio import launch

    launch(services)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] == "serve" or argv[0].startswith("--"):
        return _serve(argv[1:] if argv and argv[0] == "serve" else argv)
    from core.settings import Settings
    from cli.main import dispatch
    from pipelines.services import build_services

    return dispatch(argv, build_services(Settings.from_env()))


if __name__ == "__main__":
    sys.exit(main())
