"""The README and the documentation site (docs/, mkdocs.yml) stand alone and stay true.

The README fits on a screen; every link of the README and the docs points at a file inside the
repository; the commands the README gives are the Makefile's, .ci/run's and the CLI's. The site
builds with `mkdocs build --strict`, which fails on a link to a missing page or heading and on a
page left out of the nav: here, so that make check, make test and CI build it (offline: no plugin
fetches anything)."""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import yaml

from rollout_lens.cli import main
from tests import screenshots

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").rglob("*.md"))
# A Markdown link or image: [text](target) or ![alt](target); the target up to a space or ")".
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)


def _code_blocks(text: str) -> str:
    return "\n".join(FENCE.findall(text))


def _mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    """`mkdocs build --strict` of `config` into `site`. Not --quiet: it hides the warnings that
    --strict counts, and a site with dead links then builds."""
    # Material's notice of its end of life (docs/development.md) is noise here.
    env = os.environ | {"NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,  # a hang fails; the build takes about 2 s
    )


def test_the_site_builds_strict(tmp_path: Path) -> None:
    built = _mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert built.returncode == 0, built.stderr
    assert "WARNING" not in built.stderr, built.stderr
    for page in PAGES:
        relative = page.relative_to(ROOT / "docs").with_suffix("")
        html = relative.parent if relative.name == "index" else relative
        assert (tmp_path / "site" / html / "index.html").is_file(), page


@pytest.mark.parametrize(
    ("page", "added", "said"),
    [
        ("tests.md", "[a page](nowhere.md)", "nowhere.md"),
        ("tests.md", "[a heading](concepts.md#nowhere)", "#nowhere"),
        ("nowhere.md", "# Not in the nav", "nowhere.md"),
    ],
    ids=["dead link", "dead anchor", "page not in the nav"],
)
def test_a_dead_link_or_a_page_outside_the_nav_fails_the_build(
    tmp_path: Path, page: str, added: str, said: str
) -> None:
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    with (tmp_path / "docs" / page).open("a") as out:
        out.write(f"\n{added}\n")
    built = _mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert built.returncode != 0
    assert said in built.stderr, built.stderr


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


def _rows(png: bytes) -> tuple[int, int, bytes]:
    """A PNG's width, height and filtered rows (the IDAT stream inflated)."""
    width, height = struct.unpack(">II", png[16:24])
    at, data = 8, b""
    while at < len(png):
        (length,) = struct.unpack(">I", png[at : at + 4])
        if png[at + 4 : at + 8] == b"IDAT":
            data += png[at + 8 : at + 8 + length]
        at += 12 + length
    return width, height, zlib.decompress(data)


def test_a_screenshot_cut_to_its_top_keeps_those_rows_byte_for_byte() -> None:
    # make screenshots cuts the tall pages (tests/screenshots.py); a screenshot of the docs is
    # the browser's own PNG, 8-bit RGB.
    whole = (ROOT / "docs" / "images" / "runs-page.png").read_bytes()
    width, height, rows = _rows(whole)
    cut = screenshots.cut_to_height(whole, 100)
    assert _rows(cut) == (width, 100, rows[: 100 * (1 + 3 * width)])
    assert screenshots.cut_to_height(whole, height) == whole
    with pytest.raises(ValueError, match="not a PNG"):
        screenshots.cut_to_height(b"GIF89a", 10)


def test_every_chosen_screenshot_is_in_the_docs() -> None:
    used = {
        Path(target).name
        for page in PAGES
        for target in LINK.findall(page.read_text())
        if target.endswith(".png")
    }
    assert set(screenshots.CHOSEN) <= used
