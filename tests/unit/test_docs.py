"""The README and the documentation site (docs/, mkdocs.yml) stand alone and stay true.

The README fits on a screen; every link of the README and the docs points at a file inside the
repository; the commands the README gives are the Makefile's, .ci/run's and the CLI's. Dead links
and headings inside the site are `mkdocs build --strict`'s to find (make test, make check)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from rollout_lens.cli import main

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").rglob("*.md"))
# A Markdown link or image: [text](target) or ![alt](target); the target up to a space or ")".
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)


def _code_blocks(text: str) -> str:
    return "\n".join(FENCE.findall(text))


def test_the_readme_fits_on_a_screen() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move the detail into docs/"


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_points_inside_the_repository(page: Path) -> None:
    text = FENCE.sub("", page.read_text())
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a web address, or a heading of the same page
        path = (page.parent / target.split("#")[0]).resolve()
        assert path.is_relative_to(ROOT), f"{page.name}: {target} leaves the repository"
        assert path.exists(), f"{page.name}: {target} does not exist"


def test_every_page_is_in_the_sites_nav() -> None:
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]

    def files(entry: object) -> list[str]:
        if isinstance(entry, str):
            return [entry]
        if isinstance(entry, dict):
            return [f for value in entry.values() for f in files(value)]
        if isinstance(entry, list):
            return [f for item in entry for f in files(item)]
        return []

    listed = files(nav)
    pages = sorted(str(p.relative_to(ROOT / "docs")) for p in PAGES)
    assert sorted(listed) == pages


def test_the_readmes_make_targets_are_the_makefiles() -> None:
    targets = set(re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), re.M))
    given = set(re.findall(r"^make ([a-z-]+)", _code_blocks(README.read_text()), re.M))
    assert {"demo", "run", "test", "check", "release-test", "docs"} <= given
    assert given <= targets
    # .ci/run runs what the README says CI runs, in that order.
    ci = [
        line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("make")
    ]
    assert ci == ["make test", "make release-test"]


def test_the_readmes_commands_are_the_clis(capsys: pytest.CaptureFixture[str]) -> None:
    blocks = _code_blocks(README.read_text())
    listed = re.findall(r"^rollout-lens (.+? \| .+)$", blocks, re.M)
    commands = [c.strip().split()[:2] for line in listed for c in line.split("|")]
    commands = [c if c[0] == "db" else c[:1] for c in commands]
    assert len(commands) >= 12
    for command in commands:
        with pytest.raises(SystemExit) as done:
            main([*command, "--help"])
        assert done.value.code == 0, command
        out = capsys.readouterr().out
        if command[0] in {"runs", "rollouts", "export", "import", "import-trl", "import-verl"}:
            assert "--url" in out, f"the README says `rollout-lens {command[0]}` takes --url"
