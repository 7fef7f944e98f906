"""What the README promises a newcomer: the two set-up commands it opens with, a truthful torch
note, commands that fit together."""

from __future__ import annotations

import re
from pathlib import Path

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, re.S)


def test_the_readme_opens_with_exactly_two_set_up_commands():
    opening = README.split("\n---\n", 1)[0]
    blocks = bash_blocks(opening)
    assert len(blocks) == 2 and all(len(block.strip().splitlines()) == 1 for block in blocks)
    swarm, tests = (block.strip() for block in blocks)
    assert swarm == "pip install torch==2.13.0 && pip install -e . && peerd swarm --peers 3"
    assert tests == "pip install torch==2.13.0 && pip install -e '.[test]' && python -m pytest"


def test_the_torch_note_says_what_pypi_gives_and_how_to_get_the_cpu_build():
    opening = README.split("\n---\n", 1)[0]
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in opening
    assert "CUDA build" in opening
    dockerfile = (Path(__file__).resolve().parent.parent / "docker" / "Dockerfile").read_text()
    assert "https://download.pytorch.org/whl/cpu" in dockerfile  # the same index the README names


def test_join_uses_the_key_that_keygen_wrote():
    section = README.split("**Contribute a machine to a run**", 1)[1]
    commands = bash_blocks(section)[0].replace("\\\n", " ")
    keygen = re.search(r"peerd keygen --identity (\S+)", commands)
    join = re.search(r"peerd join .*--identity (\S+)", commands)
    assert keygen and join and keygen.group(1) == join.group(1)


def test_the_exit_status_table_is_the_one_the_code_uses():
    from peerd.exit_codes import EXIT_CODES

    section = README.split("## Exit status", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| (\d+) \| (.+?) \|$", section, re.M))
    assert {int(code): text for code, text in rows.items()} == EXIT_CODES


def test_the_join_table_is_the_declared_settings():
    """The README's ``peerd join`` table is written from the settings' declaration; ``python -m
    peerd.join_arguments`` prints the table to paste after changing a setting."""
    from peerd.join_arguments import readme_table

    section = README.split("## peerd join\n\n", 1)[1]
    table = section[: section.index("\n\n")]
    assert table == readme_table(), "README's peerd join table differs: python -m peerd.join_arguments prints it"
