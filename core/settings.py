"""Application settings: one frozen dataclass built in app.py and passed down."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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

    @classmethod
    def from_env(cls, **overrides) -> "Settings":
        env = os.environ
        kw: dict = {}
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
        kw.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**kw)
