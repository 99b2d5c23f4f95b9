"""Atelier: `python app.py` starts the studio UI; `python app.py SUBCOMMAND` runs the CLI."""
from __future__ import annotations

import argparse
import sys


def _serve(argv: list[str]) -> int:
    # on a ZeroGPU Space `spaces` must be imported before anything can initialise CUDA
    from ui.zerogpu import import_spaces_early

    import_spaces_early()
    from core.settings import MODES, VISITOR_CAPABILITIES, Settings, parse_allow
    from pipelines.services import build_services

    p = argparse.ArgumentParser(prog="app.py", description="Start the Atelier studio.")
    p.add_argument("--host", default=None,
                   help="listen address (default 127.0.0.1, or env GRADIO_SERVER_NAME; 0.0.0.0 on Spaces)")
    p.add_argument("--port", type=int, default=None, help="default 7860, or env GRADIO_SERVER_PORT")
    p.add_argument("--share", action="store_true", help="create a public Gradio share link (use with --auth)")
    p.add_argument("--auth", default=None, help="user:password (or env ATELIER_AUTH)")
    p.add_argument("--mode", choices=MODES, default=None,
                   help="what visitors may do: 'public' = the catalogue and model folders only; 'local' = any path "
                        "or hub id. Default: public with --share, on a Space or a non-loopback host (env ATELIER_MODE)")
    p.add_argument("--allow", default=None, metavar="LIST",
                   help=f"public mode: also let visitors {', '.join(VISITOR_CAPABILITIES)} (comma-separated; "
                        "env ATELIER_ALLOW)")
    p.add_argument("--data-dir", action="append", default=[],
                   help="public mode with --allow train: a folder visitors may train on (repeatable; "
                        "env ATELIER_DATA_DIRS)")
    p.add_argument("--device", default=None)
    p.add_argument("--model", action="append", default=[], help="extra model path or hub id (repeatable)")
    p.add_argument("--queue-size", type=int, default=None)
    p.add_argument("--warmup", action="store_true",
                   help="load the default model and generate one image at start, so /readyz turns 200 "
                        "(or env ATELIER_WARMUP=1)")
    a = p.parse_args(argv)
    auth = tuple(a.auth.split(":", 1)) if a.auth and ":" in a.auth else None
    if a.auth and auth is None:
        print("error: --auth must be user:password", file=sys.stderr)
        return 2
    try:
        allow = parse_allow(a.allow) if a.allow is not None else None
        settings = Settings.from_env(host=a.host, port=a.port, share=a.share or None, auth=auth, device=a.device,
                                     extra_models=tuple(a.model) or None, queue_max_size=a.queue_size,
                                     mode=a.mode, allow=allow, data_dirs=tuple(a.data_dir) or None,
                                     warmup=a.warmup or None)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
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
