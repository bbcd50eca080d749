"""The layering docs/architecture.md describes, checked on the source."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

from rollout_lens.server.webapp import routes

SERVER = Path(__file__).resolve().parents[2] / "server"
ROUTES = Path(routes.__file__).resolve().parent


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
    package = routes.__name__
    names = {p.stem for p in ROUTES.glob("*.py") if p.stem != "__init__"}
    assert names, ROUTES
    for path in ROUTES.glob("*.py"):
        others = {f"{package}.{r}" for r in names if r != path.stem}
        assert not _imports(path) & others, path


# What a user's TRL script pays for its one line: the recorder, not the demo's task, its envs,
# the model builders, the worker or the CLI. trl is the user's own import, made when they build
# their GRPOTrainer, not ours.
NOT_LOADED_BY_THE_CALLBACK = (
    "rollout_lens.trainer.envs",
    "rollout_lens.trainer.escalation.task",
    "rollout_lens.trainer.escalation.evaluation",
    "rollout_lens.trainer.escalation.supervision",
    "rollout_lens.trainer.escalation.multiturn",
    "rollout_lens.trainer.builders.tiny_model",
    "rollout_lens.trainer.builders.prebuilt",
    "rollout_lens.trainer.worker.run",
    "rollout_lens.trainer.worker.tasks",
    "rollout_lens.cli",
    "rollout_lens.cli.demo",
    "trl",
)


def _loaded_after(statement: str) -> list[str]:
    """The modules a fresh interpreter holds after `statement`."""
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return list(json.loads(done.stdout.splitlines()[-1]))


def _under(modules: list[str], prefixes: tuple[str, ...]) -> list[str]:
    return [m for m in modules if any(m == p or m.startswith(p + ".") for p in prefixes)]


def test_the_forbidden_list_names_modules_that_exist() -> None:
    # A renamed module left here would make the test below pass for nothing.
    assert [m for m in NOT_LOADED_BY_THE_CALLBACK if importlib.util.find_spec(m) is None] == []


def test_the_callback_loads_no_task_env_demo_or_trl() -> None:
    loaded = _loaded_after("from rollout_lens import RolloutLensCallback")
    assert "rollout_lens.trainer.recorder.callback" in loaded
    assert _under(loaded, NOT_LOADED_BY_THE_CALLBACK) == []


ROOT = SERVER.parent
SOURCES = ("server", "trainer", "rollout_lens", "tests", "bench", "migrations")
# trainer/retry.py reads outbox's idea of a transient error; the one writer the recording path's
# rewrite makes of outbox, writer and retry ends it. Remove the entry then (the test says so).
KNOWN_PRIVATE_IMPORTS: set[tuple[str, str]] = set()


def _our_modules() -> set[str]:
    found = set()
    for top in ("server", "trainer"):
        for path in (ROOT / top).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            found.add(".".join(("rollout_lens", *parts)))
    found.update(f"rollout_lens.{p.stem}" for p in (ROOT / "rollout_lens").glob("*.py"))
    return found


def _private_uses(path: Path, modules: set[str]) -> set[str]:
    """`from rollout_lens.x import _name` and `module._name` where `module` is one of ours."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    bound: dict[str, str] = {}
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rollout_lens"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.add(full)
                if full in modules:
                    bound[alias.asname or alias.name] = full
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name in modules:
                    bound[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in bound
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            found.add(f"{bound[node.value.id]}.{node.attr}")
    return found


def test_no_module_uses_another_modules_private_names() -> None:
    modules = _our_modules()
    found = {
        (path.relative_to(ROOT).as_posix(), name)
        for top in SOURCES
        for path in (ROOT / top).rglob("*.py")
        for name in _private_uses(path, modules)
    }
    # Equal, not a subset: an entry that no longer happens must leave the list.
    assert found == KNOWN_PRIVATE_IMPORTS


def test_the_client_reads_shapes_only() -> None:
    """The notebook client takes a rollout's keys from the read view (server.core.step_views),
    which imports only the core: reading a dashboard loads no SQLAlchemy, store or app."""
    client = SERVER.parent / "rollout_lens" / "client.py"
    ours = {m for m in _imports(client) if m.startswith("rollout_lens")}
    assert ours <= {
        "rollout_lens.server",
        "rollout_lens.server.core",
        "rollout_lens.server.core.step_views",
    }, ours
    spec = importlib.util.find_spec("rollout_lens.server.core.step_views")
    assert spec is not None and spec.origin is not None
    shapes = _imports(Path(spec.origin))
    outside = {
        m
        for m in shapes
        if m.startswith("rollout_lens") and not m.startswith("rollout_lens.server.core.")
    }
    assert not outside, outside


def test_no_two_public_classes_share_a_name() -> None:
    """A name means one thing (issue 27): a reader never has to check which class is meant;
    ORM rows end in Row, the JSON API's documented shapes in Schema."""
    root = SERVER.parent
    where: dict[str, list[str]] = {}
    for folder in ("server", "trainer", "rollout_lens"):
        for path in (root / folder).rglob("*.py"):
            for node in ast.parse(path.read_text(encoding="utf-8")).body:
                if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                    where.setdefault(node.name, []).append(str(path.relative_to(root)))
    shared = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not shared, shared
    from rollout_lens.server.store.models import Base

    mapped = sorted(mapper.class_.__name__ for mapper in Base.registry.mappers)
    assert mapped and all(name.endswith("Row") for name in mapped), mapped


def test_every_source_writes_through_the_one_writer() -> None:
    """Imports, follow mode (through dump_import's DumpWriter), launched runs and a user's script
    write a run's steps through store.RunWriter (server/store/writing.py), never a Recorder or
    write function of their own."""
    root = SERVER.parent
    sources = {
        "server/exchange/importer.py",
        "server/exchange/dump_import.py",
        "trainer/recorder/sinks.py",
    }
    for name in sources:
        assert "store.RunWriter(" in (root / name).read_text(encoding="utf-8"), name
    for folder in ("server", "trainer"):
        for path in (root / folder).rglob("*.py"):
            if path.parent.name == "store":
                continue
            text = path.read_text(encoding="utf-8")
            for call in ("Recorder", "record_step", "write_batch", "write_steps", "add_rollouts"):
                assert not re.search(rf"(?:(?<![\w.])|store\.){call}\(", text), (path, call)


ROOT = SERVER.parent
MAX_CLASS_LINES, MAX_FUNCTION_LINES = 300, 60  # docs/architecture.md: small rooms


def _rooms() -> list[tuple[str, str, int, int]]:
    """(kind, file:name, lines, limit) of every class and function of the package's code
    (rollout_lens/, server/, trainer/; not migrations or tests), decorators left out."""
    found = []
    for folder in ("rollout_lens", "server", "trainer"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ClassDef):
                    kind, limit = "class", MAX_CLASS_LINES
                elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    kind, limit = "function", MAX_FUNCTION_LINES
                else:
                    continue
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                found.append((kind, f"{path.relative_to(ROOT)}:{node.name}", lines, limit))
    return found


def test_no_class_or_function_outgrows_its_room() -> None:
    """No class over 300 lines and no function over 60, docstrings included (issue 50's small
    rooms: a room that grows past them is split, not waved through)."""
    rooms = _rooms()
    assert any(kind == "class" for kind, *_ in rooms) and len(rooms) > 500
    over = [(kind, where, lines) for kind, where, lines, limit in rooms if lines > limit]
    assert not over, over
