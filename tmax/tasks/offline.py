"""Adapting tasks to machines without a registry: base-image map, CA bundle, patches.

All of it is data (`tasks/data/image_map.toml`, `tasks/data/patches.toml`) applied to
temporary copies; the task directories are never edited.
"""

from __future__ import annotations

import fnmatch
import json
import shutil
import tomllib
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from tmax.tasks.dockerfile import Instruction, from_parts, instructions
from tmax.tasks.task_format import Task, TaskError

DATA_DIR = Path(__file__).parent / "data"
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
# Where the host CA bundle is mounted in build and run containers.
CA_TARGET = "/run/hostca.crt"
CA_ENV_VARS = ("PIP_CERT", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")


@dataclass(frozen=True)
class Setup:
    workdir: str | None = None
    run: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class MapRule:
    pattern: str
    target: str
    setup: Setup | None = None


@dataclass(frozen=True)
class Patch:
    task: str
    file: str
    find: str
    replace: str
    why: str = ""


@dataclass
class RewriteConfig:
    rules: list[MapRule] = field(default_factory=list)
    patches: list[Patch] = field(default_factory=list)
    ca_bundle: Path | None = None  # host file mounted at CA_TARGET, None = do not touch trust

    @property
    def ca_env(self) -> dict[str, str]:
        return {k: CA_TARGET for k in CA_ENV_VARS} if self.ca_bundle else {}

    @property
    def ca_mount(self) -> list[tuple[str, str, bool]]:
        return [(str(self.ca_bundle), CA_TARGET, True)] if self.ca_bundle else []

    def patches_for(self, task: str, prefix: str = "") -> list[Patch]:
        return [p for p in self.patches if p.task == task and p.file.startswith(prefix)]

    def fingerprint(self, task: str) -> bytes:
        """What of this config can change the task's image (for the image hash)."""
        used = {
            "rules": [(r.pattern, r.target, r.setup and (r.setup.workdir, r.setup.run, r.setup.env))
                      for r in self.rules],
            "patches": [(p.file, p.find, p.replace) for p in self.patches_for(task, "environment/")],
            "ca": bool(self.ca_bundle),
        }
        return json.dumps(used, sort_keys=True, default=list).encode()

    def match(self, image: str) -> MapRule | None:
        for r in self.rules:
            if fnmatch.fnmatchcase(image, r.pattern) or fnmatch.fnmatchcase(_strip_registry(image), r.pattern):
                return r
        return None


def _strip_registry(image: str) -> str:
    # docker.io/library/ubuntu:24.04 and ubuntu:24.04 are the same image.
    for prefix in ("docker.io/library/", "docker.io/", "index.docker.io/library/"):
        if image.startswith(prefix):
            return image[len(prefix):]
    return image


@lru_cache(maxsize=None)
def _load_toml(name: str) -> dict:
    return tomllib.loads((DATA_DIR / name).read_text())


def parse_image_map(items: list[str]) -> list[MapRule]:
    """`--image-map FROM=TO` (FROM may be a glob); no setup steps are added for these."""
    rules = []
    for item in items:
        src, sep, dst = item.partition("=")
        if not sep or not src.strip() or not dst.strip():
            raise ValueError(f"--image-map {item!r}: expected FROM=TO, e.g. ubuntu:24.04=localhost/my-ubuntu:24.04")
        rules.append(MapRule(src.strip(), dst.strip(), None))
    return rules


def default_config(image_map: list[str] | None = None, ca_bundle: Path | None | bool = True,
                   patches: bool = True) -> RewriteConfig:
    data = _load_toml("image_map.toml")
    setups = {
        name: Setup(s.get("workdir"), tuple(s.get("run", [])), tuple(sorted(s.get("env", {}).items())))
        for name, s in data.get("setup", {}).items()
    }
    rules = parse_image_map(image_map or [])
    for m in data.get("map", []):
        if m.get("setup") and m["setup"] not in setups:
            raise ValueError(f"{DATA_DIR / 'image_map.toml'}: map {m['from']!r} names unknown setup {m['setup']!r}")
        rules.append(MapRule(m["from"], m["to"], setups.get(m.get("setup", ""))))
    plist = [Patch(**p) for p in _load_toml("patches.toml").get("patch", [])] if patches else []
    if ca_bundle is True:
        ca = HOST_CA_BUNDLE if HOST_CA_BUNDLE.is_file() else None
    else:
        ca = ca_bundle or None
    return RewriteConfig(rules=rules, patches=plist, ca_bundle=ca)


@dataclass
class RewrittenDockerfile:
    text: str
    base_images: list[str]  # images the build needs (after mapping), excluding stage names
    notes: list[str]


def _rewritten_from(ins: Instruction, cfg: RewriteConfig, stages: set[str], bases: list[str],
                    notes: list[str]) -> list[str]:
    """The lines that replace one FROM: the mapped image, then the CA env and setup steps."""
    parts = from_parts(ins.value)
    if parts.image.lower() in stages:  # FROM an earlier stage: nothing to map
        if parts.stage:
            stages.add(parts.stage.lower())
        return ins.text.splitlines()
    if parts.stage:
        stages.add(parts.stage.lower())
    rule = cfg.match(parts.image)
    target = rule.target if rule else parts.image
    if rule:
        notes.append(f"FROM {parts.image} -> {target}")
    bases.append(target)
    out = [" ".join(["FROM", *parts.flags, target] + ([parts.as_word, parts.stage] if parts.stage else []))]
    if cfg.ca_bundle:
        out.append("ENV " + " ".join(f"{k}={v}" for k, v in cfg.ca_env.items()))
    setup = rule.setup if rule else None
    if setup:
        if setup.env:
            out.append("ENV " + " ".join(f"{k}={v}" for k, v in setup.env))
        out += [f"RUN {cmd}" for cmd in setup.run]
        if setup.workdir:
            out.append(f"WORKDIR {setup.workdir}")
    return out


def rewrite_dockerfile(text: str, cfg: RewriteConfig) -> RewrittenDockerfile:
    """Re-target each FROM (keeping `AS stage`), then insert the setup steps and CA env;
    every other line stays as written."""
    lines = text.splitlines()
    out: list[str] = []
    stages: set[str] = set()
    bases: list[str] = []
    notes: list[str] = []
    cursor = 0
    for ins in instructions(text):
        if ins.op != "FROM":
            continue
        out += lines[cursor:ins.start]
        out += _rewritten_from(ins, cfg, stages, bases, notes)
        cursor = ins.end + 1
    out += lines[cursor:]
    rewritten = "\n".join(out) + "\n"
    # buildah (podman 4.3) does not create a WORKDIR that no later step touches, and a
    # container cannot start in a missing directory; Docker always creates it.
    workdir = last_workdir(rewritten)
    if workdir:
        rewritten += f"RUN mkdir -p {workdir}\n"
    return RewrittenDockerfile(rewritten, bases, notes)


def last_workdir(text: str) -> str | None:
    """The final stage's WORKDIR (relative ones joined), None if unset or variable."""
    wd = None
    for ins in instructions(text):
        if ins.op == "FROM":
            wd = None
        elif ins.op == "WORKDIR" and ins.value:
            wd = ins.value if ins.value.startswith("/") or wd is None else f"{wd.rstrip('/')}/{ins.value}"
    return wd if wd and "$" not in wd else None


def apply_patches(root: Path, patches: list[Patch], task_root: Path) -> list[str]:
    """Apply patches to files copied under `root` (paths relative to the task directory,
    with `root` standing for the directory `task_root`-relative prefix was copied to)."""
    notes = []
    for p in patches:
        target = root / p.file
        if not target.is_file():
            raise TaskError(task_root / p.file, f"patch for {p.task} names a file that does not exist")
        text = target.read_text(encoding="utf-8")
        if p.find not in text:
            raise TaskError(task_root / p.file, f"patch ({p.why or 'no reason given'}) no longer applies: "
                                                f"text not found: {p.find[:80]!r}")
        target.write_text(text.replace(p.find, p.replace), encoding="utf-8")
        notes.append(f"patched {p.file}: {p.why}")
    return notes


def copy_patched(task: Task, sub: str, dst: Path, cfg: RewriteConfig) -> list[str]:
    """Copy `task.path/sub` to `dst` and apply the task's patches for files under it."""
    shutil.copytree(task.path / sub, dst, symlinks=True)
    rel = [Patch(p.task, p.file[len(sub) + 1:], p.find, p.replace, p.why)
           for p in cfg.patches_for(task.name, sub + "/")]
    return apply_patches(dst, rel, task.path / sub)
