"""The docs' settings tables, made from the settings' declaration (`common.settings`).

A page holds a table between `<!-- settings: NAME -->` and `<!-- /settings -->`;
`python -m tmax.cli.settings_docs` rewrites every such table from `TABLES`, and
tests/unit/test_settings.py fails when a page's table differs from what it would write."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from pydantic import BaseModel

from tmax.common.settings import settings_table

PAGES = Path(__file__).resolve().parents[2] / "docs"
BLOCK = re.compile(r"(<!-- settings: (?P<name>[a-z]+) -->\n)(?P<body>.*?)(<!-- /settings -->)", re.S)


def tables() -> dict[str, tuple[type[BaseModel], str, str]]:
    """Table name -> (the settings' model, the command whose flags it shows, its variables' prefix)."""
    from tmax.cli.bench_settings import ENV_PREFIX as BENCH_PREFIX
    from tmax.cli.bench_settings import BenchSettings
    from tmax.cli.run_settings import ENV_PREFIX as RUN_PREFIX
    from tmax.cli.run_settings import RunKeys
    from tmax.tasks.corpus.generate_config import COMMAND as GENERATE
    from tmax.tasks.corpus.generate_config import ENV_PREFIX as GENERATE_PREFIX
    from tmax.tasks.corpus.generate_config import GenerateConfig
    from tmax.training.config import ENV_PREFIX as LEARN_PREFIX
    from tmax.training.config import LearnConfig

    return {"run": (RunKeys, "run", RUN_PREFIX), "bench": (BenchSettings, "bench run", BENCH_PREFIX),
            "learn": (LearnConfig, "learn", LEARN_PREFIX), "generate": (GenerateConfig, GENERATE, GENERATE_PREFIX)}


def render(text: str) -> str:
    """`text` with each settings table written from the declaration."""
    known = tables()

    def table(m: re.Match) -> str:
        model, command, prefix = known[m["name"]]
        return m.group(1) + "\n".join(settings_table(model, command, prefix)) + "\n" + m.group(4)

    return BLOCK.sub(table, text)


def main() -> int:
    for page in sorted(PAGES.glob("*.md")):
        text = page.read_text()
        new = render(text)
        if new != text:
            page.write_text(new)
            print(f"rewrote the settings tables of {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
