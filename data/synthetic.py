"""Synthetic exact-answer arithmetic in GSM8K's answer format: the embedded default task.

A problem is `num_terms` integers drawn from [1, max_operand] joined by operators drawn from `operators`:

    prompt:   What is 23 + 45 - 7?
    response: 23 + 45 = 68
              68 - 7 = 61
              #### 61

The worked steps evaluate left to right, one operator per line, so a tiny model learns one two-operand
operation at a time. The question is ordinary notation that means the same: where a `*` follows a `+` or
`-`, the expression before it is parenthesised (`(3 + 4) * 5 - 2`), so standard precedence and the
left-to-right steps agree and no "evaluate left to right" wording is needed. Results may be negative.

Problems are drawn without replacement from the whole problem space (operands and operators as mixed-radix
digits of one index) with `random.Random(seed)`, so the same seed gives the same problems, and train and
validation never share a question. Repeated entries in `operators` are ignored.

`shortcut_fraction` > 0 adds SFT-only rows that answer with `#### N` and no work (`shortcut_copies`); the
demo uses it so that RL has a behaviour to learn (see README, "make demo").

`tool_call_fraction` > 0 makes it the calculator task (recipes/tool_calc.yaml): data_source
`synthetic/calculator` (scored on the final `#### N` alone), RL rows on the `tool_agent` loop with the
`calculator` tool, and SFT rows of two kinds: that share shows the call, the tool's answer and `#### N`

    assistant: <tool_call>{"name": "calculator", "arguments": {"expression": "347 * 29"}}</tool_call>
    tool:      10063
    assistant: #### 10063

and the rest answer `#### N` directly, which a tiny model gets wrong for large operands: RL can learn that
calling the tool pays.

`data.interaction` puts a simulated user on either task's RL rows (data/files.py `with_interaction`).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, replace

from data.files import TOOL_LOOP, Example, Splits
from infra.config_sections import DataConfig, SyntheticTaskConfig

DATA_SOURCE = "synthetic/arithmetic"
TOOL_DATA_SOURCE = "synthetic/calculator"
APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


@dataclass(frozen=True)
class Problem:
    operands: tuple[int, ...]
    operators: tuple[str, ...]  # len(operands) - 1

    @property
    def question(self) -> str:
        return f"What is {expression(self.operands, self.operators)}?"

    def steps(self) -> tuple[list[str], int]:
        """One line per operator, `a op b = c`, evaluated left to right; and the final value."""
        value, lines = self.operands[0], []
        for op, operand in zip(self.operators, self.operands[1:], strict=True):
            result = APPLY[op](value, operand)
            lines.append(f"{value} {op} {operand} = {result}")
            value = result
        return lines, value

    @property
    def answer(self) -> int:
        return self.steps()[1]

    @property
    def response(self) -> str:
        lines, value = self.steps()
        return "\n".join([*lines, f"#### {value}"])


def expression(operands: tuple[int, ...], operators: tuple[str, ...]) -> str:
    """`a op b op c` with the parentheses that make standard precedence equal left-to-right order."""
    text, has_sum = str(operands[0]), False  # has_sum: a top-level + or - in `text`
    for op, operand in zip(operators, operands[1:], strict=True):
        if op == "*" and has_sum:
            text, has_sum = f"({text})", False
        text = f"{text} {op} {operand}"
        has_sum = has_sum or op in "+-"
    return text


def num_problems(cfg: SyntheticTaskConfig) -> int:
    """Size of the problem space: operand tuples times operator tuples."""
    return cfg.max_operand**cfg.num_terms * len(set(cfg.operators)) ** (cfg.num_terms - 1)


def problem_at(index: int, cfg: SyntheticTaskConfig, operators: list[str]) -> Problem:
    """Decode `index` in [0, num_problems) as mixed-radix digits: operands (base max_operand), then operators."""
    operands = []
    for _ in range(cfg.num_terms):
        index, digit = divmod(index, cfg.max_operand)
        operands.append(digit + 1)
    ops = []
    for _ in range(cfg.num_terms - 1):
        index, digit = divmod(index, len(operators))
        ops.append(operators[digit])
    return Problem(tuple(operands), tuple(ops))


def generate(cfg: SyntheticTaskConfig, seed: int) -> tuple[list[Problem], list[Problem]]:
    """`num_train` and `num_validation` distinct problems, deterministic by `seed`."""
    space, total = num_problems(cfg), cfg.num_train + cfg.num_validation
    if total > space:
        raise ValueError(
            f"data.synthetic: num_train + num_validation = {total} exceeds the {space} distinct problems with "
            f"num_terms={cfg.num_terms}, max_operand={cfg.max_operand}, operators={cfg.operators}; "
            "raise data.synthetic.max_operand or num_terms, or lower num_train/num_validation"
        )
    rng = random.Random(seed)
    if space < 2**62:  # random.sample needs len(range(space)) to fit in a C ssize_t
        indices = rng.sample(range(space), total)
    else:
        chosen: dict[int, None] = {}  # insertion-ordered set; collisions are astronomically rare here
        while len(chosen) < total:
            chosen[rng.randrange(space)] = None
        indices = list(chosen)
    operators = list(dict.fromkeys(cfg.operators))
    problems = [problem_at(i, cfg, operators) for i in indices]
    return problems[: cfg.num_train], problems[cfg.num_train :]


def to_example(problem: Problem, index: int) -> Example:
    response = problem.response
    return Example(
        prompt=[{"role": "user", "content": problem.question}],
        ground_truth=str(problem.answer),
        response=response,
        question=problem.question,
        answer=response,
        data_source=DATA_SOURCE,
        ability="math",
        index=index,
    )


def load_synthetic(cfg: DataConfig, seed: int) -> Splits:
    """source=synthetic: generated problems (no rows to skip)."""
    train, validation = generate(cfg.synthetic, seed)
    if cfg.synthetic.tool_call_fraction > 0:
        return calculator_splits(train, validation, cfg.synthetic.tool_call_fraction, seed)
    examples = [to_example(p, i) for i, p in enumerate(train)]
    return Splits(
        train=examples,
        validation=[to_example(p, i) for i, p in enumerate(validation)],
        sft_extra=shortcut_copies(examples, cfg.synthetic.shortcut_fraction, seed),
    )


def shortcut_copies(train: list[Example], fraction: float, seed: int) -> list[Example]:
    """SFT rows that answer training problems with only `#### N`, so that they make up `fraction` of the SFT
    set while every problem keeps its worked answer too: a model that learned to skip the work part of the
    time (as from scraped answers without reasoning). The task's reward requires the work, so RL can
    unlearn the shortcut; arithmetic the model cannot do, RL does not teach it quickly."""
    count = round(len(train) * fraction / (1 - fraction))
    rng, order = random.Random(f"shortcut-{seed}"), []
    while len(order) < count:
        order += rng.sample(range(len(train)), len(train))
    return [replace(train[i], response=f"#### {train[i].ground_truth}") for i in order[:count]]


def calculator_call(problem: Problem) -> str:
    arguments = json.dumps({"expression": expression(problem.operands, problem.operators)})
    return f'<tool_call>{{"name": "calculator", "arguments": {arguments}}}</tool_call>'


def calculator_example(problem: Problem, index: int, with_call: bool) -> Example:
    """A row of the calculator task; `with_call`: its SFT target is the conversation with the tool."""
    answer = f"#### {problem.answer}"
    turns = None
    if with_call:
        turns = [{"role": "assistant", "content": calculator_call(problem)},
                 {"role": "tool", "content": str(problem.answer)}, {"role": "assistant", "content": answer}]
    return replace(to_example(problem, index), data_source=TOOL_DATA_SOURCE, response=answer, answer=answer,
                   agent_name=TOOL_LOOP, sft_turns=turns,
                   extra={"tools_kwargs": {"calculator": {"create_kwargs": {"ground_truth": str(problem.answer)}}}})


def calculator_splits(train: list[Problem], validation: list[Problem], fraction: float, seed: int) -> Splits:
    rng = random.Random(f"tool-{seed}")
    with_call = set(rng.sample(range(len(train)), round(len(train) * fraction)))
    return Splits(train=[calculator_example(p, i, i in with_call) for i, p in enumerate(train)],
                  validation=[calculator_example(p, i, False) for i, p in enumerate(validation)])
