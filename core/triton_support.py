"""What the studio's Triton kernels (models/fir_triton.py, models/filtered_lrelu_triton.py, optim/fp8_conv.py)
need to know before they launch: whether Triton imports at all, and whether it runs in its CPU interpreter."""
from __future__ import annotations

import functools
import os


@functools.lru_cache(maxsize=None)
def import_error() -> str | None:
    """None if Triton imports, else why not (for a toggle's note)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as e:  # ImportError, or a broken install
        return f"Triton is not importable ({type(e).__name__}: {e})"
    return None


def interpreting() -> bool:
    """TRITON_INTERPRET=1: kernels run on the CPU in Triton's interpreter (how the CPU tests run them)."""
    return os.environ.get("TRITON_INTERPRET", "") == "1"
