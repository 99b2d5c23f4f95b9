"""Run in a child process by tests/test_a1111_oom.py: the studio served on a free port of 127.0.0.1 with a tiny
Stable Diffusion model, then held under an address-space limit (RLIMIT_AS) so a request too large for it really
fails to allocate, as a GPU's allocator does with a request too large for its memory.

    python tests/oom_server_child.py SD_FOLDER OUT_DIR

Prints one JSON line once it serves under the limit ({"url", "baseline_rss", "headroom"}), then answers each
line read on stdin: "rss" with {"rss": <resident bytes>}; end of input ends the process. A child because the
limit cannot be lifted again in the process it is set in.
"""
from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx            # noqa: E402
import psutil           # noqa: E402
import torch            # noqa: E402

from tests.ui_helpers import running_studio   # noqa: E402

MiB = 1 << 20
HEADROOM = 384 * MiB    # address space allowed above what the warmed-up server already maps
NORMAL = {"prompt": "a red fox", "seed": 3, "steps": 2, "batch_size": 1, "width": 64, "height": 64}


def main(sd: Path, out: Path) -> None:
    torch.set_num_threads(2)
    with running_studio(out, models=(sd,), queue_max_size=4, device="cpu") as demo:
        url = demo.local_url.rstrip("/") + "/sdapi/v1/txt2img"
        for _ in range(2):          # warm: the model loaded, the API's worker thread made, the allocator settled
            r = httpx.post(url, json=NORMAL, timeout=600)
            r.raise_for_status()
        me = psutil.Process()
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (me.memory_info().vms + HEADROOM, hard))
        print(json.dumps({"url": demo.local_url, "baseline_rss": me.memory_info().rss, "headroom": HEADROOM}),
              flush=True)
        for line in sys.stdin:
            if line.strip() == "rss":
                print(json.dumps({"rss": me.memory_info().rss}), flush=True)
        # no orderly close under the limit (threads may not start): the test is done with this server
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
