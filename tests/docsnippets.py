"""Extract the ```python blocks of a docs page so a test can execute them."""

import pathlib
import re

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"


def python_blocks(page: str) -> list[str]:
    text = (DOCS / page).read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def run_page(page: str, namespace: dict | None = None) -> dict:
    """Execute every python block of ``page`` in order in one namespace; return it."""
    ns = {} if namespace is None else namespace
    ns.setdefault("__name__", "__docs__")
    for i, block in enumerate(python_blocks(page)):
        code = compile(block, f"{page}[block {i}]", "exec")
        exec(code, ns)  # noqa: S102 - our own documentation
    return ns
