"""Stage checkpoints kept in the artifact store: one `checkpoint` artifact version per saved step.

A checkpoint is complete or absent: it is committed by the store's atomic `put_dir`. Only the newest
`max_to_keep` are kept; the latest is found by the `step` in each version's manifest. `metadata` (e.g. the
model config, which the merge stage needs for LoRA) goes into every version's manifest next to the step.
"""

from __future__ import annotations

import logging
from pathlib import Path

from infra.artifacts import ArtifactRef
from infra.store import ArtifactStore

logger = logging.getLogger(__name__)


class StoreCheckpoints:
    def __init__(self, store: ArtifactStore, name: str, max_to_keep: int, inputs: dict[str, str] | None = None,
                 metadata: dict | None = None):
        self.store = store
        self.name = name
        self.max_to_keep = max_to_keep
        self.inputs = inputs or {}
        self.metadata = metadata or {}

    def _by_step(self) -> list[tuple[int, ArtifactRef]]:
        versions = self.store.versions("checkpoint", self.name)
        refs = [(int(m.metadata["step"]), ArtifactRef(m.kind, m.name, m.version)) for m in versions]
        return sorted(refs, key=lambda pair: pair[0])

    def latest_ref(self) -> ArtifactRef | None:
        """The checkpoint version with the highest step, or None."""
        found = self._by_step()
        return found[-1][1] if found else None

    def at_step(self, step: int) -> ArtifactRef | None:
        """The checkpoint version saved at `step`, or None."""
        return dict(self._by_step()).get(step)

    def latest(self) -> Path | None:
        found = self._by_step()
        if not found:
            return None
        step, ref = found[-1]
        logger.info("latest checkpoint: %s (step %d)", ref, step)
        return self.store.get_dir(ref)

    def save(self, step: int, local_dir: Path) -> None:
        ref = self.store.put_dir("checkpoint", self.name, local_dir, inputs=self.inputs,
                                 metadata={**self.metadata, "step": step})
        logger.info("saved checkpoint %s (step %d)", ref, step)
        for _, old in self._by_step()[: -self.max_to_keep]:
            self.store.delete(old)
