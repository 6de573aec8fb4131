"""Getting a Ray cluster for `tmax learn`: the one way tmax starts or joins Ray (`connect`).

The mode comes from the `[cluster]` config and the environment, as the launchers of other
RL frameworks do it:

* `cluster.address` or `RAY_ADDRESS` -> connect to a running cluster;
* a placed run (`cluster.nodes`) inside a Slurm allocation
                                     -> `ray start --head` here, `srun ... ray start --address`
                                        on every other allocated node, then connect;
* otherwise                          -> a private single-node cluster bound to 127.0.0.1.

Every Ray process must agree on `RAY_AUTH_MODE`: after a first `ray.init()` writes an auth
token, a head started without the variable enables token auth and workers that were not
told are rejected. So `ray_env()` pins it (keeping a value the user
set) and every command and child process gets the same environment.

Nodes started by tmax carry a role resource (`tmax_train` / `tmax_infer`) so the
placement groups of `training.cluster.placement` land on exactly the planned nodes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from tmax.common.proctree import end_process_tree, parent_death_hook
from tmax.common.waiting import wait_until
from tmax.training.cluster.placement import PlacementPlan
from tmax.training.config import ClusterConfig
from tmax.training.net import node_ip

DEFAULT_PORT = 6379


# Every Ray process (driver, raylet, workers) must agree on these (see above).
RAY_ENV_KEYS = ("RAY_AUTH_MODE", "RAY_USAGE_STATS_ENABLED")


def ray_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The Ray variables every tmax process and Ray command must share."""
    env = dict(os.environ if base is None else base)
    env["RAY_AUTH_MODE"] = env.get("RAY_AUTH_MODE") or "disabled"
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    return env


def apply_ray_env() -> None:
    """Set the shared Ray variables in this process (before `import ray` talks to a cluster)."""
    for k in RAY_ENV_KEYS:
        os.environ[k] = ray_env()[k]


def resolve_mode(address: str | None = None, env: dict[str, str] | None = None) -> str:
    """"address" | "slurm" | "local", in that order of precedence."""
    env = dict(os.environ if env is None else env)
    if address or env.get("RAY_ADDRESS"):
        return "address"
    if env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST"):
        return "slurm"
    return "local"


def role_resources(plan: PlacementPlan, node_index: int) -> dict[str, float]:
    """Custom resources node `node_index` of the allocation is started with."""
    roles = plan.node_roles()
    if node_index >= len(roles):
        return {}  # extra nodes in the allocation: sandbox workers only
    return {r: 1.0 for r in roles[node_index]}


# -- Slurm -----------------------------------------------------------------------------


class ClusterError(RuntimeError):
    """The Ray cluster could not be reached or started (infrastructure, not the run)."""


def slurm_hostnames(nodelist: str | None = None) -> list[str]:
    """Expand the allocation's compressed node list with `scontrol show hostnames`."""
    nodelist = nodelist or os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodelist:
        raise ClusterError("not inside a Slurm allocation: SLURM_JOB_NODELIST is unset")
    if not shutil.which("scontrol"):
        raise ClusterError("SLURM_JOB_NODELIST is set but `scontrol` is not on PATH")
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise ClusterError(f"scontrol show hostnames {nodelist} failed: {out.stderr.strip()}")
    hosts = [h.strip() for h in out.stdout.splitlines() if h.strip()]
    if not hosts:
        raise ClusterError(f"scontrol returned no hosts for {nodelist!r}")
    return hosts


def ray_bin() -> str:
    """The `ray` executable of this interpreter's environment (not whatever is on PATH)."""
    cand = os.path.join(os.path.dirname(sys.executable), "ray")
    return cand if os.path.exists(cand) else (shutil.which("ray") or "ray")


def head_start_cmd(
    plan: PlacementPlan, port: int, node_ip: str, num_gpus: int | None = None, num_cpus: int | None = None
) -> list[str]:
    cmd = [
        ray_bin(),
        "start",
        "--head",
        f"--port={port}",
        f"--node-ip-address={node_ip}",
        f"--resources={json.dumps(role_resources(plan, 0))}",
        "--disable-usage-stats",
        "--include-dashboard=false",
    ]
    if num_gpus is not None:
        cmd.append(f"--num-gpus={num_gpus}")
    if num_cpus is not None:
        cmd.append(f"--num-cpus={num_cpus}")
    return cmd


def slurm_hosts() -> tuple[list[str], list[int | None]]:
    """Every allocated host and its component: a heterogeneous job's components in order
    (with sandbox nodes, theirs is the second), else the job's nodes (component None)."""
    groups = sorted(int(k.rsplit("_", 1)[1]) for k in os.environ if k.startswith("SLURM_JOB_NODELIST_HET_GROUP_"))
    if not groups:
        hosts = slurm_hostnames()
        return hosts, [None] * len(hosts)
    hosts, comps = [], []
    for g in groups:
        names = slurm_hostnames(os.environ[f"SLURM_JOB_NODELIST_HET_GROUP_{g}"])
        hosts += names
        comps += [g] * len(names)
    return hosts, comps


def worker_start_cmds(
    plan: PlacementPlan, hosts: list[str], head_addr: str, num_cpus: int | None = None,
    components: list[int | None] | None = None,
) -> list[list[str]]:
    """One `srun` per non-head host (of its component in a heterogeneous job). `--block`
    keeps the worker in the foreground of its srun step, so the worker exits when tmax ends
    the step (or the head goes away)."""
    cmds = []
    for i, host in enumerate(hosts[1:], start=1):
        comp = components[i] if components else None
        cmds.append(
            [
                "srun",
                *([f"--het-group={comp}"] if comp is not None else []),
                "--nodes=1",
                "--ntasks=1",
                "--overlap",
                f"--nodelist={host}",
                ray_bin(),
                "start",
                f"--address={head_addr}",
                f"--resources={json.dumps(role_resources(plan, i))}",
                "--disable-usage-stats",
                "--block",
                *([f"--num-cpus={num_cpus}"] if num_cpus is not None else []),
            ]
        )
    return cmds


# -- the handle --------------------------------------------------------------------------


@dataclass
class ClusterHandle:
    mode: str  # address | slurm | local | existing (a Ray this process had joined before)
    address: str
    _procs: list[subprocess.Popen] = field(default_factory=list)
    _head: subprocess.Popen | None = None  # `ray start --head --block` this process started

    def shutdown(self) -> None:
        import ray

        if self.mode == "existing":
            return
        if ray.is_initialized():
            ray.shutdown()
        for p in self._procs:  # srun steps of the workers
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
        if self._head is not None:
            # This head and what it started, not `ray stop`, which stops every Ray on the node.
            end_process_tree(self._head.pid, grace_s=20.0)


def wait_for_nodes(expected: int, timeout_s: float = 300.0) -> int:
    """Block until `expected` nodes are alive; a clear error names how many joined."""
    import ray

    counts: list[int] = []

    def enough() -> bool:
        counts.append(sum(1 for n in ray.nodes() if n.get("Alive")))
        return counts[-1] >= expected

    wait_until(enough, timeout_s, 2.0)
    alive = counts[-1]
    if alive >= expected:
        return alive
    raise ClusterError(f"only {alive} of {expected} Ray node(s) joined within {timeout_s:g}s")


def runtime_env() -> dict:
    """Ray's `runtime_env` for the driver: every worker gets the shared variables."""
    return {"env_vars": {k: os.environ[k] for k in RAY_ENV_KEYS}}


def connect(
    cluster: ClusterConfig,
    plan: PlacementPlan | None = None,
    port: int = DEFAULT_PORT,
    join_timeout_s: float = 300.0,
) -> ClusterHandle:
    """Connect to, or start, the Ray cluster of a run (see the module docstring). A Ray
    this process is already connected to is used as it is (and left running)."""
    apply_ray_env()  # keeps a RAY_AUTH_MODE the user set, else "disabled"
    import ray

    if ray.is_initialized():
        return ClusterHandle("existing", "this process's Ray")
    mode = resolve_mode(cluster.address)
    if mode == "address":
        return _join(cluster.address or os.environ["RAY_ADDRESS"])
    if mode == "slurm" and plan is not None:
        return _start_in_slurm(plan, cluster.num_cpus, port, join_timeout_s)
    if plan is not None and plan.nodes + plan.sandbox_nodes > 1:
        raise ClusterError(
            f"--nodes {plan.nodes} (+ {plan.sandbox_nodes} sandbox node(s)) needs a Ray cluster: pass --address (or set RAY_ADDRESS), run inside a Slurm"
            " allocation, or use --dry-run to get an sbatch script"
        )
    return _start_local(plan, cluster.num_cpus)


def _join(addr: str) -> ClusterHandle:
    import ray

    try:
        ray.init(address=addr, runtime_env=runtime_env(), log_to_driver=False, configure_logging=False)
    except Exception as e:  # ConnectionError, auth errors, version mismatch
        raise ClusterError(
            f"cannot connect to the Ray cluster at {addr}: {e}. Check the address, that the head runs"
            f" the same Ray version, and that RAY_AUTH_MODE={os.environ['RAY_AUTH_MODE']} matches it."
        ) from None
    return ClusterHandle("address", addr)


def _start_head(cmd: list[str], host: str, timeout_s: float = 300.0) -> subprocess.Popen:
    """`ray start --head --block` in its own session, returned once Ray says it started:
    ending that process tree later stops this head only (a node may run other clusters)."""
    fd, log = tempfile.mkstemp(prefix="tmax-ray-head-", suffix=".log")
    with os.fdopen(fd, "wb") as out:
        proc = subprocess.Popen([*cmd, "--block"], env=ray_env(), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=parent_death_hook())

    def started() -> bool:
        text = Path(log).read_text(errors="replace")
        if proc.poll() is not None:
            raise ClusterError(f"ray start --head failed on {host} (exit {proc.returncode}): {text.strip()[-2000:]}")
        return "Ray runtime started" in text

    if not wait_until(started, timeout_s, 0.5):
        end_process_tree(proc.pid, grace_s=5.0)
        raise ClusterError(f"ray start --head on {host} did not start within {timeout_s:g}s (log: {log})")
    os.unlink(log)  # the head keeps writing to the open file; nothing is left behind
    return proc


def _start_in_slurm(plan: PlacementPlan, num_cpus: int | None, port: int, join_timeout_s: float) -> ClusterHandle:
    """The head here, a worker per other allocated node; `num_cpus` is every node's logical CPUs."""
    import ray

    hosts, components = slurm_hosts()
    if len(hosts) < plan.nodes + plan.sandbox_nodes:
        raise ClusterError(f"the Slurm allocation has {len(hosts)} node(s), the plan needs"
                           f" {plan.nodes + plan.sandbox_nodes}")
    ip = node_ip()
    handle = ClusterHandle("slurm", f"{ip}:{port}", _head=_start_head(head_start_cmd(plan, port, ip, num_cpus=num_cpus),
                                                                     hosts[0]))
    for cmd in worker_start_cmds(plan, hosts, f"{ip}:{port}", num_cpus=num_cpus, components=components):
        handle._procs.append(subprocess.Popen(cmd, env=ray_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    try:
        ray.init(address=f"{ip}:{port}", runtime_env=runtime_env(), log_to_driver=False, configure_logging=False)
        wait_for_nodes(len(hosts), join_timeout_s)
    except Exception:
        handle.shutdown()
        raise
    return handle


def _start_local(plan: PlacementPlan | None, num_cpus: int | None) -> ClusterHandle:
    """A new private cluster in this process, bound to 127.0.0.1 (a one-node plan's role
    resources on it)."""
    import ray

    resources: dict[str, float] = {}
    for roles in plan.node_roles() if plan is not None else []:
        for r in roles:
            resources[r] = resources.get(r, 0.0) + 1.0
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # single node: bind loopback
    try:
        ray.init(
            # "local": always a new private cluster; without it ray.init joins whatever cluster
            # another process on this machine last started.
            address="local",
            num_cpus=num_cpus or os.cpu_count(),
            resources=resources,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            runtime_env=runtime_env(),
            log_to_driver=False,
            configure_logging=False,
        )
    except Exception as e:  # e.g. its raylet not registered in time on an overloaded machine
        raise ClusterError(f"infrastructure: a local Ray cluster did not start: {e}") from e
    return ClusterHandle("local", "127.0.0.1")
