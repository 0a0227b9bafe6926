"""Every module of the project imports the project as ``rollcall.*``: a bare
``import worker`` would load a second copy of a module (two ``Config``
classes, two error hierarchies) or a user's own ``worker.py``."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OLD_NAMES = {"membership", "rendezvous", "worker"}
FOLDERS = ("membership", "rendezvous", "worker", "rollcall", "tests", "bench", "scripts", "docs")


def bare_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names
                  if n.split(".")[0] in OLD_NAMES]  # fmt: skip
    return found


def test_no_module_imports_a_bare_top_level_package():
    sources = [
        p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py")
        if "pb" not in p.relative_to(ROOT).parts[:2]
    ]  # fmt: skip
    assert len(sources) > 50
    offenders = [line for path in sources for line in bare_imports(path)]
    assert offenders == [], "import these as rollcall.*: " + ", ".join(offenders)
