"""Write examples/docstrings.jsonl: the docstrings of six standard-library packages, one JSON
object per line, {"text": <docstring>, "source": <package>} (a small corpus with a source field,
made from the running Python, nothing downloaded).

    .venv/bin/python examples/make_docstrings.py [OUT]
"""

import ast
import json
import sys
import sysconfig
from pathlib import Path

PACKAGES = ("asyncio", "email", "http", "json", "logging", "unittest")


def docstrings(package: str):
    root = Path(sysconfig.get_paths()["stdlib"]) / package
    for path in sorted(root.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                text = ast.get_docstring(node)
                if text and len(text) >= 80:
                    yield text


def main(out: str = str(Path(__file__).with_name("docstrings.jsonl"))) -> None:
    seen, n = set(), 0
    with open(out, "w", encoding="utf-8") as f:
        for package in PACKAGES:
            for text in docstrings(package):
                if text not in seen:
                    seen.add(text)
                    f.write(json.dumps({"text": text, "source": package}) + "\n")
                    n += 1
    print(f"{out}: {n} documents from {', '.join(PACKAGES)}")


if __name__ == "__main__":
    main(*sys.argv[1:])
