"""Slurm: the sbatch script `tmax learn --dry-run` writes for a placement plan."""

from __future__ import annotations

import shlex

from tmax.training.cluster.placement import PlacementPlan


def sbatch_script(
    plan: PlacementPlan,
    learn_args: list[str],
    job_name: str = "tmax-learn",
    time_limit: str = "72:00:00",
    cpus_per_node: int | None = None,
    setup: str = "",
) -> str:
    """A ready sbatch script: one task per node; the batch step runs `tmax learn` on the
    first node, and tmax starts Ray on every allocated node itself (training/cluster/launch.py).
    With sandbox nodes the job is heterogeneous: the GPU nodes, then the CPU sandbox nodes.
    `learn_args` are the `tmax learn` arguments (`--config FILE`: the whole run), quoted."""
    args = " ".join(shlex.quote(a) for a in learn_args)
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={plan.nodes}",
        "#SBATCH --ntasks-per-node=1",
    ]
    if plan.use_gpu:
        lines.append(f"#SBATCH --gpus-per-node={plan.gpus_per_node}")
    if cpus_per_node:
        lines.append(f"#SBATCH --cpus-per-task={cpus_per_node}")
    lines += [
        "#SBATCH --exclusive",
        f"#SBATCH --time={time_limit}",
        f"#SBATCH --output={job_name}-%j.out",
    ]
    if plan.sandbox_nodes:
        # A second component of CPU nodes: the sandbox nodes (their Ray nodes get tmax_sandbox).
        lines += ["#SBATCH hetjob", f"#SBATCH --nodes={plan.sandbox_nodes}", "#SBATCH --ntasks-per-node=1",
                  *([f"#SBATCH --cpus-per-task={cpus_per_node}"] if cpus_per_node else []), "#SBATCH --exclusive"]
    lines += [
        "set -euo pipefail",
        "# Every Ray process must agree on auth, or workers fail to join the head.",
        "# A value set where the job is submitted is kept (sbatch exports the environment).",
        'export RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}" RAY_USAGE_STATS_ENABLED=0',
        "# Inside the allocation `tmax learn` starts the Ray head here and one worker per",
        "# other node (srun --overlap), pins learners and engines per the plan, and stops",
        "# Ray when it exits.",
    ]
    if setup:
        lines.append(setup)
    lines += [
        'echo "tmax: nodes $(scontrol show hostnames "$SLURM_JOB_NODELIST" | paste -sd, -)"',
        f"exec tmax learn {args}".rstrip(),
        "",
    ]
    return "\n".join(lines)
