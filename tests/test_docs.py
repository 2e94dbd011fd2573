"""The documentation stays true to the code (issue 29): the site builds with `mkdocs build
--strict`, every relative link of the README and of `docs/` reaches its file and heading, every
command they show parses with the program's own argparse parser (a renamed flag fails here), and
the module map of `docs/architecture.md` is what the modules' docstrings say. No vLLM, no model.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
from markdown.extensions.toc import slugify

from devtools.doctools import modmap
from molt_proxy import cli

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_BLOCKS = {"", "bash", "sh", "shell", "console"}  # a fence's info string that shows commands
FENCE = re.compile(r"^\s*```(\S*)")
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)\)")
INLINE_CODE = re.compile(r"`+[^`]*`+")
ENV_PREFIX = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
# A line that may run one of the programs checked: only those are read as shell (a diagram's
# apostrophe is no unclosed quote).
MAY_RUN = re.compile(r"(^|[\s;&|])(\.venv/bin/)?(molt-proxy|python3?)\s")
SEPARATORS = {"&&", "||", ";", "|", "&"}


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def prose_lines(page: Path) -> Iterator[tuple[int, str]]:
    """The lines outside fenced code, with their numbers."""
    fenced = False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            yield number, line


def anchors(page: Path) -> set[str]:
    """The heading ids mkdocs gives `page` (Python-Markdown's `toc`: a repeated slug gets `_1`)."""
    found: set[str] = set()
    for _, line in prose_lines(page):
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            slug = base = slugify(heading.group(1).replace("`", ""), "-")
            count = 0
            while slug in found:
                count += 1
                slug = f"{base}_{count}"
            found.add(slug)
    return found


def shown_commands(page: Path) -> Iterator[tuple[int, str]]:
    """Each line of a shell-like fenced block, continuation lines (`\\`) joined, with its number."""
    block: str | None = None
    pending, start = "", 0
    for number, line in enumerate(page.read_text().splitlines(), 1):
        fence = FENCE.match(line)
        if fence:
            block = fence.group(1) if block is None else None
            continue
        if block not in SHELL_BLOCKS:
            continue
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        if MAY_RUN.search(pending + line):
            yield start, pending + line
        pending = ""


def simple_commands(line: str) -> Iterator[list[str]]:
    """The words of each simple command of a shell line (split at `&&`, `;`, `|`), comments and
    `VAR=value` prefixes dropped, the checkout's `.venv/bin/` taken off the program's name, and
    optional flags shown in brackets (`[--eval] [--workdir DIR]`) read as given."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    words: list[str] = []
    optional = False
    for token in [*lexer, ";"]:
        if token not in SEPARATORS:
            if token.startswith("[-"):
                token, optional = token[1:], True
            if optional and token.endswith("]"):
                token, optional = token[:-1], False
            words.append(token)
            continue
        while words and ENV_PREFIX.match(words[0]):
            words.pop(0)
        if words:
            words[0] = words[0].removeprefix(".venv/bin/").replace("python3", "python")
            yield words
        words = []


class _Parsed(Exception):
    """Raised with the namespace as soon as a program's own parser has read its command line."""


def parsed_by_main(main, argv: list[str]) -> argparse.Namespace:
    """`main(argv)` stopped right after its parser has read `argv`: `python -m trainer` builds its
    parser inside `main`, so this checks the very parser it runs, not a copy of its flags."""
    parse_args = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(parse_args(self, args, namespace))

    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_then_stop):
        try:
            main(argv)
        except _Parsed as parsed:
            return parsed.args[0]
    raise AssertionError("main() returned without parsing a command line")


def check_command(words: list[str]) -> str | None:
    """Parse one shown command as its program would; the error, or None. Unknown programs: None."""
    program, args = words[0], words[1:]
    if program == "molt-proxy" or (program == "python" and args[:2] == ["-m", "molt_proxy"]):
        argv = args if program == "molt-proxy" else args[2:]
        run = lambda: cli.parser().parse_args(argv)  # noqa: E731
    elif program == "python" and args[:2] == ["-m", "trainer"]:
        from trainer.run import main as trainer_main  # torch and Ray: imported only when shown

        run = lambda: parsed_by_main(trainer_main, args[2:])  # noqa: E731
    elif program == "python" and args and args[0].startswith("examples/"):
        return None if (ROOT / args[0]).is_file() else f"no such file: {args[0]}"
    else:
        return None
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            run()
    except SystemExit:
        return stderr.getvalue().strip().splitlines()[-1]
    return None


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_relative_link_reaches_its_file_and_heading(page: Path) -> None:
    broken = []
    for number, line in prose_lines(page):
        for target in LINK.findall(INLINE_CODE.sub("``", line)):  # a link in code is no link
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page_id(page)}:{number}: {target}: no such file")
            elif anchor and (file.suffix != ".md" or anchor not in anchors(file)):
                broken.append(f"{page_id(page)}:{number}: {target}: no such heading")
    assert broken == []


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_shown_command_parses_with_its_programs_parser(page: Path) -> None:
    failures = []
    for number, line in shown_commands(page):
        for words in simple_commands(line):
            error = check_command(words)
            if error is not None:
                failures.append(f"{page_id(page)}:{number}: {shlex.join(words)}\n    {error}")
    assert failures == [], "\n".join(failures)


def test_the_commands_of_a_page_are_read_as_a_shell_reads_them(tmp_path: Path) -> None:
    """A continued line is one command, an env prefix and a `.venv/bin/` do not hide the
    program, `&&` separates two, and a block of another language shows none."""
    page = tmp_path / "page.md"
    page.write_text(
        "```bash\nA=1 B=2 .venv/bin/python -m trainer --model PATH \\\n  --seed 0  # a comment\n"
        "bash x.sh && molt-proxy export --out f [--db D]\nagent ──▶ molt-proxy: the model's\n```\n\n"
        "```python\nmolt-proxy --no-such-flag\n```\n"
    )
    commands = [words for _, shown in shown_commands(page) for words in simple_commands(shown)]
    assert commands == [
        ["python", "-m", "trainer", "--model", "PATH", "--seed", "0"],
        ["bash", "x.sh"],
        ["molt-proxy", "export", "--out", "f", "--db", "D"],
    ]


def test_a_renamed_flag_is_caught() -> None:
    assert check_command(["molt-proxy", "serve", "--model", "PATH", "--tool-call-parser", "hermes"]) is None
    assert check_command(["molt-proxy", "serve", "--model", "PATH", "--tool-parser", "hermes"]) == (
        "molt-proxy: error: unrecognized arguments: --tool-parser hermes"
    )
    assert check_command(["python", "-m", "trainer", "--model", "PATH", "--learning-rate", "1"]) == (
        "python -m trainer: error: unrecognized arguments: --learning-rate 1"
    )
    assert (
        check_command(["python", "examples/no_such_example.py"])
        == "no such file: examples/no_such_example.py"
    )


def test_the_module_map_is_what_the_docstrings_say() -> None:
    page = ROOT / modmap.PAGE
    assert page.read_text() == modmap.render(page.read_text(), modmap.module_map(ROOT)), (
        "docs/architecture.md is stale: run `python -m devtools.doctools.modmap`"
    )


def test_the_module_map_refuses_a_module_without_a_docstring(tmp_path: Path) -> None:
    module = tmp_path / "quiet.py"
    module.write_text("x = 1\n")
    with pytest.raises(ValueError, match="quiet.py has no module docstring: say what the module owns"):
        modmap.summary(module)


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    """mkdocs' own check: every page in the nav, and no link or anchor between pages broken."""
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert build.returncode == 0, build.stderr
    assert (tmp_path / "site" / "architecture.html").is_file()
