"""The README's examples run as written."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_ten_line_example_runs(capsys):
    exec(compile(blocks()[0], "README.md[0]", "exec"), {"__name__": "__readme__"})
    assert capsys.readouterr().out.strip().startswith("tensor(")


@pytest.mark.smollm2
def test_language_model_example_answers_paris(capsys):
    ns = {"__name__": "__readme__"}
    exec(compile(blocks()[0], "README.md[0]", "exec"), ns)
    exec(compile(blocks()[1], "README.md[1]", "exec"), ns)
    assert "' Paris'" in capsys.readouterr().out
