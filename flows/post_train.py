"""The post-training flow: data prep -> base model -> SFT -> RL -> merge -> evaluation of each model -> report.

Run it:  python -m flows.post_train recipes/demo.yaml [key=value ...] [--refresh-cache] [--verbose]
         [--verl VERL_KEY=VALUE ...]   (verl's Hydra overrides, mapped by infra/verl_overrides.py; all after --verl)

The flow only sequences stages; each stage is a cached Prefect task (see tasks/stages.py), so a second
run with the same config is all cache hits, and a run after a failure re-runs only what did not finish.
RL returns its final checkpoint; merge turns it into the HF model that evaluation compares with the base
and SFT models. The comparison is published every run (the `evals` table, Prefect table + markdown),
and so is the RL run's HTML report (infra/report.py; in the store, linked from a markdown artifact).

The console (infra/console.py, `tracking.console`): quiet by default, a line as each stage starts and one as
it ends (ran or cached, wall time, a key figure), the progress bars, warnings, errors and the final table;
the rest goes to log files in the run folder. `--verbose` (= `tracking.console=verbose`) shows it all.
"""

from __future__ import annotations

import secrets
import signal
import socket
import sys
import time
from pathlib import Path

from flows import interrupt
from infra import prefect_env

if __name__ == "__main__":
    interrupt.quiet_while_starting()  # Ctrl-C while torch, Prefect and Ray load: no import machinery's traceback
prefect_env.configure()

from prefect import flow, get_run_logger  # noqa: E402
from prefect.runtime import flow_run  # noqa: E402
from prefect.settings import PREFECT_TASKS_REFRESH_CACHE, temporary_settings  # noqa: E402

from infra import verl_overrides  # noqa: E402
from infra.artifacts import ArtifactRef  # noqa: E402
from infra.config import Config, ConfigError, load_config, to_yaml  # noqa: E402
from infra.console import RunConsole, hide_chatter  # noqa: E402
from infra.orphans import crash_orphans, mark_ended, record_process, run_scratch  # noqa: E402
from tasks.figures import FIGURES  # noqa: E402
from tasks.stages import (  # noqa: E402
    RunContext,
    base_model_task,
    data_prep_task,
    evaluate_task,
    local_model_path,
    merge_task,
    open_store,
    publish_evals_task,
    report_task,
    rl_task,
    sft_task,
)


def start_run(cfg: Config) -> RunContext:
    """Make the run folder, save the resolved config there and in the store. The run id is the name, the start
    time (readable, sortable) and 8 random hex digits: flows started in the same second never share one."""
    run_id = f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(4)}"
    run_dir = Path(cfg.run.output_dir).resolve() / "runs" / run_id
    run_dir.mkdir(parents=True)  # exists already: not this run's folder, never write into it
    ctx = RunContext(run_id=run_id, run_dir=str(run_dir))
    save_config(cfg, ctx)
    return ctx


def save_config(cfg: Config, ctx: RunContext) -> None:
    """The resolved config as config.yaml in the run folder and in the store (runs/<run_id>/)."""
    text = to_yaml(cfg)
    (Path(ctx.run_dir) / "config.yaml").write_text(text)
    store = open_store(cfg)
    store.check()
    store.write_bytes(f"runs/{ctx.run_id}/config.yaml", text.encode())


@flow(name="post-train")
def post_train(recipe: str | None = None, overrides: list[str] | None = None, refresh_cache: bool = False) -> dict:
    """Post-train a model end to end from a YAML recipe plus dotted overrides; `refresh_cache` runs every stage
    again (the command line's --refresh-cache), SFT and RL from step 0."""
    cfg = load_config(recipe, overrides or [])
    if not interrupt.from_command_line():
        preflight(cfg)  # a deployment's run (the command line checked before Prefect started)
    # A setting, not an environment variable set now: Prefect read those when it was imported (the command line's
    # PREFECT_TASKS_REFRESH_CACHE, set after that, left every stage cached).
    with temporary_settings({PREFECT_TASKS_REFRESH_CACHE: True} if refresh_cache else {}):
        ctx = start_run(cfg)
        record_process(Path(ctx.run_dir), str(flow_run.id))
        try:
            with run_scratch(Path(ctx.run_dir)):
                return _post_train(cfg, ctx)
        finally:
            mark_ended(Path(ctx.run_dir))


def _post_train(cfg: Config, ctx: RunContext) -> dict:
    with RunConsole(ctx.run_dir, cfg.tracking.console, interrupt.resume_after_failure()) as console:
        get_run_logger().info("run %s: folder %s, store %s", ctx.run_id, ctx.run_dir, cfg.storage.root)
        crashed = crash_orphans(Path(cfg.run.output_dir).resolve())
        if crashed:
            get_run_logger().warning("marked %d earlier flow runs Crashed: their process ended without reporting "
                                     "(killed?): %s", len(crashed), ", ".join(crashed))
        stages = StageLog(cfg, console)
        dataset = stages.run("data-prep", data_prep_task, cfg, ctx)
        base_model = stages.run("base-model", base_model_task, cfg, dataset, ctx)
        cfg = stages.cfg = counted_rows(cfg, dataset, base_model, ctx, console)
        models, checkpoint = {"base": base_model}, None
        if cfg.sft.enabled:
            models["sft"] = stages.run("sft", sft_task, cfg, dataset, base_model, ctx)
        if cfg.rl.enabled:
            init_model = models.get("sft", base_model)
            checkpoint = stages.run("rl", rl_task, cfg, dataset, init_model, ctx)
            models["rl"] = stages.run("merge", merge_task, cfg, checkpoint, init_model, ctx)
        results = {label: stages.run(f"evaluate-{label}", evaluate_task, cfg, dataset, model, label, ctx)
                   for label, model in models.items()}
        publish_evals_task(cfg, results, ctx)
        report = report_task(cfg, checkpoint, ctx) if checkpoint else None
        console.line(summary_table(results, stages.states) + (f"\n\nrun report: {report}" if report else ""))
    return {"run_id": ctx.run_id, "run_dir": ctx.run_dir, "results": results, "stages": stages.states,
            "report": report}


def counted_rows(cfg: Config, dataset: str, base_model: str, ctx: RunContext, console: RunConsole) -> Config:
    """What waited for the training rows' count (rl.total_steps from verl's trainer.total_epochs) is set now, and
    config.yaml is written again with it. The rows are those RL trains on: prompts over data.max_prompt_length
    (in the model's chat template) left out when data.filter_overlong_prompts, as verl counts its dataloader."""
    if not verl_overrides.pending(cfg):
        return cfg
    from stages.agent.rollout import load_rollout_tools, tool_schemas
    from stages.data_prep import load_prompts
    from stages.model.loading import load_tokenizer

    store = open_store(cfg)
    tokenizer = load_tokenizer(local_model_path(store, base_model), cfg.model.trust_remote_code)
    prompts = load_prompts(store.get_dir(ArtifactRef.parse(dataset)) / "train.parquet", tokenizer, cfg.data,
                           tool_schemas(load_rollout_tools(cfg.rl.multi_turn)))
    cfg, lines = verl_overrides.resolve_after_data_prep(cfg, len(prompts.prompt_ids))
    for line in lines:
        console.line(f"verl: {line}")
    save_config(cfg, ctx)
    return cfg


class StageLog:
    """Runs tasks, prints a line as each starts and one as it ends (ran or cached, wall time, the key figure
    of tasks/figures.py, or the error) and remembers each one's final state name ('Completed' or 'Cached')."""

    def __init__(self, cfg: Config, console: RunConsole):
        self.cfg, self.console = cfg, console
        self.states: dict[str, str] = {}

    def run(self, name: str, task, *args):
        self._line(name, "started")
        start = time.monotonic()
        with self.console.stage(name):
            state = task(*args, return_state=True)
        self.states[name] = state.name
        took = duration(time.monotonic() - start)
        if not state.is_completed():  # its error is printed once, in full, as it ends the run (RunConsole.failed)
            error = state.result(raise_on_failure=False)
            self._line(name, f"{state.name.lower()} after {took}: {type(error).__name__} (traceback below)")
            return state.result()  # raises the task's error
        result = state.result()
        how = "cached" if state.name == "Cached" else "ran"
        self._line(name, f"{how:<6} {took:>7}  {FIGURES[task.name](self.cfg, result)}")
        return result

    def _line(self, name: str, text: str) -> None:
        self.console.line(f"{time.strftime('%H:%M:%S')} {name:<13} {text}")


def duration(seconds: float) -> str:
    return f"{seconds:.1f}s" if seconds < 60 else f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


def summary_table(results: dict[str, dict], states: dict[str, str]) -> str:
    lines = ["", "stages: " + ", ".join(f"{k} {v.lower()}" for k, v in states.items()), "",
             f"{'model':<8} {'held-out acc':>12}  {'engine':<6}  artifact", "-" * 72]
    for label, r in results.items():
        lines.append(f"{label:<8} {100 * r['acc']:>11.1f}%  {r['engine']:<6}  {r['model']}")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> tuple[str | None, list[str], list[str]]:
    """-> (recipe, overrides, verl overrides: every argument after `--verl`). `--verbose` becomes the override
    tracking.console=verbose, so that it reaches the flow as a parameter like any other (a deployment's run sets it
    the same way, in `overrides`); it and `--refresh-cache` may stand anywhere, after `--verl` too. `-h`/`--help`
    prints the usage (this module's docstring) and exits with 0."""
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        raise SystemExit(0)
    flags = ("--refresh-cache", "--verbose")
    args = [a for a in argv if a not in flags]
    split = args.index("--verl") if "--verl" in args else len(args)
    args, verl = args[:split], args[split + 1:]
    unknown = [a for a in args if a.startswith("-")]
    if unknown:  # a misspelt option read as a recipe said "recipe '--hlep' not found"
        raise ConfigError(f"{unknown[0]}: not an option of this command; its options are --verl, --refresh-cache, "
                          "--verbose and --help, and an override is key=value")
    recipe = args[0] if args and "=" not in args[0] else None
    overrides = (args[1:] if recipe else args) + (["tracking.console=verbose"] if "--verbose" in argv else [])
    return recipe, overrides, verl


def check_verl_keys_placed(argv: list[str], overrides: list[str]) -> None:
    """verl's keys given among ours (before `--verl`, or without it): a ConfigError that says to give them after
    `--verl`, with the command line that does (the config's own error would call `actor_rollout_ref` an unknown
    key and list our sections)."""
    misplaced = [arg for arg in overrides if verl_only(arg.partition("=")[0])]
    if not misplaced:
        return
    fixed = [a for a in argv if a not in misplaced] + ([] if "--verl" in argv else ["--verl"]) + misplaced
    raise ConfigError(f"{', '.join(misplaced)}: verl's {'key' if len(misplaced) == 1 else 'keys'}, not this "
                      "project's; give verl's overrides after --verl, which maps them onto this project's keys (README "
                      f"'From verl'):\n  {interrupt.command_line(fixed)}")


def verl_only(key: str) -> bool:
    """Whether the dotted `key` (Hydra's `+`/`++` prefix allowed) is verl's and not one of this project's: a key of
    the table, or any key under a section that only verl's config has (actor_rollout_ref, trainer, ...). Such a key
    among our overrides belongs after `--verl`."""
    from infra.verl_keys import TABLE
    from infra.verl_overrides import is_native

    key = key.lstrip("+")
    roots = {k.split(".")[0] for k in TABLE} - set(Config.model_fields)
    return (key in TABLE or key.split(".")[0] in roots) and not is_native(key)


def preflight(cfg: Config) -> None:
    """What the config names outside itself, checked before anything runs or is written: the store can be
    written, local files and folders exist, local data has the columns of a layout data prep reads, the cluster has
    the devices asked for, a Ray head listens at ray.address, the reward function loads. Raises ConfigError naming the
    field."""
    from data.files import check_columns
    from infra.store import StoreError
    from stages.rewards.custom import load_reward_fn

    try:
        open_store(cfg).check()
    except StoreError as exc:
        raise ConfigError(f"storage.root={cfg.storage.root}: {exc}") from exc
    local = ("/", "./", "../", "~")  # anything else may be a hub id
    for field, path in (("model.path", cfg.model.path), ("data.path", cfg.data.path if cfg.data.source == "file"
                                                                         else None)):
        if path and path.startswith(local) and not Path(path).expanduser().exists():
            raise ConfigError(f"{field}={path}: no such file or folder")
    if cfg.model.path != "tiny":
        _check_hub_model("model.path", cfg.model.path)
    if cfg.rl.enabled and cfg.rl.reward.reward_model_path:
        _check_hub_model("rl.reward.reward_model_path", cfg.rl.reward.reward_model_path)
    if cfg.data.source == "file":
        try:
            check_columns(cfg.data)  # a layout that data prep would refuse, named now
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    _check_local_cluster(cfg)
    _check_ray_address(cfg.ray.address)
    reward = cfg.rl.reward
    if cfg.rl.enabled and reward.custom_path:
        try:
            load_reward_fn(reward.custom_path, reward.custom_function)
        except ValueError as exc:
            raise ConfigError(f"rl.reward.custom_path={reward.custom_path}: {exc}") from exc
    from stages.evaluate import resolve_engine

    try:
        resolve_engine(cfg.evaluate.engine)  # evaluate.engine=vllm without vLLM failed after training
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _check_hub_model(field: str, path: str) -> None:
    """A model path that is no local folder must be a hub id the run can fetch: 'name' or 'org/name', and, with
    HF_HUB_OFFLINE set, already in the local Hugging Face cache. Else the base-model stage failed with the hub's
    words, after data prep."""
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if Path(path).expanduser().exists():
        return
    try:
        validate_repo_id(path)
    except HFValidationError:
        raise ConfigError(f"{field}={path}: no such local folder, and not a hub id ('name' or 'org/name')") from None
    if constants.HF_HUB_OFFLINE and not isinstance(try_to_load_from_cache(path, "config.json"), str):
        raise ConfigError(f"{field}={path}: HF_HUB_OFFLINE is set and the local Hugging Face cache has no copy of "
                          "it; download it first (huggingface-cli download) or point the field at a local folder")


def _check_local_cluster(cfg: Config) -> None:
    """A run that places workers (RL; SFT on more than one device) on the local cluster it starts: enough devices
    for ray.num_devices_per_node? (Attached to a cluster, `Placement` checks it, before it creates its group.)"""
    from infra.cluster import ClusterTooSmall, check_fits, local_nodes

    places = cfg.rl.enabled or (cfg.sft.enabled and cfg.ray.num_trainers > 1)
    if places and cfg.ray.address is None:
        try:
            check_fits(cfg.ray, local_nodes(cfg.ray))
        except ClusterTooSmall as exc:
            raise ConfigError(str(exc)) from None


RAY_CONNECT_TIMEOUT_S = 3


def _check_ray_address(address: str | None) -> None:
    """A `ray.address` of the form host:port (or ray://host:port) must have something listening there. Else Ray's
    driver retried the connection for ~14 minutes in RL or evaluation, after data prep and SFT had run, and Prefect
    retried the stage. 'auto' (a node's own cluster) and an address of another form are left to ray.init."""
    if not address or address == "auto":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=RAY_CONNECT_TIMEOUT_S):
            return
    except TimeoutError:
        reason = f"no answer within {RAY_CONNECT_TIMEOUT_S} s"
    except OSError as exc:
        reason = exc.strerror or str(exc)
    from infra.cluster import start_advice

    # ray://'s port is the Ray client server's, not the head's: no --port to suggest for it
    advice = start_advice(None if address.startswith("ray://") else int(port))
    raise ConfigError(f"ray.address={address}: no Ray cluster listens there ({reason}). {advice}")


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C: how to resume, not Prefect's and our frames (flows/interrupt.py)
        print(f"\n{interrupt.interrupted_message(argv)}", file=sys.stderr, flush=True)
        return interrupt.EXIT_CODE


def _main(argv: list[str]) -> int:
    try:
        recipe, overrides, verl = parse_args(argv)
        check_verl_keys_placed(argv, overrides)
        if verl:
            translation = verl_overrides.translate(recipe, overrides, verl)
            print("verl overrides -> this project's (README 'From verl'):\n  " + "\n  ".join(translation.lines),
                  flush=True)
            overrides = translation.overrides
        cfg = load_config(recipe, overrides)  # fail fast, before Prefect starts, on a bad recipe or override
        preflight(cfg)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if cfg.tracking.console == "quiet":
        hide_chatter()
    interrupt.start_prefect_server()  # out of Ctrl-C's reach (flows/interrupt.py)
    with interrupt.running_from_command_line(argv):
        state = post_train(recipe, overrides, refresh_cache="--refresh-cache" in argv, return_state=True)
    # A failed run's error and traceback are on the console already (RunConsole.failed): no second traceback.
    return 1 if state.is_failed() else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
