"""The documentation's relative links lead somewhere: every ``[text](path#anchor)`` in the README, docs/ and the
other guides of the checkout names a file that exists, and, where it names a heading of a Markdown file, a heading
that is there (GitHub's anchors: lowercase, punctuation dropped, spaces as hyphens)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md",
          ROOT / "kernels" / "NOTES.md", ROOT / "tests" / "hf_suite" / "README.md"]
pytestmark = pytest.mark.skipif(not (ROOT / "README.md").exists(),
                                reason="needs the source checkout the tests came from")

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _without_code_blocks(path: Path) -> str:
    return re.sub(r"```.*?```", "", path.read_text(), flags=re.S)


def _anchors(path: Path) -> set[str]:
    headings = re.findall(r"^#+ (.*)$", _without_code_blocks(path), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize("guide", [g for g in GUIDES if g.exists()], ids=lambda g: str(g.relative_to(ROOT)))
def test_relative_links_lead_somewhere(guide):
    broken = []
    prose = re.sub(r"`[^`\n]*`", "", _without_code_blocks(guide))  # (brackets in code are not links)
    for target in LINK.findall(prose):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # a URL (https:, mailto:), not a file here
            continue
        path, _, anchor = target.partition("#")
        destination = (guide.parent / path).resolve() if path else guide
        if not destination.exists():
            broken.append(f"{target}: no {destination}")
        elif anchor and destination.suffix == ".md" and anchor not in _anchors(destination):
            broken.append(f"{target}: no heading #{anchor} in {destination.name}")
    assert not broken, broken
