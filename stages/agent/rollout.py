"""The rollout component: prompt rows -> trajectories (each row's agent loop over one engine) -> scores.

Training, validation, evaluation and ReMax's greedy baselines all go through `Rollout`: `run` groups the rows
by their `agent_name`, runs each loop's batch and returns the trajectories prompt-major in row order; `score`
builds the reward requests (the only place they are built) and adds the tools' and simulated users' rewards. With
every row on `single_turn` (the default), `run` makes exactly one engine call with the given parameters, the call
the stages made before this component existed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from infra.imports import load_object
from stages.agent.loops import DEFAULT_LOOP, AgentLoop, GenerateFn, LoopContext, Sample, agent_loop
from stages.agent.trajectory import Trajectory
from stages.data_prep import PromptSet
from stages.rewards.pool import RewardPool, RewardRequest, RewardResult
from stages.rollout.base import SamplingParams

logger = logging.getLogger(__name__)


def load_rollout_tools(multi_turn: Any) -> dict:
    """The tools of `rl.multi_turn`: its YAML file's (verl's format) and its plain functions, by name. With tools,
    `rl.multi_turn.format` must name a tool-call parser (checked here, after the tools' modules, which may register
    one, are imported: an unknown format failed at the first model turn, after a batch's generation)."""
    from stages.tools.parsers import TOOL_PARSERS
    from stages.tools.registry import load_tools

    entries: list = []
    if multi_turn.tool_config_path:
        entries += load_tools(multi_turn.tool_config_path).values()
    entries += [load_object(spec, "rl.multi_turn.tool_functions entry") for spec in multi_turn.tool_functions]
    if entries and multi_turn.format not in TOOL_PARSERS:
        raise ValueError(f"rl.multi_turn.format={multi_turn.format!r} names no tool-call parser; valid: "
                         f"{', '.join(TOOL_PARSERS)} (a parser of your own: stages.tools.parsers.register_parser in "
                         "a module your tools import)")
    return load_tools(entries) if entries else {}


def tool_schemas(tools: dict) -> list[dict] | None:
    """The OpenAI function schemas of `tools` for the chat template (`apply_chat_template(tools=...)`); None
    without tools."""
    return [tool.schema.to_openai() for tool in tools.values()] or None


def load_rollout_interactions(multi_turn: Any) -> dict:
    """The simulated users of `rl.multi_turn.interaction_config_path` (verl's YAML format), by name; {} when unset."""
    from stages.agent.interactions import load_interactions

    return load_interactions(multi_turn.interaction_config_path) if multi_turn.interaction_config_path else {}


@dataclass
class Scored:
    scores: list[float]  # the reward function's score plus the tool and interaction rewards, one per trajectory
    result: RewardResult  # the reward function's own scores, components, errors and metrics


class Rollout:
    """Runs agent loops over one engine and scores their trajectories with one reward pool.

    Args:
        generate: batched engine call, prompt ids + params -> outputs (prompt-major, `params.n` per prompt).
        tokenizer: the policy's tokenizer (decoding; chat template of tool and user messages).
        rewards: the reward pool (stages/rewards/pool.py).
        tools: name -> tool, for loops that call tools.
        options: the multi-turn settings handed to loops (`LoopContext.options`).
        interactions: name -> simulated user (stages/agent/interactions.py), for rows with interaction_kwargs.
    """

    def __init__(self, generate: GenerateFn, tokenizer: Any, rewards: RewardPool, tools: dict | None = None,
                 options: Any = None, interactions: dict | None = None):
        self.generate, self.tokenizer, self.rewards = generate, tokenizer, rewards
        self.tools, self.options, self.interactions = tools or {}, options, interactions or {}
        self._loops: dict[str, AgentLoop] = {}
        self._warned_single_turn = False

    def run(self, prompts: PromptSet, rows: list[int], params: SamplingParams) -> list[Trajectory]:
        """`params.n` trajectories per row, prompt-major in the order of `rows`; `prompt_index` indexes `rows`."""
        by_loop: dict[str, list[int]] = {}
        for position, row in enumerate(rows):
            by_loop.setdefault(prompts.agent_names[row] or DEFAULT_LOOP, []).append(position)
        self._warn_single_turn(prompts, [rows[p] for p in by_loop.get(DEFAULT_LOOP, [])])
        ctx = LoopContext(self.generate, self.tokenizer, params, self.tools, self.options, self.interactions)
        found: list[Trajectory] = []
        for name, positions in by_loop.items():
            samples = [Sample(p, prompts.prompt_ids[rows[p]], prompts.prompts[rows[p]], prompts.extra_infos[rows[p]])
                       for p in positions]
            found.extend(self._loop(name).run_batch(ctx, samples))
        if len(by_loop) > 1:
            found.sort(key=lambda t: t.prompt_index)  # stable: a row's samples keep their order
        return found

    def _warn_single_turn(self, prompts: PromptSet, rows: list[int]) -> None:
        """Once: rows on single_turn with interaction_kwargs get no simulated user (it needs tool_agent)."""
        if not self.interactions or self._warned_single_turn:
            return
        num = sum(1 for r in rows if (prompts.extra_infos[r] or {}).get("interaction_kwargs"))
        if num:
            logger.warning("%d rows have extra_info.interaction_kwargs but run on single_turn, which has no simulated "
                           "user; set their agent_name to tool_agent (warned once)", num)
            self._warned_single_turn = True

    def _loop(self, name: str) -> AgentLoop:
        if name not in self._loops:
            self._loops[name] = agent_loop(name)
        return self._loops[name]

    def score(self, prompts: PromptSet, rows: list[int], trajectories: list[Trajectory]) -> Scored:
        """Score each trajectory with its row's reward function. A multi-turn trajectory's reward function also
        sees its turns (`extra_info["turns"]`: role, text, tool name, arguments, result per turn)."""
        requests = []
        for t in trajectories:
            row = rows[t.prompt_index]
            extra = prompts.extra_infos[row]
            if t.turns:
                extra = {**(extra or {}), "turns": t.turns}
            requests.append(RewardRequest(prompts.data_sources[row], t.text, prompts.ground_truths[row], extra))
        result = self.rewards.score(requests)
        return Scored([s + t.tool_reward + t.interaction_reward for s, t in zip(result.scores, trajectories)], result)
