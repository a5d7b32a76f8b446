"""Stage checkpoints kept in the artifact store: one `checkpoint` artifact version per saved step.

A checkpoint is complete or absent: it is committed by the store's atomic `put_dir`. The latest is found by
the `step` in each version's manifest; `latest()` hands out the newest checkpoint that is intact (its files
match its manifest), skipping corrupt ones with a warning, so a resume falls back to an earlier step rather
than loading damaged state. Saving step s replaces the checkpoints of steps >= s (left by a run that went further
and was resumed from an earlier one, or restarted) and keeps the newest `max_to_keep`. `metadata` (e.g. the
model config, which the merge stage needs for LoRA) goes into every version's manifest next to the step.
"""

from __future__ import annotations

import logging
from pathlib import Path

from infra import lease
from infra.artifacts import ArtifactRef, Manifest
from infra.store import ArtifactStore, CorruptArtifactError

logger = logging.getLogger(__name__)


class StoreCheckpoints:
    def __init__(self, store: ArtifactStore, name: str, max_to_keep: int, inputs: dict[str, str] | None = None,
                 metadata: dict | None = None, tmp_dir: Path | None = None):
        """tmp_dir: where the stage writes a checkpoint before `save` stores it (the flow's run folder)."""
        self.store = store
        self.tmp_dir = tmp_dir
        self.name = name
        self.max_to_keep = max_to_keep
        self.inputs = inputs or {}
        self.metadata = metadata or {}

    def _by_step(self, versions: list[Manifest] | None = None) -> dict[int, ArtifactRef]:
        """step -> its newest version, in step order."""
        found = {}
        for m in versions if versions is not None else self.store.versions("checkpoint", self.name):
            found[int(m.metadata["step"])] = m.ref  # oldest first: a step saved again keeps its newest version
        return dict(sorted(found.items()))

    def latest_ref(self) -> ArtifactRef | None:
        """The checkpoint version with the highest step, or None (not checked for corruption: see `latest`)."""
        found = self._by_step()
        return found[max(found)] if found else None

    def at_step(self, step: int) -> ArtifactRef | None:
        """The checkpoint version saved at `step`, or None."""
        return self._by_step().get(step)

    def latest(self) -> Path | None:
        """The folder of the newest intact checkpoint, or None. Corrupt ones are skipped, each with a warning,
        and a fallback (or starting from scratch when none is intact) is said in a warning too."""
        corrupt: list[str] = []
        for step, ref in reversed(self._by_step().items()):
            try:
                path = self.store.get_dir(ref)
            except CorruptArtifactError as exc:
                logger.warning("checkpoint %s (step %d) is corrupt, skipping it: %s", ref, step, exc)
                corrupt.append(f"{ref} (step {step})")
                continue
            if corrupt:
                logger.warning("resuming from checkpoint %s at step %d, the newest intact one, instead of the "
                               "corrupt %s", ref, step, ", ".join(corrupt))
            else:
                logger.info("latest checkpoint: %s (step %d)", ref, step)
            return path
        if corrupt:
            logger.warning("no intact checkpoint of %s (corrupt: %s): starting from scratch", self.name,
                           ", ".join(corrupt))
        return None

    def clear(self) -> int:
        """Remove every checkpoint of this stage run (a fresh start's: an earlier attempt's, which the first save
        would replace); -> how many."""
        lease.check(self.name)
        versions = self.store.versions("checkpoint", self.name)
        for m in versions:
            logger.info("removing checkpoint %s (step %s): this run starts again from step 0", m.ref,
                        m.metadata.get("step"))
            self.store.delete(m.ref)
        return len(versions)

    def save(self, step: int, local_dir: Path) -> None:
        lease.check(self.name)  # another flow run took this stage run over: its checkpoints are not ours to prune
        ref = self.store.put_dir("checkpoint", self.name, local_dir, inputs=self.inputs,
                                 metadata={**self.metadata, "step": step})
        logger.info("saved checkpoint %s (step %d)", ref, step)
        lease.check(self.name)  # again: the lease may have been lost during a long upload
        versions = self.store.versions("checkpoint", self.name)
        earlier = [r for s, r in self._by_step(versions).items() if s < step]
        keep = {ref, *earlier[max(0, len(earlier) - self.max_to_keep + 1):]}
        for m in versions:
            if m.ref not in keep:
                old = int(m.metadata["step"])
                reason = f"superseded by step {step}" if old >= step else f"not among the newest {self.max_to_keep}"
                logger.info("removing checkpoint %s (step %d): %s", m.ref, old, reason)
                self.store.delete(m.ref)
