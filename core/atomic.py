"""Write a file so that its final name only ever holds a complete file.

The gallery serves the output folder as files appear in it; a server killed (SIGTERM, OOM) in the
middle of `Image.save(path)` used to leave a 0-byte or truncated PNG at the name the gallery shows.
`write_atomic` writes to a hidden temporary name in the same folder ('.NAME.tmp-<random>'), then
`os.replace`s it onto the final name (atomic on POSIX and Windows within one file system); on any
error, KeyboardInterrupt and SystemExit included, the temporary file is removed and the final name
is left as it was.
"""
from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Callable

TMP_MARK = ".tmp-"


def temp_name(path: Path) -> Path:
    """'.NAME.tmp-<hex>' next to `path`: hidden, and never mistaken for an output by its suffix."""
    return path.with_name(f".{path.name}{TMP_MARK}{secrets.token_hex(4)}")


def write_atomic(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Call `write(tmp)` to write the whole file at a temporary name, then move it onto `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass
        raise
    return path
