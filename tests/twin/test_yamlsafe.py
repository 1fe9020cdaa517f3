"""Bounded YAML loading (twin.yamlsafe) and the readers that use it: replay and policy files."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from twin.errors import ConfigError
from twin.policies import ReplayPolicy, load_policy_file
from twin.yamlsafe import clip, load_yaml_file, load_yaml_text


def _bomb(levels: int, width: int = 10) -> str:
    lines = [f"l0: &l0 [{', '.join(['x'] * width)}]"]
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]")
    return "\n".join(lines) + "\n"


def test_alias_bomb_is_refused() -> None:
    text = _bomb(9)  # about 400 bytes; 10**9 scalars with the aliases expanded
    with pytest.raises(ConfigError, match=r"more than 1,000 nodes"):
        load_yaml_text(text, what="recipe 'x'", max_nodes=1_000)
    with pytest.raises(ConfigError, match=r"more than [\d,]+ nodes"):
        load_yaml_text(text, what="recipe 'x'")


def test_aliases_within_the_budget_load_as_before() -> None:
    data = load_yaml_text(_bomb(3), what="x")
    assert len(data["l2"]) == 10 and data["l2"][0][0] == ["x"] * 10
    assert load_yaml_text("a: &a {k: 1}\nb: *a\n", what="x") == {"a": {"k": 1}, "b": {"k": 1}}
    assert load_yaml_text("", what="x") is None


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("&a [*a]", "contains itself"),
        ("[" * 3000, "nested too deeply|not valid YAML"),
        ("a: 1\n---\nb: 2\n", "not valid YAML"),
        ("a: [1, 2\n", "not valid YAML"),
        ("!!python/object/apply:os.system ['true']", "not valid YAML"),
    ],
)
def test_bad_documents_are_one_line_errors(text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        load_yaml_text(text, what="x")
    assert "\n" not in str(info.value)


def test_files_that_are_not_yaml_text(tmp_path: Path) -> None:
    (tmp_path / "bin.yaml").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe")
    (tmp_path / "nul.yaml").write_bytes(b"a: 1\x00\n")
    (tmp_path / "big.yaml").write_text("a: 1\n" * 100)
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_yaml_file(tmp_path / "bin.yaml", what="recipe")
    with pytest.raises(ConfigError, match="binary"):
        load_yaml_file(tmp_path / "nul.yaml", what="recipe")
    with pytest.raises(ConfigError, match="500 bytes; YAML files up to 100"):
        load_yaml_file(tmp_path / "big.yaml", what="recipe", max_bytes=100)
    with pytest.raises(ConfigError, match="is a folder"):
        load_yaml_file(tmp_path, what="recipe")
    with pytest.raises(ConfigError, match="could not be read"):
        load_yaml_file(tmp_path / "missing.yaml", what="recipe")


@settings(max_examples=50, deadline=None)
@given(st.text(max_size=2000), st.integers(min_value=1, max_value=300))
def test_clip_is_one_bounded_line(text: str, limit: int) -> None:
    out = clip(text, limit)
    assert "\n" not in out
    assert len(out) <= limit + len(f"... ({len(text)} characters)")


def test_replay_and_policy_files_use_the_bounded_loader(tmp_path: Path) -> None:
    bomb = tmp_path / "turns.yaml"
    bomb.write_text(_bomb(9) + "turns: *l8\n")
    with pytest.raises(ConfigError, match=r"replay file .*turns\.yaml.*more than"):
        ReplayPolicy.from_file(bomb)
    with pytest.raises(ConfigError, match=r"policy file .*turns\.yaml.*more than"):
        load_policy_file(bomb)
    binary = tmp_path / "policy.yaml"
    binary.write_bytes(bytes(range(256)))
    with pytest.raises(ConfigError, match="policy file .* not UTF-8"):
        load_policy_file(binary)
