"""A persistent local Ray cluster that runs attach to: ``python -m infra.cluster up|down|status``.

``up`` runs the venv's ``ray start --head --block`` in a session of its own, with the worker environment
of ``stages/workers/group.py`` (the project on PYTHONPATH, OMP threads, vLLM settings), waits until the
node is up and writes the address to use, ``ray.address=127.0.0.1:PORT``, into ``STATE_DIR/cluster.json``.
Runs with ``ray.address`` set attach to it (``init_ray``), use it through the stage, kill their actors and
disconnect, so the next stage or flow run finds the cluster idle and reuses it. ``down`` stops exactly the
processes of that session: never ``ray stop``, which stops every Ray instance of the machine (other
users', other tests').

Authentication: ``ray start`` uses Ray's token authentication when RAY_AUTH_MODE=token or a token exists
(``~/.ray/auth_token``); ``up`` turns it on when RAY_AUTH_MODE is unset, creating the token once with
``ray get-auth-token --generate``. A driver that attaches by an explicit address must switch to token mode
itself (Ray does so only for a cluster it finds on its own): ``attach_auth()``.

Multi-node: start the head with ``up`` (or ``ray start --head --port=PORT``), then on every other node
``ray start --address=HEAD_IP:PORT`` with the same token (``RAY_AUTH_TOKEN`` or ``~/.ray/auth_token``)
and this project on the same path; set ``ray.address=HEAD_IP:PORT``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from infra.config_sections import RayConfig
from infra.prefect_env import PROJECT_DIR

DEFAULT_STATE_DIR = PROJECT_DIR / "outputs" / "ray"
DEFAULT_PORT = 6379  # Ray's default GCS port
READY_LINE = "Ray runtime started"  # what `ray start` prints once the head node is up
RAY = str(Path(sys.executable).parent / "ray")  # the venv's ray, the version the runs import


def start_advice(port: int | None = None) -> str:
    """What to do about a ray.address where no head answers (the preflight's and `init_ray`'s errors)."""
    start = "make ray-up" if port in (None, DEFAULT_PORT) else f'make ray-up ARGS="--port {port}"'
    return (f"Start its head on that host first (`{start}`, which runs `python -m infra.cluster up`; `python -m "
            "infra.cluster status` shows a running one's address), or set ray.address=null to have each stage start "
            "a local Ray cluster")


class ClusterError(RuntimeError):
    """The cluster could not be started or stopped; the message says why and what to do."""


class ClusterTooSmall(ValueError):
    """The run asks for more devices than the Ray cluster has: a config error, raised before the placement group is
    created (Ray would wait for it until the placement timeout, and Prefect retry that) and not retried."""


@dataclass
class ClusterState:
    """What `up` records in STATE_DIR/cluster.json; `pid` leads the session of every process of the head."""

    address: str
    pid: int
    port: int
    num_cpus: int | None
    temp_dir: str
    log: str
    auth_mode: str
    started: str

    @classmethod
    def read(cls, state_dir: Path) -> ClusterState | None:
        path = state_dir / "cluster.json"
        return cls(**json.loads(path.read_text())) if path.exists() else None

    def write(self, state_dir: Path) -> None:
        tmp = state_dir / f".cluster.json.{os.getpid()}"
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        os.replace(tmp, state_dir / "cluster.json")  # atomic: readers see the old or the new state


def attach_auth() -> None:
    """Before `ray.init(address=...)`: like `ray start`, use token authentication when RAY_AUTH_MODE is unset
    and a token exists (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token); otherwise a cluster started
    by `ray start` (or `up`) refuses the driver with "Authentication token is missing or incorrect"."""
    from ray._private.authentication.authentication_token_setup import maybe_enable_token_auth_if_token_available

    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


# --------------------------------------------------------------------------------------------------
# does the run fit the cluster


def check_fits(cfg: RayConfig, nodes: list[dict[str, float]]) -> None:
    """Raise ClusterTooSmall unless the run's placement group fits `nodes` (each alive node's total resources): one
    bundle per worker, 1 CPU (+ 1 GPU when the cluster has GPUs), all on one node when ray.num_nodes is 1
    (STRICT_PACK), else anywhere in the cluster (PACK). Totals, not what is free now: a cluster that is busy with
    other runs' actors is waited for (the placement timeout), one too small never fits."""
    gpus = any(node.get("GPU", 0) > 0 for node in nodes)
    slots = [int(min(node.get("CPU", 0), node.get("GPU", 0) if gpus else float("inf"))) for node in nodes]
    per_node = cfg.num_devices_per_node + cfg.rollout_devices_per_node
    needed, have = per_node * cfg.num_nodes, max(slots, default=0) if cfg.num_nodes == 1 else sum(slots)
    if needed <= have:
        return
    asked = f"ray.num_devices_per_node={cfg.num_devices_per_node}"
    if cfg.rollout_devices_per_node:
        asked += f" + ray.rollout_devices_per_node={cfg.rollout_devices_per_node}"
    if cfg.num_nodes > 1:
        asked = f"({asked}) x ray.num_nodes={cfg.num_nodes}"
    each = "1 GPU and 1 CPU" if gpus else "1 CPU (the cluster has no GPU)"
    where = "on one node (ray.num_nodes=1)" if cfg.num_nodes == 1 else "in the cluster"
    most = (have if cfg.num_nodes == 1 else have // cfg.num_nodes) - cfg.rollout_devices_per_node
    fix = (f"set ray.num_devices_per_node={most} or less" if most >= 1 else
           f"lower ray.rollout_devices_per_node={cfg.rollout_devices_per_node}")
    if not gpus and cfg.address is None:
        fix += ", or raise ray.num_cpus (the local cluster's CPU slots; more than the cores is allowed)"
    elif cfg.address is not None:
        fix += ", or add nodes to the cluster"
    raise ClusterTooSmall(f"{asked} asks for {needed} workers, each {each}, {where}; {describe_nodes(cfg, nodes)}. "
                          f"{fix[0].upper()}{fix[1:]}")


def describe_nodes(cfg: RayConfig, nodes: list[dict[str, float]]) -> str:
    """What the cluster has, for messages: 'this machine's local Ray cluster has 2 CPUs and no GPU (ray.num_cpus=2)'."""

    def has(node: dict[str, float]) -> str:
        cpus, gpus = node.get("CPU", 0), node.get("GPU", 0)
        return f"{cpus:g} CPUs and " + (f"{gpus:g} GPUs" if gpus else "no GPU")

    if cfg.address is None:
        return f"this machine's local Ray cluster has {has(nodes[0]) if nodes else 'nothing'}" + (
            f" (ray.num_cpus={cfg.num_cpus})" if cfg.num_cpus else "")
    total = {key: sum(node.get(key, 0) for node in nodes) for key in ("CPU", "GPU")}
    if len(nodes) == 1:
        return f"the Ray cluster at ray.address={cfg.address} has one node: {has(nodes[0])}"
    largest = max(nodes, key=lambda node: (node.get("GPU", 0), node.get("CPU", 0)))
    return (f"the Ray cluster at ray.address={cfg.address} has {len(nodes)} nodes, {has(total)} in all, the largest "
            f"{has(largest)}")


def live_nodes() -> list[dict[str, float]]:
    """The total resources of each alive node of the cluster this driver is attached to."""
    import ray

    return [node["Resources"] for node in ray.nodes() if node.get("Alive")]


def local_nodes(cfg: RayConfig) -> list[dict[str, float]]:
    """What the local cluster that a run starts (ray.address unset) will have: ray.num_cpus or this machine's
    CPUs (os.cpu_count: never fewer than Ray counts, so the check never refuses what would fit), its visible GPUs."""
    import torch

    return [{"CPU": float(cfg.num_cpus or os.cpu_count() or 1), "GPU": float(torch.cuda.device_count())}]


# --------------------------------------------------------------------------------------------------
# up / down / status


def up(port: int = DEFAULT_PORT, num_cpus: int | None = None, state_dir: Path = DEFAULT_STATE_DIR,
       temp_dir: str | None = None, timeout_s: float = 180) -> ClusterState:
    """Start the head node (or return the running one) and record its address."""
    state_dir.mkdir(parents=True, exist_ok=True)
    state = ClusterState.read(state_dir)
    if state and is_running(state):
        return state
    if state and (left := leftovers(state)):  # a new cluster.json would lose them: only `down` finds them
        raise ClusterError(leftovers_message(state, left, state_dir))
    _check_port_free(port)
    temp_dir = temp_dir or os.path.join(tempfile.gettempdir(), f"rlpipe-ray-{port}")  # short: Ray's socket paths
    env = _head_env()
    log = state_dir / "head.log"
    cmd = [RAY, "start", "--head", "--block", f"--port={port}", "--include-dashboard=false", "--disable-usage-stats",
           f"--temp-dir={temp_dir}", f"--ray-client-server-port={_free_port()}", f"--dashboard-port={_free_port()}",
           f"--dashboard-agent-listen-port={_free_port()}"]  # not the fixed defaults another Ray may hold
    if num_cpus:
        cmd.append(f"--num-cpus={num_cpus}")
    with log.open("w") as out:
        process = subprocess.Popen(cmd, cwd=PROJECT_DIR, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    state = ClusterState(address=f"127.0.0.1:{port}", pid=process.pid, port=port, num_cpus=num_cpus,
                         temp_dir=temp_dir, log=str(log), auth_mode=env["RAY_AUTH_MODE"],
                         started=datetime.datetime.now().astimezone().isoformat(timespec="seconds"))
    try:
        _wait_ready(process, log, port, timeout_s)
    except ClusterError:
        _stop_session(process.pid, grace_s=10)
        raise
    state.write(state_dir)
    return state


def down(state_dir: Path = DEFAULT_STATE_DIR, timeout_s: float = 60) -> ClusterState | None:
    """Stop the head started by `up` (all processes of its session) and remove its state; None if none."""
    state = ClusterState.read(state_dir)
    if state is None:
        return None
    if is_running(state):
        _stop_session(state.pid, grace_s=timeout_s)
    else:  # the leader crashed: stop what is left of its session
        _kill(leftovers(state), signal.SIGKILL)
    (state_dir / "cluster.json").unlink()
    return state


def is_running(state: ClusterState) -> bool:
    """The recorded leader is alive and is our `ray start` (not a process that reused the pid)."""
    import psutil

    try:
        proc = psutil.Process(state.pid)
        cmdline, status = proc.cmdline(), proc.status()
    except psutil.Error:
        return False
    return (status != psutil.STATUS_ZOMBIE and "start" in cmdline and "--head" in cmdline
            and any("ray" in part for part in cmdline[:2]))


def leftovers(state: ClusterState) -> list[int]:
    """Live processes of the head's session whose leader (not running) is gone: Linux does not reuse a pid that is
    still some process's session id, so these are the head's. A live process with the leader's pid that is not our
    `ray start` took the pid over after the whole session ended: its session, if any, is not the head's."""
    import psutil

    try:
        if psutil.Process(state.pid).status() != psutil.STATUS_ZOMBIE:
            return []
    except psutil.NoSuchProcess:
        pass
    return session_members(state.pid)


def leftovers_message(state: ClusterState, left: list[int], state_dir: Path) -> str:
    """The recorded head's leader is gone but processes of its session (`left`: gcs_server, raylet, ...) still run.
    `up` does not stop them itself: without the leader the node can still serve runs attached to it."""
    return (f"the Ray head recorded in {state_dir / 'cluster.json'} lost its leader (pid {state.pid} is gone), but "
            f"{len(left)} of its processes still run (pids {' '.join(map(str, left))}; they may hold port {state.port} "
            f"and serve runs attached to ray.address={state.address}): stop them with `{_command(state_dir, 'down')}`,"
            f" then start the head again with `{_command(state_dir, 'up')}`")


def _command(state_dir: Path, verb: str) -> str:
    return "python -m infra.cluster " + ("" if state_dir == DEFAULT_STATE_DIR else f"--state-dir {state_dir} ") + verb


def resources(state: ClusterState) -> dict[str, dict[str, float]]:
    """Attach as a driver for a moment: total and available resources (actors left behind hold CPUs)."""
    import ray

    attach_auth()
    ray.init(address=state.address, namespace="rlpipe-status", log_to_driver=False, configure_logging=False)
    try:
        return {"total": ray.cluster_resources(), "available": ray.available_resources()}
    finally:
        ray.shutdown()


# --------------------------------------------------------------------------------------------------
# helpers


def _head_env() -> dict[str, str]:
    """This process's environment plus the workers' (group.py worker_env), token authentication on."""
    from stages.workers.group import worker_env  # the workers run stage code: their env is defined there

    env = {**os.environ, **worker_env(RayConfig()), "RAY_USAGE_STATS_ENABLED": "0"}
    if "RAY_AUTH_MODE" not in env:
        env["RAY_AUTH_MODE"] = "token"
        # creates ~/.ray/auth_token once (as ray.init() does); prints the token, which stays in the pipe
        subprocess.run([RAY, "get-auth-token", "--generate"], env=env, capture_output=True, check=True, timeout=120)
    return env


def _check_port_free(port: int) -> None:
    with socket.socket() as sock:
        try:
            sock.bind(("", port))
        except OSError as exc:
            raise ClusterError(f"--port {port} is in use ({exc.strerror}): another Ray head or service holds "
                               "it; pick a free port with --port") from None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_ready(process: subprocess.Popen, log: Path, port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ClusterError(f"ray start exited with code {process.returncode}; its log ({log}) ends with:\n"
                               + _tail(log))
        if READY_LINE in log.read_text(errors="replace") and _listening(port):
            return
        time.sleep(0.5)
    raise ClusterError(f"the Ray head did not start within {timeout_s:.0f} s (--timeout); log {log}:\n" + _tail(log))


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            return True
    except OSError:
        return False


def _tail(log: Path, lines: int = 20) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def _stop_session(leader: int, grace_s: float) -> None:
    """SIGTERM the `ray start --block` leader (it stops the node's processes in order), then SIGKILL whatever
    of its session is still there: Ray's worker processes have their own process groups, not sessions."""
    try:
        os.kill(leader, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace_s
    while session_members(leader) and time.monotonic() < deadline:
        _reap(leader)
        time.sleep(0.5)
    _kill(session_members(leader), signal.SIGKILL)
    _reap(leader)


def session_members(session: int) -> list[int]:
    """Live processes of a session (zombies excluded)."""
    import psutil

    found = []
    for proc in psutil.process_iter(["status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and os.getsid(proc.pid) == session:
                found.append(proc.pid)
        except (OSError, psutil.Error):  # exited meanwhile
            continue
    return found


def _kill(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _reap(pid: int) -> None:
    """Collect the leader's exit status when this process started it (`up` then `down` in one process)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


# --------------------------------------------------------------------------------------------------
# command line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.cluster", description=__doc__.split("\n\n")[0])
    parser.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR, help="where cluster.json is kept")
    sub = parser.add_subparsers(dest="command", required=True)
    start = sub.add_parser("up", help="start the head node (no-op when it runs)")
    start.add_argument("--port", type=int, default=DEFAULT_PORT, help="GCS port: the address is 127.0.0.1:PORT")
    start.add_argument("--num-cpus", type=int, default=None, help="CPUs the node offers (default: all)")
    start.add_argument("--temp-dir", default=None, help="Ray's session/log folder (default: TMP/rlpipe-ray-PORT)")
    start.add_argument("--timeout", type=float, default=180, help="seconds to wait for the node")
    sub.add_parser("down", help="stop the head node started by up").add_argument("--timeout", type=float, default=60)
    sub.add_parser("status", help="address, process and resources of the head node")
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except ClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    if args.command == "up":
        if args.num_cpus is not None and args.num_cpus <= 0:
            raise ClusterError(f"--num-cpus {args.num_cpus}: must be > 0 (or left out for all CPUs)")
        was = ClusterState.read(args.state_dir)
        state = up(args.port, args.num_cpus, args.state_dir, args.temp_dir, args.timeout)
        again = was is not None and was.pid == state.pid
        print(f"Ray head {'already running' if again else 'started'}: pid {state.pid}, log {state.log}, "
              f"Ray logs {state.temp_dir}\nrun with:\nray.address={state.address}")
        return 0
    if args.command == "down":
        state = down(args.state_dir, args.timeout)
        print(f"stopped the Ray head at {state.address} (pid {state.pid})" if state
              else f"no Ray head recorded in {args.state_dir}: nothing to stop")
        return 0
    state = ClusterState.read(args.state_dir)
    if state is None or not is_running(state):
        left = leftovers(state) if state else []
        print(f"not running: {leftovers_message(state, left, args.state_dir)}" if left else
              f"not running ({'stale state: pid %d is gone' % state.pid if state else 'no state'} in "
              f"{args.state_dir}); start it with `{_command(args.state_dir, 'up')}`")
        return 1
    res = resources(state)
    cpus = f"CPU {res['available'].get('CPU', 0):g}/{res['total'].get('CPU', 0):g} free"
    print(f"running: ray.address={state.address} pid={state.pid} since {state.started} ({cpus}, "
          f"auth {state.auth_mode}, log {state.log})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
