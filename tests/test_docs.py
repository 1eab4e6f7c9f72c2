"""The docs stay true to the code where a machine can tell: docs/serving.md's flag table is dflash-serve's parser,
every relative link in the README and docs/ names a file that exists, and the README stays a front door."""

import re
from pathlib import Path

from gateway.flag_table import flag_table
from gateway.launcher import build_parser

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_the_flag_table_is_the_parsers():
    text = (ROOT / "docs" / "serving.md").read_text()
    documented = text.split("<!-- flags:begin -->\n", 1)[1].split("\n<!-- flags:end -->", 1)[0]
    assert documented == flag_table(build_parser(environ={})), \
        "docs/serving.md's flag table differs from dflash-serve's flags: python -m gateway.flag_table prints it"


def test_every_relative_link_resolves():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    broken = []
    for page in pages:
        for target in LINK.findall(page.read_text()):
            if not re.match(r"[a-z]+:", target) and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, "links to nothing:\n" + "\n".join(broken)


def test_the_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines: the details belong in docs/"
