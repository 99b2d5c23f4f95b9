"""`python app.py train`: hands over to training.cli (which also runs standalone under torchrun)."""
from __future__ import annotations

from cli.errors import cli_errors


@cli_errors
def main(argv: list[str], services=None) -> int:
    from training.cli import main as train_main

    return train_main(argv)
