"""The documentation's links and commands point at things that exist: every relative markdown link (and
its #anchor, where it names a heading) in the README, docs/ (the measured runs under docs/results/
included), benchmarks/, configs/ and checkpoints/, and every `python -m benchmarks...` module the docs
tell a user to run."""

import re

import pytest
from conftest import REPO

PAGES = sorted([REPO / "README.md", *(REPO / "docs").rglob("*.md"), *(REPO / "benchmarks").rglob("*.md"),
                *(REPO / "configs").rglob("*.md"), REPO / "checkpoints" / "README.md"])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
MODULE = re.compile(r"python -m (benchmarks(?:\.\w+)+)")


def without_code_blocks(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def prose(text: str) -> str:
    """The text without code blocks and inline code, where brackets are not links."""
    return re.sub(r"`[^`\n]*`", "", without_code_blocks(text))


def anchors(page) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *$", without_code_blocks(page.read_text()), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return out


def test_the_pages_are_found():
    names = {p.relative_to(REPO).as_posix() for p in PAGES}
    assert {"README.md", "docs/README.md", "docs/results/README.md", "benchmarks/results/dager_cpu.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_resolves(page):
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{page.relative_to(REPO)}: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_documented_benchmark_module_exists(page):
    missing = [m for m in MODULE.findall(page.read_text())
               if not (REPO / (m.replace(".", "/") + ".py")).exists() and not (REPO / m.replace(".", "/")).is_dir()]
    assert not missing, f"{page.relative_to(REPO)}: {missing}"


def test_the_anchor_rule_matches_githubs_on_this_repos_headings(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# The attack × defense × protocol matrix\n## Best effort: `relaxed_span_fraction` (new default 0.91)\n"
                    "## Notes\n## Notes\n")
    assert anchors(page) == {"the-attack--defense--protocol-matrix",
                             "best-effort-relaxed_span_fraction-new-default-091", "notes", "notes-1"}


def test_the_python_api_pages_examples_run(capsys):
    """Every ```python block of docs/python_api.md, run in order in one namespace (later blocks may use earlier
    ones' names), as a reader would paste them."""
    blocks = re.findall(r"^```python\n(.*?)^```", (REPO / "docs" / "python_api.md").read_text(), flags=re.M | re.S)
    assert blocks
    namespace: dict = {"__name__": "python_api_example"}
    for block in blocks:
        exec(compile(block, "docs/python_api.md", "exec"), namespace)  # noqa: S102 (the project's own page)
    assert "refit residual" in capsys.readouterr().out
