"""Application settings: one frozen dataclass built in app.py and passed down."""
from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

MODES = ("local", "public")
# what a host may open up to visitors in public mode (`--allow`, ATELIER_ALLOW)
VISITOR_CAPABILITIES = ("hub", "add-model", "train")


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_allow(text: str | None) -> frozenset[str]:
    """'hub,train' -> {'hub', 'train'}; an unknown name is refused by name."""
    names = frozenset(n.strip() for n in (text or "").split(",") if n.strip())
    unknown = sorted(names - set(VISITOR_CAPABILITIES))
    if unknown:
        raise ValueError(f"unknown --allow value {', '.join(unknown)}; use some of {', '.join(VISITOR_CAPABILITIES)}")
    return names


@dataclass(frozen=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 7860
    share: bool = False
    auth: tuple[str, str] | None = None
    device: str | None = None
    assets_dir: Path = ROOT / "assets"
    models_dirs: tuple[Path, ...] = (ROOT / "models_local",)   # extra folders scanned for models
    extra_models: tuple[str, ...] = ()                          # paths or hub ids the operator named
    output_dir: Path = ROOT / "outputs"
    cache_dir: Path = ROOT / ".cache" / "atelier"
    queue_max_size: int = 16
    vram_budget_fraction: float = 0.85                          # model manager evicts above this
    default_stylegan_model: str | None = None
    runs_dir: Path | None = None                                # training runs; None = output_dir/../runs
    # who may do what: 'local' (the operator's own machine: every path and hub id) or 'public' (strangers:
    # catalogue and configured folders only). 'auto' = public with --share, on a Space or on a non-loopback host
    mode: str = "auto"
    allow: frozenset[str] = frozenset()                         # public mode: what visitors may do besides generate
    data_dirs: tuple[Path, ...] = ()                            # public mode + train: where training data may come from
    on_space: bool = False                                      # running as a Hugging Face Space (SPACE_ID set)
    warmup: bool = False                                        # load the default model and generate once at start
    # visitors' uploads (Gradio's upload folder): deleted after this many seconds, oldest first above the cap
    upload_ttl_s: float = 1800.0
    upload_cap_bytes: int = 512 * 2**20
    upload_sweep_s: float = 60.0                                # how often the upload folder is swept

    def __post_init__(self):
        if self.mode == "auto":
            public = self.share or self.on_space or not is_loopback(self.host)
            object.__setattr__(self, "mode", "public" if public else "local")
        if self.mode not in MODES:
            raise ValueError(f"mode must be local or public; got {self.mode!r}")
        allow = self.allow if isinstance(self.allow, str) else ",".join(self.allow)
        object.__setattr__(self, "allow", parse_allow(allow))

    @property
    def public(self) -> bool:
        return self.mode == "public"

    def visitor_may(self, capability: str) -> bool:
        """Local mode: everything. Public mode: only what the host allowed."""
        return not self.public or capability in self.allow

    @classmethod
    def from_env(cls, **overrides) -> "Settings":
        env = os.environ
        kw: dict = {}
        # Gradio's own variables first (what a Space or a container sets), ours win over them
        if env.get("GRADIO_SERVER_NAME"):
            kw["host"] = env["GRADIO_SERVER_NAME"]
        if env.get("GRADIO_SERVER_PORT"):
            kw["port"] = int(env["GRADIO_SERVER_PORT"])
        if "ATELIER_HOST" in env:
            kw["host"] = env["ATELIER_HOST"]
        if "ATELIER_PORT" in env:
            kw["port"] = int(env["ATELIER_PORT"])
        if "ATELIER_AUTH" in env and ":" in env["ATELIER_AUTH"]:
            user, pw = env["ATELIER_AUTH"].split(":", 1)
            kw["auth"] = (user, pw)
        if "ATELIER_MODELS_DIR" in env:
            kw["models_dirs"] = tuple(Path(p) for p in env["ATELIER_MODELS_DIR"].split(os.pathsep) if p)
        if "ATELIER_OUTPUT_DIR" in env:
            kw["output_dir"] = Path(env["ATELIER_OUTPUT_DIR"])
        if "ATELIER_CACHE_DIR" in env:
            kw["cache_dir"] = Path(env["ATELIER_CACHE_DIR"])
        if "ATELIER_RUNS_DIR" in env:
            kw["runs_dir"] = Path(env["ATELIER_RUNS_DIR"])
        if "ATELIER_DEVICE" in env:
            kw["device"] = env["ATELIER_DEVICE"]
        if env.get("ATELIER_MODE"):
            kw["mode"] = env["ATELIER_MODE"]
        if env.get("ATELIER_ALLOW"):
            kw["allow"] = parse_allow(env["ATELIER_ALLOW"])
        if env.get("ATELIER_DATA_DIRS"):
            kw["data_dirs"] = tuple(Path(p) for p in env["ATELIER_DATA_DIRS"].split(os.pathsep) if p)
        if env.get("ATELIER_WARMUP", "").strip().lower() in ("1", "true", "yes", "on"):
            kw["warmup"] = True
        if env.get("ATELIER_UPLOAD_TTL_S"):
            kw["upload_ttl_s"] = float(env["ATELIER_UPLOAD_TTL_S"])
        if env.get("ATELIER_UPLOAD_CAP_MB"):
            kw["upload_cap_bytes"] = int(float(env["ATELIER_UPLOAD_CAP_MB"]) * 2**20)
        if env.get("SPACE_ID"):
            kw["on_space"] = True
            kw.setdefault("host", "0.0.0.0")   # Spaces route to the container's port
        kw.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**kw)
