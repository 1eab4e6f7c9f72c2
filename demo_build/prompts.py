"""Benchmark prompts from held-out modules: each function's header and docstring, up to its first body line."""

import ast
from pathlib import Path

from demo_build.corpus import read_text, stdlib_root


def heldout_prompts(files: list[Path], limit: int = 48, max_chars: int = 600) -> list[dict]:
    prompts = []
    for path in files:
        source = read_text(path)
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        lines = source.splitlines(keepends=True)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or len(node.body) < 2:
                continue
            first_body = node.body[1] if ast.get_docstring(node) else node.body[0]
            start = node.lineno - 1 - len(node.decorator_list)
            text = "".join(lines[start: first_body.lineno - 1])
            if 80 <= len(text) <= max_chars:
                prompts.append({"source": str(path.relative_to(stdlib_root())), "function": node.name,
                                "prompt": text})
    step = max(1, len(prompts) // limit)
    return prompts[::step][:limit]
