"""The share of docstring lines in the non-test source: at most :data:`MAX_SHARE` (docs/ARCHITECTURE.md, "Layout").

A module docstring says what the module is for in about a dozen lines; the long stories live once in
docs/ARCHITECTURE.md. Lines are non-blank lines; a docstring is the first statement of a module, class or function
when it is a string. Run ``python -m tests.test_docstring_share`` for the share per package.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_SHARE = 0.20
MAX_MODULE_DOCSTRING = 20  # non-blank lines; "about 12" is the guide, this the hard stop
SKIPPED_DIRS = frozenset({"tests", "runs", "build", "dist", "node_modules"})


def source_files(root: Path) -> list[Path]:
    """Every ``.py`` file under ``root`` outside tests and hidden/build folders."""
    return [
        path
        for path in sorted(root.rglob("*.py"))
        if not any(part in SKIPPED_DIRS or part.startswith(".") for part in path.relative_to(root).parts[:-1])
    ]


def docstring_lines(source: str) -> tuple[int, int, int]:
    """(non-blank lines, non-blank docstring lines, non-blank lines of the module docstring) of one file.

    Raises SyntaxError if ``source`` does not parse.
    """
    lines = source.splitlines()
    nonblank = lambda a, b: sum(1 for line in lines[a:b] if line.strip())
    tree = ast.parse(source)
    doc = module_doc = 0
    for node in ast.walk(tree):
        if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) or not node.body:
            continue
        first = node.body[0]
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            n = nonblank(first.lineno - 1, first.end_lineno)
            doc += n
            if isinstance(node, ast.Module):
                module_doc = n
    return nonblank(0, len(lines)), doc, module_doc


def shares(root: Path) -> dict[str, tuple[int, int]]:
    """Top-level package (``.`` for files at the root) -> (non-blank lines, docstring lines)."""
    out: dict[str, tuple[int, int]] = {}
    for path in source_files(root):
        rel = path.relative_to(root)
        top = rel.parts[0] if len(rel.parts) > 1 else "."
        n, d, _ = docstring_lines(path.read_text())
        a, b = out.get(top, (0, 0))
        out[top] = (a + n, b + d)
    return out


def long_module_docstrings(root: Path) -> list[str]:
    """Files whose module docstring runs over :data:`MAX_MODULE_DOCSTRING` non-blank lines, as ``"path: N"``."""
    found = []
    for path in source_files(root):
        n = docstring_lines(path.read_text())[2]
        if n > MAX_MODULE_DOCSTRING:
            found.append(f"{path.relative_to(root)}: {n}")
    return found


def total_share(root: Path) -> float:
    per = shares(root).values()
    return sum(d for _, d in per) / max(1, sum(n for n, _ in per))


def test_docstrings_are_at_most_a_fifth_of_the_source():
    share = total_share(ROOT)
    assert share <= MAX_SHARE, f"docstrings are {share:.1%} of the non-test lines (at most {MAX_SHARE:.0%})"


def test_module_docstrings_fit_on_a_screen():
    assert not long_module_docstrings(ROOT), f"module docstrings over {MAX_MODULE_DOCSTRING} lines"


def test_the_measure_counts_docstrings_and_only_them(tmp_path):
    """A made-up tree: module, class and function docstrings count; comments, strings and tests do not."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "pkg" / "a.py").write_text(
        '"""One.\n\nTwo.\n"""\n\n# a comment\nX = "not a docstring"\n\n\n'
        'class C:\n    """Class."""\n\n    def f(self):\n        """F."""\n        return 1\n'
    )
    (tmp_path / "tests" / "t.py").write_text('"""Not counted."""\n')
    (tmp_path / "pkg" / "b.py").write_text('"""' + "line\n" * (MAX_MODULE_DOCSTRING + 1) + '"""\n')
    assert shares(tmp_path)["pkg"] == (10 + MAX_MODULE_DOCSTRING + 2, 5 + MAX_MODULE_DOCSTRING + 2)
    assert long_module_docstrings(tmp_path) == [f"pkg/b.py: {MAX_MODULE_DOCSTRING + 2}"]


if __name__ == "__main__":
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    for top, (n, d) in sorted(shares(root).items(), key=lambda kv: -kv[1][1]):
        print(f"{top:14s} {n:6d} lines {d:6d} docstring {d / max(1, n):6.1%}")
    print(f"{'total':14s} share {total_share(root):.1%}")
    print("\n".join(long_module_docstrings(root)))
