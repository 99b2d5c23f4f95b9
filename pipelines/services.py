"""The services app.py builds once and hands to the UI and the CLI."""
from __future__ import annotations

from dataclasses import dataclass

from core.settings import Settings
from models.catalogue import Catalogue
from pipelines.manager import ModelManager


@dataclass
class Services:
    settings: Settings
    catalogue: Catalogue
    manager: ModelManager


def build_services(settings: Settings) -> Services:
    catalogue = Catalogue(settings.assets_dir, settings.models_dirs, settings.extra_models,
                          default_stylegan=settings.default_stylegan_model, public=settings.public,
                          allow_hub=settings.visitor_may("hub"))
    manager = ModelManager(catalogue, device=settings.device, budget_fraction=settings.vram_budget_fraction,
                           cache_dir=settings.cache_dir)
    return Services(settings, catalogue, manager)
