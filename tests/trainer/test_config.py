"""Recipes: every shipped recipe validates; unknown keys fail with a suggestion; overrides are
typed."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from trainer.config import Recipe, apply_overrides, load_recipe
from twin.errors import ConfigError
from twin.resources import data_path

RECIPES = sorted(data_path("recipes").glob("*.yaml"))
BASE = {"twin": {"name": "Toy"}}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_shipped_recipes_validate(path: Path) -> None:
    recipe = load_recipe(path)
    assert isinstance(recipe, Recipe)
    header = path.read_text().splitlines()[0]
    assert header.startswith("#"), "recipes start with a header comment"
    comments = "\n".join(line for line in path.read_text().splitlines() if line.startswith("#"))
    command = "twin sft" if recipe.algorithm.name == "sft" else "twin train"
    assert (
        f"{command} data/recipes/{path.name}" in comments
        or f"twin train data/recipes/{path.name}" in comments
    ), "the header shows the exact command that runs this recipe"


def test_expected_recipes_are_shipped() -> None:
    names = {p.name for p in RECIPES}
    assert {
        "toy-cpu.yaml",
        "catalog-tiny-cpu.yaml",
        "catalog-smollm2-cpu.yaml",
        "catalog-9b-2x96gb.yaml",
    } <= names


def test_load_by_name_equals_by_path() -> None:
    assert load_recipe("toy-cpu") == load_recipe(data_path("recipes", "toy-cpu.yaml"))


def test_unknown_key_names_the_nearest() -> None:
    with pytest.raises(ConfigError, match=r"optim\.lrr.*Did you mean 'optim\.lr'"):
        load_recipe({**BASE, "optim": {"lrr": 1.0}})
    with pytest.raises(ConfigError, match=r"Did you mean 'algorithm'"):
        load_recipe({**BASE, "algorithim": {}})


def test_unknown_override_key_fails() -> None:
    with pytest.raises(ConfigError, match="sampler.max_new_token"):
        load_recipe(BASE, ["sampler.max_new_token=3"])


def test_overrides_are_yaml_typed() -> None:
    r = load_recipe(
        BASE,
        [
            "optim.lr=1e-4",
            "train.steps=7",
            "algorithm.dynamic_sampling=false",
            "lora.target_modules=[q_proj, v_proj]",
            "algorithm.tis_cap=null",
            "async.max_staleness=1",
            "twin.config.num_words=2",
        ],
    )
    assert r.optim.lr == pytest.approx(1e-4) and isinstance(r.optim.lr, float)
    assert r.train.steps == 7
    assert r.algorithm.dynamic_sampling is False
    assert r.lora.target_modules == ["q_proj", "v_proj"]
    assert r.algorithm.tis_cap is None
    assert r.async_.max_staleness == 1
    assert r.twin.config == {"num_words": 2}


def test_bad_value_says_where_and_what() -> None:
    with pytest.raises(ConfigError, match=r"algorithm\.advantage"):
        load_recipe(BASE, ["algorithm.advantage=ppo"])
    with pytest.raises(ConfigError, match="key.path=value"):
        apply_overrides({}, ["optim.lr"])


def test_kl_needs_lora() -> None:
    with pytest.raises(ConfigError, match="kl_coef"):
        load_recipe(BASE, ["algorithm.kl_coef=0.1", "lora.enabled=false"])


def test_server_sampler_needs_url() -> None:
    with pytest.raises(ConfigError, match="base_url"):
        load_recipe(BASE, ["sampler.kind=server"])


def test_round_trip_yaml() -> None:
    r = load_recipe("toy-cpu", ["optim.lr=2e-3"])
    again = load_recipe(yaml.safe_load(r.to_yaml()))
    assert again == r


def test_every_field_is_documented() -> None:
    def walk(model: type) -> None:
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"
            ann = field.annotation
            if isinstance(ann, type) and hasattr(ann, "model_fields"):
                walk(ann)

    walk(Recipe)


def test_missing_recipe_file() -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_recipe("no-such-recipe")


def test_length_curriculum() -> None:
    from trainer.runtime import LengthCurriculum

    def curriculum(*overrides: str) -> LengthCurriculum:
        return LengthCurriculum(load_recipe(BASE, list(overrides)).sampler)

    r = curriculum(
        "sampler.max_new_tokens=10",
        "sampler.length_curriculum=linear",
        "sampler.max_new_tokens_ramp=100",
    )
    limits = [r.max_new_tokens(s) for s in range(0, 130, 10)]
    assert limits[0] == 1 and limits[-1] == 10 and limits == sorted(limits)
    assert curriculum("sampler.max_new_tokens=10").max_new_tokens(0) == 10
    p = curriculum("sampler.max_new_tokens=3", "sampler.length_curriculum=plateau")
    assert p.max_new_tokens(0) == 1
    p.grow([], 0.0)  # the first step sets the level this length starts from
    p.grow([], 0.005)  # nothing learned yet (noise): stay
    assert p.max_new_tokens(1) == 1
    p.grow(["informative group"], 0.2)  # still learning this length: stay
    assert p.max_new_tokens(2) == 1
    p.grow([], 0.2)  # settled above the last level: grow
    assert p.max_new_tokens(3) == 2
    p.grow([], 0.2)  # no progress at the new length: stay
    assert p.max_new_tokens(4) == 2
    p.grow([], 0.5)
    p.grow([], 0.9)
    assert p.max_new_tokens(5) == 3, "capped at max_new_tokens"
    restored = curriculum("sampler.max_new_tokens=3", "sampler.length_curriculum=plateau")
    restored.load_state_dict(p.state_dict())  # a checkpoint carries the curriculum
    assert restored.max_new_tokens(6) == 3 and restored.state_dict() == p.state_dict()


def test_entropy_coef_defaults_off_and_must_be_non_negative() -> None:
    from pydantic import ValidationError

    from trainer.config import AlgorithmConfig

    assert AlgorithmConfig().entropy_coef == 0.0
    assert AlgorithmConfig(entropy_coef=0.01).entropy_coef == 0.01
    with pytest.raises(ValidationError):
        AlgorithmConfig(entropy_coef=-0.1)


def test_linear_lr_decay() -> None:
    from trainer.config import OptimConfig

    assert OptimConfig(lr=1e-3).lr_at(500) == 1e-3  # constant by default
    o = OptimConfig(lr=3e-3, lr_end=1e-3, lr_decay_steps=4)
    assert [round(o.lr_at(s), 6) for s in (0, 1, 2, 4, 9)] == [0.003, 0.0025, 0.002, 0.001, 0.001]
    with pytest.raises(ConfigError, match="lr_end"):
        load_recipe("toy-cpu", ["optim.lr_end=-1"])


def _float_fields() -> list[tuple[str, str]]:
    """``(dotted key, override value)`` for every float (or float pair) field of a recipe."""
    out = []
    for section, field in Recipe.model_fields.items():
        model = field.annotation
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            continue
        for name, sub in model.model_fields.items():
            if _has_float(sub.annotation):
                pair = typing.get_origin(sub.annotation) is tuple
                out.append((f"{field.alias or section}.{name}", "[0.9, {}]" if pair else "{}"))
    return out


def _has_float(annotation: object) -> bool:
    return annotation is float or any(_has_float(a) for a in typing.get_args(annotation))


@pytest.mark.parametrize("key,template", _float_fields(), ids=lambda v: v if "." in str(v) else "")
@pytest.mark.parametrize("bad", [".inf", "-.inf", ".nan"])
def test_every_recipe_float_must_be_finite(key: str, template: str, bad: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(key) + ".*finite number"):
        load_recipe(BASE, [f"{key}={template.format(bad)}"])


def test_float_fields_are_found() -> None:
    keys = {k for k, _ in _float_fields()}
    assert {
        "optim.lr",
        "optim.betas",
        "optim.grad_clip",
        "sampler.temperature",
        "algorithm.tis_cap",
    } <= keys


BOMB = """twin: {name: Toy}
seed: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]
model: {path: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]}
lora: {target_modules: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]}
sampler: {base_url: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]}
train: {output_dir: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]}
devices: {learner: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e, *e]}
async: {queue_size: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f, *f]}
optim: {lr: [*g, *g, *g, *g, *g, *g, *g, *g, *g, *g]}
"""


def test_alias_bomb_is_refused_before_anything_walks_it(tmp_path: Path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB)  # under 700 bytes; 10**9 values once its aliases are expanded
    with pytest.raises(ConfigError, match=r"bomb\.yaml.*more than [\d,]+ nodes.*aliases") as info:
        load_recipe(path)
    assert "\n" not in str(info.value) and len(str(info.value)) < 400


def test_a_bad_value_is_quoted_briefly(tmp_path: Path) -> None:
    path = tmp_path / "big.yaml"
    path.write_text(
        "twin: {name: Toy, config: {x: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]}}\n"
        "model: {path: &b [*a, *a, *a, *a, *a, *a, *a, *a]}\n"
        "lora: {target_modules: [*b, *b, *b, *b, *b, *b, *b, *b]}\n"
    )
    with pytest.raises(ConfigError) as info:
        load_recipe(path)
    message = str(info.value)
    assert "model.path" in message and "lora.target_modules.0" in message
    assert "more" in message  # 8 bad list items and model.path: the first few are shown
    assert len(message) < 1000 and "\n" not in message


def test_binary_recipe_is_a_one_line_error(tmp_path: Path) -> None:
    path = tmp_path / "model.yaml"
    path.write_bytes(b"\x7fELF\x02\x01\x01\x00\x00\x00\xf0\x9f\xff" * 20)
    with pytest.raises(ConfigError, match=r"model\.yaml.*(not UTF-8|binary)"):
        load_recipe(path)


def test_devices_are_cpu_or_cuda() -> None:
    for bad in ("gpu", "cuda:x", "cpu0", ""):
        with pytest.raises(ConfigError, match=r"devices\.learner"):
            load_recipe(BASE, [f"devices.learner={bad!r}"])
    assert load_recipe(BASE, ["devices.learner=cuda:3"]).devices.learner == "cuda:3"


def test_check_devices_refuses_gpus_this_machine_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from trainer.config import check_devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_devices(load_recipe(BASE, ["devices.learner=cuda:1", "devices.rollout=cuda"]))
    with pytest.raises(
        ConfigError, match=r"devices\.learner 'cuda:9': this machine has 2 CUDA device"
    ):
        check_devices(load_recipe(BASE, ["devices.learner=cuda:9"]))
    with pytest.raises(ConfigError, match=r"devices\.learner 'cuda:9'"):
        check_devices(load_recipe(BASE, ["devices.learner=cuda:9"]), visible_only=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ConfigError, match=r"devices\.rollout 'cuda:0': no CUDA device is visible"):
        check_devices(load_recipe(BASE, ["devices.rollout=cuda:0"]))
    # planning for another box: its GPU count (2 by default) bounds the indices
    check_devices(load_recipe(BASE, ["devices.learner=cuda:1"]), visible_only=True)
    with pytest.raises(
        ConfigError,
        match=r"devices\.learner 'cuda:9': the plan is for a machine with 2 GPU.*--gpus",
    ):
        check_devices(load_recipe(BASE, ["devices.learner=cuda:9"]), visible_only=True)
    check_devices(load_recipe(BASE, ["devices.learner=cuda:9"]), visible_only=True, planned_gpus=10)


@pytest.mark.parametrize(
    ("dtype", "learner"), [("bfloat16", "cpu"), ("float16", "cpu"), ("auto", "cuda:0")]
)
def test_full_fine_tuning_without_fp32_weights_is_refused(dtype: str, learner: str) -> None:
    """bf16 weights have no fp32 master copy under AdamW: small updates would round away."""
    with pytest.raises(
        ConfigError, match=r"full fine-tuning \(lora.enabled: false\) needs float32 weights"
    ):
        load_recipe(
            BASE, ["lora.enabled=false", f"model.dtype={dtype}", f"devices.learner={learner}"]
        )


@pytest.mark.parametrize("override", ["sampler.kind=vllm", "sampler.base_url=http://x:1"])
def test_full_fine_tuning_with_a_sampler_server_is_refused(override: str) -> None:
    """LoRA only past the in-process sampler: no full-weight sync to a server exists."""
    with pytest.raises(ConfigError, match="needs the in-process sampler"):
        load_recipe(
            BASE,
            ["lora.enabled=false", "model.dtype=float32", "sampler.kind=server", override]
            if "base_url" in override
            else ["lora.enabled=false", "model.dtype=float32", override],
        )


def test_full_fine_tuning_in_fp32_with_bf16_autocast_is_allowed() -> None:
    recipe = load_recipe(
        BASE, ["lora.enabled=false", "model.dtype=float32", "model.autocast=bfloat16"]
    )
    assert recipe.model.autocast == "bfloat16"
    assert load_recipe(BASE, ["lora.enabled=false"]).model.dtype == "auto"  # auto on CPU = float32
    with pytest.raises(ConfigError, match="model.autocast"):
        load_recipe(BASE, ["model.autocast=int8"])


def test_bf16_weights_lose_small_adamw_updates_that_fp32_weights_keep() -> None:
    """Why the refusal above: one AdamW step of lr 1e-5 on weights of 0.5 changes no bf16 weight."""
    import torch

    for dtype, changed in ((torch.bfloat16, False), (torch.float32, True)):
        w = torch.nn.Parameter(torch.full((64,), 0.5, dtype=dtype))
        opt = torch.optim.AdamW([w], lr=1e-5, weight_decay=0.0)
        w.grad = torch.ones_like(w)
        before = w.detach().clone()
        opt.step()
        assert bool((w.detach() != before).any()) is changed
