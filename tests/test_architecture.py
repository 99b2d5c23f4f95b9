"""The import rules of DESIGN.md, checked on the source text."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# folder -> top-level project packages it may import
ALLOWED = {
    "core": {"core"},
    "models": {"core", "models"},
    "optim": {"core", "optim"},
    "telemetry": {"core", "telemetry"},
    "evaluation": {"core", "evaluation"},
    "pipelines": {"core", "models", "optim", "telemetry", "pipelines"},
    "bench": {"core", "models", "optim", "telemetry", "pipelines", "training", "bench"},
    "training": {"core", "models", "telemetry", "evaluation", "training"},
    "ui": {"pipelines", "training", "evaluation", "telemetry", "core", "ui"},
    "cli": {"pipelines", "training", "evaluation", "telemetry", "core", "bench", "cli"},
}
PROJECT = set(ALLOWED) | {"app"}


def _imports(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name.split(".")[0], node.lineno
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module.split(".")[0], node.lineno


def test_import_direction():
    bad = []
    for folder, allowed in ALLOWED.items():
        for path in (ROOT / folder).rglob("*.py"):
            for mod, line in _imports(path):
                if mod in PROJECT and mod not in allowed:
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {mod}")
                if mod == "gradio" and folder != "ui":
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports gradio (only ui/ and app.py may)")
    assert not bad, "import rules broken:\n" + "\n".join(bad)
