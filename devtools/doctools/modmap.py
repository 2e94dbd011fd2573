"""The module map of `docs/architecture.md`, made from the modules' own docstrings, so that it
cannot go stale: a module's row is the first paragraph of its docstring, read with `ast` (nothing
is imported, so it runs without torch or vLLM).

`python -m devtools.doctools.modmap` rewrites the tables between the page's markers; `--check`
changes nothing and exits 1 when the page differs from what the docstrings give
(`tests/test_docs.py` makes the same comparison). A module without a docstring is an error, not
an empty row: every module says what it owns. `__main__.py` files, the `python -m` entry points
that only call a `main`, are left out.
"""

import argparse
import ast
import sys
from pathlib import Path

PACKAGES = ("molt_proxy", "trainer", "rollout", "integrations", "devtools")
PAGE = Path("docs/architecture.md")
BEGIN = "<!-- module map: made by `python -m devtools.doctools.modmap` from the docstrings; edit those -->"
END = "<!-- end of the module map -->"


def summary(path: Path) -> str:
    """The first paragraph of `path`'s docstring on one line, safe inside a Markdown table cell."""
    docstring = ast.get_docstring(ast.parse(path.read_text(), filename=str(path)))
    if not docstring:
        raise ValueError(f"{path} has no module docstring: say what the module owns")
    first = " ".join(docstring.split("\n\n")[0].split())
    return first.replace("|", "\\|")


def module_map(root: Path) -> str:
    """One table per package: each module (a subpackage by its `__init__.py`) and what it owns."""
    parts = []
    for package in PACKAGES:
        rows = []
        for path in sorted((root / package).rglob("*.py")):
            relative = path.relative_to(root)
            if path.name == "__main__.py":
                continue
            name = f"{relative.parent}/" if path.name == "__init__.py" else str(relative)
            rows.append(f"| `{name}` | {summary(path)} |")
        parts.append(f"### `{package}/`\n\n| module | owns |\n|---|---|\n" + "\n".join(rows) + "\n")
    return "\n".join(parts)


def render(page: str, table: str) -> str:
    """`page` with the text between its markers replaced by `table`."""
    if page.count(BEGIN) != 1 or page.count(END) != 1 or page.index(BEGIN) > page.index(END):
        raise ValueError(f"the page needs one {BEGIN!r} line and, after it, one {END!r} line")
    head, rest = page.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n\n{table}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m devtools.doctools.modmap", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--root", type=Path, default=Path("."), help="the checkout (default: here)")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if the page is stale")
    args = parser.parse_args(argv)
    page = args.root / PAGE
    current = page.read_text()
    wanted = render(current, module_map(args.root))
    if current == wanted:
        return 0
    if args.check:
        print(f"{page} is stale: run `python -m devtools.doctools.modmap`", file=sys.stderr)
        return 1
    page.write_text(wanted)
    print(f"{page}: module map rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
