"""scripts/long_functions.py: the rule `make lint` applies to function length."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "long_functions", ROOT / "scripts" / "long_functions.py"
)
assert _spec and _spec.loader
long_functions_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(long_functions_module)
long_functions = long_functions_module.long_functions


def _function(name: str, body_lines: int, above: str = "", decorator: str = "") -> str:
    head = (f"{above}\n" if above else "") + (f"{decorator}\n" if decorator else "")
    body = "".join(f"    x{i} = {i}\n" for i in range(body_lines))
    return f"{head}def {name}():\n{body}"


def test_a_function_over_the_limit_is_listed_with_its_length_and_line():
    source = "import os\n\n" + _function("short", 10) + "\n" + _function("big", 85)
    found = long_functions(source, "m.py")
    assert [(f.name, f.length, f.line) for f in found] == [("big", 86, 15)]


def test_exactly_the_limit_passes_and_one_more_line_does_not():
    assert long_functions(_function("edge", 79)) == []  # def line + 79 = 80
    assert [f.length for f in long_functions(_function("over", 80))] == [81]


def test_a_reason_above_the_def_or_its_decorators_accepts_it():
    reason = "# long: a table of cases"
    assert long_functions(_function("f", 90, above=reason)) == []
    assert long_functions(_function("g", 90, above=reason, decorator="@staticmethod")) == []


@pytest.mark.parametrize("above", ["# long:", "# long:   ", "# a long function", "x = 1"])
def test_an_empty_or_other_comment_is_no_reason(above):
    assert [f.name for f in long_functions(_function("f", 90, above=above))] == ["f"]


def test_methods_and_async_functions_count_too():
    method = "class C:\n" + "".join(
        "    " + line + "\n" for line in _function("m", 85).splitlines()
    )
    source = method + "\nasync " + _function("a", 85)
    assert sorted(f.name for f in long_functions(source)) == ["a", "m"]


def test_the_command_exits_1_and_names_the_offender(tmp_path, capsys):
    (tmp_path / "ok.py").write_text(_function("fine", 5))
    (tmp_path / "bad.py").write_text(_function("huge", 100))
    assert long_functions_module.main([str(tmp_path)]) == 1
    assert "bad.py:1 huge" in capsys.readouterr().out
    (tmp_path / "bad.py").write_text(_function("huge", 100, above="# long: generated table"))
    assert long_functions_module.main([str(tmp_path)]) == 0
