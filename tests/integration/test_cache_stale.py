"""A cached task result names an artifact (`kind/name@version`); once the store no longer holds it (deleted as
corrupt, as the store's error tells the user to), the next flow run must run the task again rather than hand the
next stage a ref it cannot read (tasks/stages.py `live_key`), through Prefect's own cache (a temporary server)."""


import pytest
from prefect import flow

from infra.artifacts import ArtifactRef
from infra.config import load_config
from tasks.stages import RunContext, base_model_task, data_prep_task, open_store

pytestmark = pytest.mark.slow


def test_a_deleted_artifact_is_made_again_by_the_next_run(tmp_path):
    cfg = load_config(None, [f"storage.root={tmp_path / 'store'}", "data.synthetic.num_train=50",
                             "data.synthetic.num_validation=10"])

    @flow
    def prepare(run: str) -> dict[str, tuple[str, str]]:
        ctx = RunContext(run, str(tmp_path / run))
        ctx.tmp_dir.mkdir(parents=True)
        dataset = data_prep_task(cfg, ctx, return_state=True)
        model = base_model_task(cfg, dataset.result(), ctx, return_state=True)
        return {"dataset": (dataset.name, dataset.result()), "model": (model.name, model.result())}

    first = prepare("first")
    assert {name for name, _ in first.values()} == {"Completed"}
    store = open_store(cfg)
    store.delete(ArtifactRef.parse(first["dataset"][1]))

    second = prepare("second")
    assert second["dataset"][0] == "Completed"  # not "Cached": the task ran again and stored the dataset again
    assert store.exists(ArtifactRef.parse(second["dataset"][1]))
    assert second["model"] == ("Cached", first["model"][1])  # its artifact is still there: a hit

    assert prepare("third")["dataset"] == ("Cached", second["dataset"][1])  # the re-run's result is cached in turn
