"""The README and the manual in docs/ stay true: the README's first command block, its length, the generated
configuration reference, and every relative link (files and #anchors) in README.md and docs/*.md."""

import importlib.util
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
MAX_README_LINES = 250

FENCE = re.compile(r"^```.*?^```[^\n]*$", re.M | re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto: ... are not checked


def _prose(text: str) -> str:
    """The text without fenced code blocks (a `# comment` in bash is not a heading, `[a](b)` there no link)."""
    return FENCE.sub("", text)


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors for a markdown file's headings: lowercase, punctuation dropped, spaces -> '-', '-N' on
    repeats."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for line in _prose(text).splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", match.group(1))  # a link in a heading keeps its text
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def relative_links(path: Path) -> list[tuple[Path, str]]:
    """(target file, anchor or '') of every relative link and image in a markdown file, outside code."""
    prose = re.sub(r"`[^`\n]*`", "", _prose(path.read_text()))
    links = []
    for target in LINK.findall(prose):
        if SCHEME.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        links.append(((path.parent / file_part).resolve() if file_part else path, anchor))
    return links


def test_readme_opens_with_the_two_commands_ci_uses():
    readme = README.read_text()
    block = readme.split("```bash", 1)[1].split("```", 1)[0].strip().splitlines()
    assert block[0].startswith("make demo") and block[1].startswith("make test")
    assert "make test" in (REPO / ".ci" / "run").read_text()


def test_readme_stays_short():
    lines = len(README.read_text().splitlines())
    assert lines < MAX_README_LINES, (
        f"README.md has {lines} lines (under {MAX_README_LINES} wanted): move reference material to docs/*.md "
        "and link it from the README")


def test_config_reference_is_current():
    spec = importlib.util.spec_from_file_location("gen", REPO / "tools" / "gen_config_reference.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert gen.REFERENCE == REPO / "docs" / "config-reference.md"
    assert gen.REFERENCE.read_text() == gen.reference_document(), "run: python tools/gen_config_reference.py"


def test_every_doc_is_linked_from_the_readme():
    linked = {target for target, _ in relative_links(README)}
    unlinked = [doc.name for doc in DOCS if doc.resolve() not in linked]
    assert DOCS and not unlinked, f"docs not linked from README.md: {unlinked}"


def test_every_relative_link_resolves_anchors_included():
    broken = []
    for page in [README, *DOCS]:
        for target, anchor in relative_links(page):
            where = f"{page.relative_to(REPO)} -> {target} #{anchor}"
            if not target.is_relative_to(REPO):
                broken.append(f"{where}: outside the repository")
            elif not target.exists():
                broken.append(f"{where}: no such file")
            elif anchor and (target.suffix != ".md" or anchor not in heading_anchors(target.read_text())):
                broken.append(f"{where}: no such heading")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_link_checker_finds_broken_links(tmp_path):
    """The checks above could pass by finding no links at all; here they must see every kind of breakage."""
    (tmp_path / "other.md").write_text("# Title\n## W&B `x.y[i]`\n## Title\n```bash\n# not a heading\n```\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#title-1) [ok](other.md#wb-xyi) ![img](other.md) [web](https://example.org/x)\n"
        "[bad](missing.md) [bad](other.md#not-a-heading) `[code](skipped.md)`\n"
        "```\n[in a fence](skipped.md)\n```\n")
    assert heading_anchors((tmp_path / "other.md").read_text()) == {"title", "wb-xyi", "title-1"}
    links = relative_links(page)
    assert [(t.name, a) for t, a in links] == [
        ("other.md", "title-1"), ("other.md", "wb-xyi"), ("other.md", ""), ("missing.md", ""),
        ("other.md", "not-a-heading")]


def demo_winners(summary: dict) -> set[str]:
    """The models the committed demo report resolves as better than another (a paired interval excluding 0)."""
    winners = set()
    for evaluation in summary["evaluations"].values():
        for row in evaluation["rows"]:
            for cell in row.get("paired") or []:
                if cell["verdict"] in ("better", "worse"):
                    winners.add(row["label"] if cell["verdict"] == "better" else cell["reference"])
    return winners


def test_readme_calls_a_demo_model_better_only_where_a_paired_interval_resolves_it():
    """The README's demo results name a model better (or bold a value as best) only where the committed demo report
    (docs/demo/summary.json) holds a paired interval that excludes 0 (overlapping single-model intervals decide
    nothing), and the paired differences it quotes are the report's."""
    import json

    text = README.read_text()
    section = text[text.index("## Evaluation"):text.index("<!-- demo-results:end -->")]
    from tapetrain.compare.summary import format_difference

    summary = json.loads((REPO / "docs" / "demo" / "summary.json").read_text())
    winners = demo_winners(summary)
    claims = re.findall(r"\b([A-Z]\w*) is (?:\w+ )?better\b", section)  # "TAPE is slightly better"
    assert set(claims) <= winners, f"README calls {claims} better; the demo report resolves only {sorted(winners)}"
    for evaluation in summary["evaluations"].values():  # the paired differences quoted are the report's
        for row in evaluation["rows"]:
            for cell in row.get("paired") or []:
                quoted = format_difference(cell, evaluation["percent"]).replace("-", "−")
                if f"{row['label']} − {cell['reference']}" in section and cell["verdict"] != "not resolved":
                    assert quoted in section, (row["label"], cell["length"], quoted)
    assert "**" not in section, "a value in bold reads as the best, which no paired interval says"
    assert "in bold" not in section
