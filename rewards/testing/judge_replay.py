"""A recorded judge: judge terms scored from stored answers, offline, in rollout files and tests.

A rollout file declares where the answers come from::

    twin: Catalog
    reward: envs.catalog.reason_judge:reason_judge_reward
    judge:
      recording: catalog-judge.answers.yaml   # {prompt key: answer}, next to the rollout file
    cases:
      - name: reason cites the typosquatted brand
        judge_answers: ["The reason names the brand typo.\\nSCORE: 5"]   # in the order asked
        ...

Each judge request is answered by the case's ``judge_answers`` (in order), else by the file's
recording (``recording:`` file and inline ``answers:``, keyed by
:func:`rewards.judge.prompt_key`, the SHA-256 of the request's messages). A request with no
recorded answer is an error naming its key and the start of its prompt: the test never calls a
live judge. Answers are checked with the term's own parser, so a malformed recording fails
like a malformed live answer.

Make a recording by scoring once through a real judge wrapped in :class:`RecordingJudge`
(``judge_override(RecordingJudge(real))``, then ``.save(path)``), or from a judge's disk cache
with :func:`export_recording`.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rewards.judge import JudgeAnswer, JudgeError, Messages, Parser, judge_override, prompt_key
from twin.errors import ConfigError
from twin.yamlsafe import load_yaml_file

__all__ = [
    "JudgeReplaySpec",
    "RecordedJudge",
    "RecordingJudge",
    "export_recording",
    "load_recording",
    "replaying",
]


class JudgeReplaySpec(BaseModel):
    """A rollout file's ``judge:`` section.

    Attributes:
        recording: A YAML/JSON file of ``{prompt key: answer}`` (relative to the rollout file).
        answers: Inline ``{prompt key: answer}`` (wins over the recording).
    """

    model_config = ConfigDict(extra="forbid")

    recording: str | None = None
    answers: dict[str, str] = Field(default_factory=dict)


def load_recording(path: str | Path) -> dict[str, str]:
    """Read a recording: a mapping of prompt key -> answer text (optionally under ``answers:``).

    Raises:
        ConfigError: missing file, not a mapping, or a value that is not text.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(
            f"judge recording {str(p)!r} not found; make one with RecordingJudge.save or "
            "export_recording"
        )
    data = load_yaml_file(p, what="judge recording")
    if isinstance(data, dict) and set(data) == {"answers"}:
        data = data["answers"]
    if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
        raise ConfigError(f"judge recording {str(p)!r} must map prompt keys to answer text")
    return {str(k): v for k, v in data.items()}


class RecordedJudge:
    """Answers judge requests from stored answers (a stand-in for :class:`rewards.judge.Judge`).

    Args:
        answers: ``{prompt key: answer}``.
        in_order: Answers handed out in order to requests that have no keyed answer.
        source: Where the answers came from (named in errors).
    """

    spec = "recorded"

    def __init__(
        self,
        answers: dict[str, str] | None = None,
        in_order: Sequence[str] = (),
        source: str = "the rollout file",
    ) -> None:
        self.answers = dict(answers or {})
        self.in_order = list(in_order)
        self.source = source
        self.asked: list[str] = []
        self._lock = threading.Lock()

    def _answer(self, messages: Messages) -> str:
        key = prompt_key(messages)
        with self._lock:
            self.asked.append(key)
            if key in self.answers:
                return self.answers[key]
            if self.in_order:  # the same request asked again gets the same answer
                self.answers[key] = self.in_order.pop(0)
                return self.answers[key]
        prompt = " ".join(str(messages[-1].get("content") or "").split())[:200] if messages else ""
        raise JudgeError(
            f"no recorded judge answer for request {key} in {self.source} (prompt starts "
            f"{prompt!r}); "
            "add it to the case's `judge_answers:` or to the file's `judge:` recording"
        )

    def ask_many(
        self, requests: Sequence[Messages], parse: Parser | Sequence[Parser | None] | None = None
    ) -> list[JudgeAnswer]:
        """The recorded answer of each request, checked with its parser.

        Raises:
            JudgeError: a request without a recorded answer, or an answer the parser rejects.
        """
        parsers = list(parse) if isinstance(parse, (list, tuple)) else [parse] * len(requests)
        out = []
        for messages, check in zip(requests, parsers):
            text = self._answer(list(messages))
            if check is not None:
                try:
                    check(text)
                except ValueError as exc:
                    raise JudgeError(
                        f"recorded judge answer {text[:200]!r} is malformed: {exc}"
                    ) from None
            key = prompt_key(list(messages))
            out.append(
                JudgeAnswer(key=key, prompt_key=key, text=text, cached=True, judge=self.spec)
            )
        return out


class RecordingJudge:
    """Wraps a real judge and keeps every answer it gives, to save as a recording.

    ::

        recorder = RecordingJudge(Judge("openai:gpt-4o-mini"))
        with judge_override(recorder):
            score_episodes(reward, episodes)
        recorder.save("catalog-judge.answers.yaml")
    """

    def __init__(self, judge: Any) -> None:
        self.judge = judge
        self.spec = getattr(judge, "spec", "judge")
        self.answers: dict[str, str] = {}

    def ask_many(self, requests: Sequence[Messages], parse: Any = None) -> list[JudgeAnswer]:
        """Ask the wrapped judge and keep the answers."""
        got = self.judge.ask_many(requests, parse)
        for a in got:
            self.answers[a.prompt_key] = a.text
        return got

    def save(self, path: str | Path) -> Path:
        """Write the answers as a recording (JSON, which YAML readers read too)."""
        p = Path(path)
        p.write_text(
            json.dumps({"answers": self.answers}, indent=1, ensure_ascii=False), encoding="utf-8"
        )
        return p


def export_recording(cache_dir: str | Path, path: str | Path) -> int:
    """Write every answer in a judge's disk cache as a recording; return how many."""
    answers: dict[str, str] = {}
    for f in sorted(Path(cache_dir).glob("*/*.json")):
        try:
            record = json.loads(f.read_text(encoding="utf-8"))
            answers[str(record["prompt_key"])] = str(record["answer"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    Path(path).write_text(
        json.dumps({"answers": answers}, indent=1, ensure_ascii=False), encoding="utf-8"
    )
    return len(answers)


@contextlib.contextmanager
def replaying(
    spec: JudgeReplaySpec | None, case_answers: Sequence[str] | None, file: str = "<memory>"
) -> Iterator[RecordedJudge | None]:
    """Within the block, judge terms answer from the file's recording and the case's answers;
    without either, nothing changes (the reward's own judge is used)."""
    if spec is None and case_answers is None:
        yield None
        return
    answers: dict[str, str] = {}
    if spec is not None and spec.recording:
        base = Path(file).parent if file != "<memory>" else Path.cwd()
        answers.update(load_recording(base / spec.recording))
    if spec is not None:
        answers.update(spec.answers)
    recorded = RecordedJudge(answers, case_answers or (), source=file)
    with judge_override(recorded):
        yield recorded
