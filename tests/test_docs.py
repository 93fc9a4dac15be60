"""The documentation holds together: README.md and the benchmarks index stay within their length
bounds, every relative link in them and in the pages beside them resolves to a file of this
checkout, README's test command is the one ``.ci/run`` runs, and the benchmarks index names every
script in ``benchmarks/`` (and only scripts that exist)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted(
    [
        REPO / "README.md",
        REPO / "benchmarks" / "README.md",
        REPO / "benchmarks" / "archive" / "README.md",
        *(REPO / "docs").glob("*.md"),
        *(REPO / "benchmarks" / "notes").glob("*.md"),
    ]
)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")  # [text](target)
BOUNDS = {"README.md": 250, "benchmarks/README.md": 300}


def relative_links(page: Path) -> list[str]:
    """The link targets of ``page`` that point into the checkout (no scheme, no bare anchor)."""
    targets = LINK.findall(page.read_text(encoding="utf-8"))
    return [t for t in targets if not re.match(r"^[a-z]+:", t) and not t.startswith("#")]


@pytest.mark.parametrize("name", sorted(BOUNDS))
def test_page_length_bound(name: str) -> None:
    lines = (REPO / name).read_text(encoding="utf-8").count("\n")
    assert lines <= BOUNDS[name], f"{name}: {lines} lines, the bound is {BOUNDS[name]}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page: Path) -> None:
    assert page.is_file(), f"{page.relative_to(REPO)} is missing"
    broken = []
    for target in relative_links(page):
        path = (page.parent / target.split("#", 1)[0]).resolve()
        if not path.is_relative_to(REPO) or not path.exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(REPO)}: links that resolve to nothing: {broken}"


def test_link_check_sees_a_broken_link(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("[a](docs/none.md) [b](https://x.org/y) [c](#here) [d](p.md#top)\n")
    assert relative_links(page) == ["docs/none.md", "p.md#top"]


def test_readme_holds_the_ci_test_command() -> None:
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    array = re.search(r"^lines=\((.*?)^\)", ci, re.M | re.S)
    assert array, ".ci/run no longer keeps the README's test lines in lines=( … )"
    lines = re.findall(r'^\s+"(.*)"$', array.group(1), re.M)
    assert len(lines) >= 3 and lines[-1].endswith("python -m pytest -q")
    block = "```bash\n" + "\n".join(lines) + "\n```"
    assert block in (REPO / "README.md").read_text(encoding="utf-8")


def test_benchmarks_index_names_every_script_and_only_real_ones() -> None:
    index = (REPO / "benchmarks" / "README.md").read_text(encoding="utf-8")
    scripts = {p.name for p in (REPO / "benchmarks").glob("*.py")}
    named = set(re.findall(r"benchmarks/([\w-]+\.py)", index))
    assert scripts - named == set(), f"scripts the index does not describe: {scripts - named}"
    assert named - scripts == set(), (
        f"the index names scripts that are not there: {named - scripts}"
    )
