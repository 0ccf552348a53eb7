"""Code size of the ``ken`` package: the largest modules and classes and the imports made
inside functions (issue 32's before/after figures).

    python benchmarks/code_size.py [PACKAGE_DIR]      # default: ken
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def measure(root: Path) -> dict:
    modules, classes, local = [], [], {}
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        tree = ast.parse(text)
        modules.append((len(text.splitlines()), str(path)))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes.append((node.end_lineno - node.lineno + 1, f"{path}:{node.name}"))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                found = sum(isinstance(n, ast.Import | ast.ImportFrom) for n in ast.walk(node))
                if found:
                    local[str(path)] = local.get(str(path), 0) + found
    return {"modules": sorted(modules, reverse=True), "classes": sorted(classes, reverse=True),
            "local_imports": local}


def main() -> int:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "ken")
    m = measure(root)
    print(f"{len(m['modules'])} modules, {sum(n for n, _ in m['modules']):,} lines")
    print("ten largest modules:")
    for n, p in m["modules"][:10]:
        print(f"  {n:5d} {p}")
    print("five largest classes:")
    for n, p in m["classes"][:5]:
        print(f"  {n:5d} {p}")
    top = sorted(m["local_imports"].items(), key=lambda kv: -kv[1])[:5]
    print(f"imports inside functions: {sum(m['local_imports'].values())} "
          f"(most: {', '.join(f'{p} {n}' for p, n in top)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
