"""CLI error convention: one clear line on stderr, non-zero exit, no traceback."""
from __future__ import annotations

import functools
import os
import sys

from core.errors import AtelierError


def cli_errors(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs) -> int:
        try:
            return fn(*args, **kwargs) or 0
        except AtelierError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("error: interrupted", file=sys.stderr)
            return 130
        except Exception as exc:  # last resort: still one line, with a hint for bug reports
            if os.environ.get("ATELIER_DEBUG"):
                raise
            print(f"error: unexpected {type(exc).__name__}: {exc} (set ATELIER_DEBUG=1 for a traceback)", file=sys.stderr)
            return 1
    return wrapper
