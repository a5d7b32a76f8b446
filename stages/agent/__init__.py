"""The one rollout component: prompts in, scored trajectories out, for training, validation and evaluation.

    trajectory  Trajectory: one sample's response tokens (the model's and, in multi-turn loops, tool/user
                tokens), its response mask, the engine's logprobs, the text the reward scores, its turns.
    loops       AgentLoop and the AGENT_LOOPS registry (`single_turn`, ...); a user's loop by
                `path/to/file.py:ClassName`. Each prompt row names its loop in the `agent_name` column
                (verl's convention; rows without one use `single_turn`).
    tool_loop   `tool_agent`: multi-turn with tools, token in and token out (BatchedEngine overlaps tools with
                the other samples' generation).
    rollout     Rollout: runs each row's loop over an engine's `generate` and scores the results with the
                reward pool (the only place reward requests are built).
"""

from stages.agent.loops import AGENT_LOOPS, AgentLoop, LoopContext, Sample, agent_loop
from stages.agent.rollout import Rollout, Scored
from stages.agent.tool_loop import ToolAgentLoop  # registers tool_agent
from stages.agent.trajectory import Trajectory

__all__ = ["AGENT_LOOPS", "AgentLoop", "LoopContext", "Rollout", "Sample", "Scored", "ToolAgentLoop", "Trajectory",
           "agent_loop"]
