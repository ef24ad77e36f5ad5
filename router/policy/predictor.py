"""Tool-call duration prediction (Tokencake section 4.1), pure and clock-free.

A tool call's duration is predicted per (agent role, tool key). Before a key has been
seen, a cold-start default for its *kind* answers (file tools are sub-second, shell
commands seconds, subagents and humans minutes); after the first observation an
exponentially weighted moving average of observed gaps takes over. A client's own
estimate (`predict_time`) is blended with the history as Tokencake's equation 1:

    t_final = alpha * t_req + (1 - alpha) * t_hist

Every observed duration feeds the model, and the error of the prediction that was
made for it is kept per tool kind, so a benchmark can say how good the forecasts
were (MORI 3.2 warns they are often poor: this is where we measure that).
"""

from __future__ import annotations

import json
import re
import shlex
from collections import defaultdict, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from router.policy.residual import DurationDistribution
from router.policy.stats import percentile

# Tool names (lower-cased) by kind. Claude Code, OpenHands, SWE-agent and generic names.
_NAMES_BY_KIND = {
    "file": "read write edit multiedit glob grep ls notebookedit notebookread todowrite todoread "
    "str_replace_editor str_replace_based_edit_tool view read_file write_file edit_file "
    "list_dir list_files search_files create_file apply_patch",
    "shell": "bash shell run_command execute_bash execute_command run_shell_command terminal "
    "exec_command bashoutput killshell python ipython",
    "subagent": "task agent subagent dispatch_agent delegate",
    "web": "webfetch websearch web_search web_fetch fetch browser",
    "human": "human askuserquestion ask_user end_turn user",
}
KIND_OF_NAME = {name: kind for kind, names in _NAMES_BY_KIND.items() for name in names.split()}

# Cold-start durations in seconds per kind, before any observation of a key. Orders of
# magnitude from MORI Fig. 3 and traces.md (Claude Code: file tools ~0.1-1 s, shell
# seconds, Task ~90 s median, human turns minutes).
COLD_START_S: dict[str, float] = {
    "file": 0.5,
    "shell": 5.0,
    "shell_fast": 0.5,
    "shell_long": 30.0,
    "web": 3.0,
    "subagent": 90.0,
    "human": 60.0,
    "unknown": 5.0,
}

# Observations a key's distribution needs before its mean residual life is trusted.
MIN_DIST_SAMPLES = 8

# First words of shell commands whose duration class is known without history.
_FAST_WORDS = "ls cat head tail grep rg find echo pwd wc sed awk mkdir rm cp mv touch which git"
_LONG_WORDS = "pytest make cargo npm yarn pnpm pip uv go mvn gradle tox docker cmake ctest bazel"
_PREFIX_WORDS = "sudo time timeout nice env nohup exec command"
SHELL_FAST = frozenset(_FAST_WORDS.split())
SHELL_LONG = frozenset(_LONG_WORDS.split())
_SHELL_PREFIXES = frozenset(_PREFIX_WORDS.split())
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")  # FOO=1 pytest
_NUMBER = re.compile(r"^[0-9.]+[smh]?$")  # timeout 60 pytest


def tool_kind(tool: str) -> str:
    """The kind of a tool key ("Bash:pytest" -> "shell_long", "Read" -> "file")."""
    base, _, sub = tool.partition(":")
    kind = KIND_OF_NAME.get(base.strip().lower(), "unknown")
    word = sub if kind == "shell" else base if kind == "unknown" else ""  # "pytest" alone too
    if word in SHELL_FAST:
        return "shell_fast"
    if word in SHELL_LONG:
        return "shell_long"
    return kind


def shell_first_word(command: str | list[str]) -> str | None:
    """The program a shell command runs: skips `cd dir &&`, env assignments, sudo/timeout."""
    text = " ".join(command) if isinstance(command, list) else str(command)
    for segment in text.replace("||", "&&").replace(";", "&&").split("&&"):
        try:
            words = shlex.split(segment)
        except ValueError:
            words = segment.split()  # unbalanced quotes: best effort
        while words and (
            words[0] in _SHELL_PREFIXES or _ASSIGNMENT.match(words[0]) or _NUMBER.match(words[0])
        ):
            words = words[1:]
        if words and words[0] != "cd":
            if len(words) > 2 and words[0].startswith("python") and words[1] == "-m":
                return words[2]  # python -m pytest runs pytest
            return words[0].strip("\"'").rsplit("/", 1)[-1] or None
    return None


def _arguments(call: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    """(name, arguments) of an OpenAI `tool_call` or an Anthropic `tool_use` block."""
    fn = call.get("function")
    if isinstance(fn, Mapping):
        name, raw = fn.get("name") or "", fn.get("arguments") or {}
    else:
        name, raw = call.get("name") or "", call.get("input") or {}
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            raw = {}
    return str(name), raw if isinstance(raw, Mapping) else {}


def tool_key(call: Mapping[str, Any]) -> str:
    """The predictor's key for one tool call: its function name, plus the first word of
    the command for shell tools ("Bash:pytest"), since `ls` and `pytest` differ by 100x."""
    name, args = _arguments(call)
    if not name:
        return "unknown"
    if KIND_OF_NAME.get(name.lower()) == "shell":
        command = args.get("command", args.get("cmd"))
        word = shell_first_word(command) if isinstance(command, (str, list)) else None
        if word:
            return f"{name}:{word}"
    return name


def tool_key_of_calls(calls: Iterable[Mapping[str, Any]] | None) -> str:
    """One key for a response's tool calls. Parallel calls form one gap lasting as long as
    the longest (MORI 3.1), so the key with the longest cold-start default stands for them;
    no tool calls means the turn went back to the human."""
    keys = [tool_key(c) for c in calls or ()]
    if not keys:
        return "human"
    return max(keys, key=lambda k: COLD_START_S[tool_kind(k)])


@dataclass(frozen=True, slots=True)
class ErrorStats:
    """Prediction error of one tool kind over the observed calls."""

    n: int
    abs_p50_s: float
    abs_p90_s: float
    rel_p50: float
    rel_p90: float
    mean_actual_s: float
    mean_predicted_s: float


class DurationPredictor:
    """Per (agent role, tool key) EWMA of tool durations with cold-start defaults.

    Lookups fall back from the most to the least specific history: (agent, key), then
    (any agent, key), then (any agent, base tool name, e.g. "Bash"), then the kind's
    cold-start default. Every observation updates all three levels, and a duration
    distribution per level (`remaining_s`). Keys come from clients, so at most `max_keys`
    are kept (the oldest go first): hostile tool names cannot grow the router's memory.
    Inside, durations are trace seconds (the cold-start defaults and the distributions'
    bins are); callers speak their clock's, `time_scale` trace seconds a second.
    """

    def __init__(
        self,
        ewma_alpha: float = 0.3,
        hint_alpha: float = 0.5,
        max_samples: int = 100_000,
        max_keys: int = 4096,
        time_scale: float = 1.0,
    ) -> None:
        if not (0.0 < ewma_alpha <= 1.0 and 0.0 <= hint_alpha <= 1.0):
            raise ValueError("ewma_alpha must be in (0, 1] and hint_alpha in [0, 1]")
        self.ewma_alpha = ewma_alpha
        self.hint_alpha = hint_alpha
        self.max_keys = max_keys
        self.time_scale = time_scale
        self._ewma: dict[tuple[str | None, str], float] = {}
        self._dists: dict[tuple[str | None, str], DurationDistribution] = {}
        # (agent, tool) -> `_distribution`'s answer, until the next observation changes it
        self._chosen: dict[tuple[str | None, str], DurationDistribution | None] = {}
        self._errors: dict[str, deque[tuple[float, float]]] = defaultdict(
            lambda: deque(maxlen=max_samples)
        )

    @staticmethod
    @lru_cache(maxsize=4096)
    def _levels(agent: str | None, tool: str) -> tuple[tuple[str | None, str], ...]:
        base = tool.partition(":")[0]
        levels = [(agent, tool), (None, tool), (None, base)]
        return tuple(dict.fromkeys(levels))  # drop duplicates, keep order

    def history(self, agent: str | None, tool: str) -> float:
        """t_hist: the most specific EWMA seen so far, else the kind's cold-start default."""
        return self._history(agent, tool) / self.time_scale

    def _history(self, agent: str | None, tool: str) -> float:
        for level in self._levels(agent, tool):
            if level in self._ewma:
                return self._ewma[level]
        return COLD_START_S[tool_kind(tool)]

    def predict(self, agent: str | None, tool: str, hint_s: float | None = None) -> float:
        """Predicted duration in seconds; a client hint is blended by equation 1."""
        t_hist = self._history(agent, tool)
        if hint_s is not None and hint_s >= 0:
            t_hist = (
                self.hint_alpha * float(hint_s) * self.time_scale + (1.0 - self.hint_alpha) * t_hist
            )
        return t_hist / self.time_scale

    def observe(
        self, agent: str | None, tool: str, actual_s: float, predicted_s: float | None = None
    ) -> None:
        """Feed one measured duration; `predicted_s` (what was forecast for it) is scored."""
        actual_s = max(0.0, float(actual_s)) * self.time_scale
        if predicted_s is not None:
            predicted_s = float(predicted_s) * self.time_scale
            self._errors[tool_kind(tool)].append((predicted_s, actual_s))
        a = self.ewma_alpha
        for level in self._levels(agent, tool):
            old = self._ewma.get(level)
            self._ewma[level] = actual_s if old is None else a * actual_s + (1 - a) * old
            dist = self._dists.get(level)
            if dist is None:
                dist = self._dists[level] = DurationDistribution()
            dist.observe(actual_s)
        self._chosen.clear()
        for table in (self._ewma, self._dists):
            while len(table) > self.max_keys:
                del table[next(iter(table))]

    def remaining_s(self, agent: str | None, tool: str, elapsed_s: float) -> float:
        """Expected seconds left in a call of `tool` that has run `elapsed_s`.

        From the most specific level with at least `MIN_DIST_SAMPLES` observations, its
        distribution's mean residual life; with fewer, an exponential law of the level's
        EWMA or the cold-start mean (memoryless: the mean, whatever has elapsed)."""
        dist = self._distribution(agent, tool)
        if dist is None:
            return self.history(agent, tool)
        return dist.remaining_s(elapsed_s * self.time_scale) / self.time_scale

    def residual_many(
        self, agent: str | None, tool: str, elapsed_s: list[float], more_s: list[float]
    ) -> tuple[list[float], list[float | None]]:
        """`residual` of several calls of one tool at once (one distribution look-up,
        then `DurationDistribution.residual_many`)."""
        dist = self._distribution(agent, tool)
        if dist is None:
            return [self.history(agent, tool)] * len(elapsed_s), [None] * len(elapsed_s)
        k = self.time_scale
        if k == 1.0:  # the simulator's clock: the hot path of a tick, as it is
            return dist.residual_many(elapsed_s, more_s)
        idle, stays = dist.residual_many([e * k for e in elapsed_s], [m * k for m in more_s])
        return [i / k for i in idle], stays

    def stays_p(
        self, agent: str | None, tool: str, elapsed_s: float, more_s: float
    ) -> float | None:
        """P(a call of `tool` that has run `elapsed_s` runs `more_s` longer), from the same
        distribution as `remaining_s`; None without one (cold start)."""
        dist = self._distribution(agent, tool)
        k = self.time_scale
        return None if dist is None else dist.survival(elapsed_s * k, more_s * k)

    def residual(
        self, agent: str | None, tool: str, elapsed_s: float, more_s: float
    ) -> tuple[float, float | None]:
        """(`remaining_s`, `stays_p`) of one call at once: one distribution look-up."""
        dist = self._distribution(agent, tool)
        if dist is None:
            return self.history(agent, tool), None
        k = self.time_scale
        idle, stays = dist.residual(elapsed_s * k, more_s * k)
        return idle / k, stays

    def _distribution(self, agent: str | None, tool: str) -> DurationDistribution | None:
        """The most specific level's distribution with `MIN_DIST_SAMPLES` observations,
        remembered until the next observation (a victim pool or an urgent step's victims
        ask it for hundreds of programs in the same few tool calls)."""
        key = (agent, tool)
        if key in self._chosen:
            return self._chosen[key]
        if len(self._chosen) >= self.max_keys:  # keys come from clients: bounded
            self._chosen.clear()
        chosen = self._chosen[key] = self._choose(agent, tool)
        return chosen

    def _choose(self, agent: str | None, tool: str) -> DurationDistribution | None:
        for level in self._levels(agent, tool):
            dist = self._dists.get(level)
            if dist is not None and dist.observations >= MIN_DIST_SAMPLES:
                return dist
        return None

    def error_stats(self) -> dict[str, ErrorStats]:
        """Absolute and relative error distribution (p50 / p90) per tool kind.

        Relative error is |predicted - actual| / actual, with actual floored at 0.1 s so
        instant calls do not blow it up."""
        out = {}
        for kind, pairs in sorted(self._errors.items()):
            if not pairs:
                continue
            abs_err = [abs(p - a) for p, a in pairs]
            rel_err = [abs(p - a) / max(a, 0.1) for p, a in pairs]
            out[kind] = ErrorStats(
                n=len(pairs),
                abs_p50_s=percentile(abs_err, 50),
                abs_p90_s=percentile(abs_err, 90),
                rel_p50=percentile(rel_err, 50),
                rel_p90=percentile(rel_err, 90),
                mean_actual_s=sum(a for _, a in pairs) / len(pairs),
                mean_predicted_s=sum(p for p, _ in pairs) / len(pairs),
            )
        return out
