"""The Harbor task format: one directory per task.

    task.toml        timeouts, resources, metadata (TB2 schema `version = "1.0"` or newer
                     `schema_version` with `memory_mb` / `storage_mb`), and the users
                     `[agent] user` / `[verifier] user` run as (default: the image's USER)
    instruction.md   the prompt, verbatim
    environment/     Dockerfile + build context (docker-compose environments are refused)
    tests/test.sh    the verifier, copied to /tests after the agent stops
    solution/solve.sh  the reference solution (used by the `oracle` agent)

`Task.load` validates all of it; every error names the file and, where there is one,
the field, so a broken task is fixed in one look.
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

COMPOSE_FILES = ("docker-compose.yaml", "docker-compose.yml", "compose.yaml", "compose.yml")


class TaskError(ValueError):
    """A task directory that cannot be used; the message names the file (and field)."""

    def __init__(self, path: Path | str, message: str, field: str | None = None):
        self.path = Path(path)
        self.field = field
        where = f"{self.path}" + (f": {field}" if field else "")
        super().__init__(f"{where}: {message}")


class UnsupportedTask(TaskError):
    """A valid task that this harness cannot run (e.g. a docker-compose environment)."""


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_SIZE_MB = {"": 1 / (1024 * 1024), "k": 1 / 1024, "m": 1, "g": 1024, "t": 1024 * 1024}


def parse_size_mb(value: Any) -> int:
    """'2G' -> 2048, '512M' -> 512, '4Gi' -> 4096, 2048 (already MB) -> 2048."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size like '2G', got {value!r}")
    if isinstance(value, (int, float)):
        return int(value)
    m = _SIZE_RE.match(str(value))
    if not m:
        raise ValueError(f"expected a size like '2G' or '512M', got {value!r}")
    number, unit = float(m.group(1)), m.group(2).lower()
    if unit == "" and not m.group(3):
        return int(number)  # a bare number is MB, as in memory_mb
    return max(1, int(number * _SIZE_MB[unit]))


class _Section(BaseModel):
    # Unknown keys are kept (newer Harbor versions add fields); known ones are typed.
    model_config = ConfigDict(extra="allow")


class _RunsAs(_Section):
    # Harbor's `user`: a user name or UID to run this phase as; None keeps the image's USER.
    user: str | None = None

    @field_validator("user", mode="before")
    @classmethod
    def _user(cls, v: Any) -> Any:
        if isinstance(v, str) and not v.strip():
            raise ValueError("a user name or UID, not an empty string (leave it out for the image's USER)")
        return str(v) if isinstance(v, int) and not isinstance(v, bool) else v


class VerifierSection(_RunsAs):
    timeout_sec: float = Field(600.0, gt=0)
    env: dict[str, str] = Field(default_factory=dict)


class AgentSection(_RunsAs):
    timeout_sec: float = Field(600.0, gt=0)


class EnvironmentSection(_Section):
    # Defaults for a task that declares nothing are Harbor's (1 cpu, 2 GiB memory, 10 GiB
    # storage, internet allowed); `pids_limit` is tmax's own key (Harbor has none).
    build_timeout_sec: float = Field(600.0, gt=0)
    docker_image: str | None = None
    cpus: float = Field(1.0, gt=0)
    memory_mb: int = Field(2048, gt=0)
    storage_mb: int = Field(10240, gt=0)
    pids_limit: int = Field(4096, gt=0)
    gpus: int = Field(0, ge=0)
    allow_internet: bool = True

    @model_validator(mode="before")
    @classmethod
    def _legacy_sizes(cls, data: Any) -> Any:
        # TB2 (schema 1.0) spells sizes as strings: memory = "2G", storage = "10G".
        if isinstance(data, dict):
            data = dict(data)
            for old, new in (("memory", "memory_mb"), ("storage", "storage_mb")):
                if old in data:
                    value = data.pop(old)
                    if new not in data:
                        try:
                            data[new] = parse_size_mb(value)
                        except ValueError as e:
                            raise ValueError(f"{old}: {e}") from None
        return data

    @field_validator("memory_mb", "storage_mb", mode="before")
    @classmethod
    def _sizes(cls, v: Any) -> Any:
        return parse_size_mb(v)


class TaskToml(_Section):
    version: str | None = None
    schema_version: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    verifier: VerifierSection = Field(default_factory=VerifierSection)
    agent: AgentSection = Field(default_factory=AgentSection)
    environment: EnvironmentSection = Field(default_factory=EnvironmentSection)

    @field_validator("version", "schema_version", mode="before")
    @classmethod
    def _str_version(cls, v: Any) -> Any:
        return str(v) if isinstance(v, (int, float)) else v


def _field_path(loc: tuple) -> str:
    parts = [str(p) for p in loc if not isinstance(p, int)]
    if len(parts) >= 2:
        return f"[{'.'.join(parts[:-1])}] {parts[-1]}"
    return parts[0] if parts else "(root)"


def load_config(toml_path: Path) -> TaskToml:
    try:
        raw = tomllib.loads(toml_path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise TaskError(toml_path, f"invalid TOML: {e}") from None
    except UnicodeDecodeError:
        raise TaskError(toml_path, "not UTF-8 text") from None
    try:
        return TaskToml.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        msg = err["msg"].removeprefix("Value error, ")
        loc = err["loc"]
        # Errors raised by the legacy-size hook carry the key in the message.
        if msg.split(":")[0] in ("memory", "storage") and len(loc) == 1:
            key, _, msg = msg.partition(": ")
            loc = loc + (key,)
        extra = f" (and {len(e.errors()) - 1} more)" if len(e.errors()) > 1 else ""
        raise TaskError(toml_path, msg + extra, field=_field_path(loc)) from None


@dataclass
class Task:
    name: str
    path: Path
    config: TaskToml
    instruction: str

    @property
    def environment_dir(self) -> Path:
        return self.path / "environment"

    @property
    def dockerfile(self) -> Path:
        return self.environment_dir / "Dockerfile"

    @property
    def tests_dir(self) -> Path:
        return self.path / "tests"

    @property
    def solution_dir(self) -> Path:
        return self.path / "solution"

    @property
    def has_solution(self) -> bool:
        return (self.solution_dir / "solve.sh").is_file()

    @property
    def category(self) -> str:
        return str(self.config.metadata.get("category") or "uncategorized")

    @property
    def difficulty(self) -> str | None:
        d = self.config.metadata.get("difficulty")
        return str(d) if d is not None else None

    def checksum(self) -> str:
        """sha256 over every file of the task (path + bytes), for job identity."""
        return tree_hash(self.path)

    @classmethod
    def load(cls, path: str | Path) -> "Task":
        path = Path(path).expanduser().resolve()
        if not path.exists():
            raise TaskError(path, "no such task directory")
        if not path.is_dir():
            raise TaskError(path, "a task is a directory (with task.toml, instruction.md, environment/, tests/)")
        toml_path = path / "task.toml"
        if not toml_path.is_file():
            raise TaskError(toml_path, "missing (every task directory needs a task.toml)")
        config = load_config(toml_path)

        ins = path / "instruction.md"
        if not ins.is_file():
            raise TaskError(ins, "missing (the agent's prompt)")
        try:
            instruction = ins.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise TaskError(ins, "not UTF-8 text") from None
        if not instruction.strip():
            raise TaskError(ins, "empty (the agent would get no task)")

        env = path / "environment"
        if not env.is_dir():
            raise TaskError(env, "missing (needs a Dockerfile and its build context)")
        compose = [env / f for f in COMPOSE_FILES if (env / f).is_file()]
        if compose:
            raise UnsupportedTask(
                compose[0],
                "docker-compose environments are not supported: tmax runs one container per "
                "trial from environment/Dockerfile",
            )
        if not (env / "Dockerfile").is_file():
            raise TaskError(env / "Dockerfile", "missing (the task's image is built from it)")

        test_sh = path / "tests" / "test.sh"
        if not test_sh.is_file():
            raise TaskError(test_sh, "missing (the verifier script that writes /logs/verifier/reward.txt)")
        if (path / "solution").exists() and not (path / "solution" / "solve.sh").is_file():
            raise TaskError(path / "solution" / "solve.sh", "missing (solution/ exists but has no solve.sh)")
        return cls(name=path.name, path=path, config=config, instruction=instruction)


def tree_hash(root: Path, extra: bytes = b"") -> str:
    """Content hash of a directory: relative paths, modes' exec bit and bytes, sorted."""
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_dir():
            continue
        rel = p.relative_to(root).as_posix()
        h.update(rel.encode() + b"\0")
        if p.is_symlink():
            h.update(b"L" + str(p.readlink()).encode() + b"\0")
            continue
        h.update(b"X" if p.stat().st_mode & 0o111 else b"F")
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        h.update(b"\0")
    h.update(extra)
    return h.hexdigest()
