"""The layering docs/architecture.md describes, checked on the source."""

from __future__ import annotations

import ast
from pathlib import Path

SERVER = Path(__file__).resolve().parent.parent / "server"


def _imports(path: Path) -> set[str]:
    """Every module a file imports, lazily or not (`from a import b` counts as a and a.b)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_the_web_app_imports_nothing_from_the_trainer() -> None:
    for path in SERVER.rglob("*.py"):
        assert "rollout_lens.trainer" not in path.read_text(encoding="utf-8"), path


def test_route_modules_do_not_import_each_other() -> None:
    routes = {p.stem for p in (SERVER / "routes").glob("*.py") if p.stem != "__init__"}
    for path in (SERVER / "routes").glob("*.py"):
        imported = _imports(path)
        others = {f"rollout_lens.server.routes.{r}" for r in routes if r != path.stem}
        assert not imported & others, path


def test_the_client_reads_shapes_only() -> None:
    """The notebook client takes a rollout's keys from server.read_models, which imports
    nothing of ours: reading a dashboard loads no SQLAlchemy, store or app."""
    client = SERVER.parent / "rollout_lens" / "client.py"
    ours = {m for m in _imports(client) if m.startswith("rollout_lens")}
    assert ours <= {"rollout_lens.server", "rollout_lens.server.read_models"}, ours
    shapes = _imports(SERVER / "read_models.py")
    assert not {m for m in shapes if m.startswith("rollout_lens")}, shapes
