"""A learned reward model: `AutoModelForSequenceClassification` with one label, scoring chat transcripts.

Each (prompt messages, response) pair becomes the RM tokenizer's chat template applied to the prompt plus
an assistant turn with the response; the score is the logit at the last non-pad token. transformers'
sequence-classification heads already pool there when `config.pad_token_id` is set, so the tokenizer's
pad token id is written into the model config and batches are right-padded. Samples are sorted by length
before batching (less padding); scores come back in the input order. A transcript longer than the model's
positions (`max_position_embeddings`) is cut at its end, as verl's reward model worker truncates (right), with a
warning counting them: a learned position table has no row past it.
"""

from __future__ import annotations

import logging

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

logger = logging.getLogger(__name__)


class RewardModelScorer:
    """Score (prompt, response) pairs with the reward model at `path` (a folder or a hub id)."""

    def __init__(self, path: str, device: str = "cpu", dtype: torch.dtype = torch.float32, batch_size: int = 16):
        if batch_size <= 0:
            raise ValueError(f"batch_size={batch_size} must be > 0")
        self.device, self.batch_size = torch.device(device), batch_size
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if self.tokenizer.chat_template is None:
            raise ValueError(f"reward_model_path={path!r}: its tokenizer has no chat template; give a chat RM")
        if self.tokenizer.pad_token_id is None:
            logger.warning("reward model tokenizer at %r has no pad token; using its EOS token", path)
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.padding_side = "right"
        self.model = _load_model(path, dtype).to(self.device).eval()
        self.model.config.pad_token_id = self.tokenizer.pad_token_id  # pooling at the last non-pad token
        self.max_length: int | None = getattr(self.model.config, "max_position_embeddings", None)

    def score(self, prompts: list[list[dict]], responses: list[str]) -> list[float]:
        """One scalar per (chat prompt, response) pair, in order; batch size and padding do not matter."""
        if len(prompts) != len(responses):
            raise ValueError(f"got {len(prompts)} prompts but {len(responses)} responses; give one per prompt")
        ids = self._truncated([self._encode(prompt, response) for prompt, response in zip(prompts, responses)])
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        scores = [0.0] * len(ids)
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            for i, value in zip(batch, self._forward([ids[i] for i in batch])):
                scores[i] = value
        return scores

    def _encode(self, prompt: list[dict], response: str) -> list[int]:
        """Token ids of the chat template over the prompt plus the assistant response."""
        messages = [*prompt, {"role": "assistant", "content": response}]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]  # the template has its own specials

    def _truncated(self, ids: list[list[int]]) -> list[list[int]]:
        """Each transcript cut to the model's positions (its end dropped); a warning counts those cut."""
        if self.max_length is None:
            return ids
        cut = sum(len(row) > self.max_length for row in ids)
        if cut:
            logger.warning("reward model: %d of %d transcripts are longer than its %d positions; scored on their first "
                           "%d tokens", cut, len(ids), self.max_length, self.max_length)
        return [row[: self.max_length] for row in ids]

    @torch.inference_mode()
    def _forward(self, ids: list[list[int]]) -> list[float]:
        batch = self.tokenizer.pad({"input_ids": ids}, padding=True, return_tensors="pt").to(self.device)
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits  # (B, 1)
        return logits[:, 0].float().tolist()


def _load_model(path: str, dtype: torch.dtype):
    """The one-label classifier at `path`; a checkpoint without a trained head (a policy LM) is refused."""
    model, info = AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=1, dtype=dtype, output_loading_info=True
    )
    head = [k for k in info["missing_keys"] if not k.startswith(model.base_model_prefix + ".")]
    if head:
        raise ValueError(
            f"reward_model_path={path!r} has no trained classification head (missing {head}); it looks like a "
            "language model, not a reward model. Give an AutoModelForSequenceClassification checkpoint"
        )
    return model
