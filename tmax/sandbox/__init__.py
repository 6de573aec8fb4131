"""Sandboxes: where the agent's commands run (see `sandbox.base.Sandbox`)."""

from __future__ import annotations

from tmax.sandbox.base import (
    DEFAULT_COMMAND_TIMEOUT_S, HOST_KINDS, KINDS, LABEL_KEY, LABEL_VALUE, NAME_PREFIX, CommandResult, Sandbox,
    SandboxError, SandboxKind, SandboxSpec,
)


def make_sandbox(kind: str, spec: SandboxSpec | None = None, **options) -> Sandbox:
    """A new, not yet started sandbox. `options` go to the backend (podman: runtime,
    ulimits)."""
    spec = spec or SandboxSpec()
    if spec.files is not None:  # only an overlay episode writes a files layer (`sandbox.overlay_pool`)
        raise SandboxError("a files layer needs an overlay episode; a sandbox of its own needs the built image")
    if kind == "local":
        from tmax.sandbox.local import LocalSandbox

        return LocalSandbox(spec, **options)
    if kind == "bwrap":
        from tmax.sandbox.bwrap import BwrapSandbox

        return BwrapSandbox(spec, **options)
    if kind == "podman":
        from tmax.sandbox.podman import PodmanSandbox

        return PodmanSandbox(spec, **options)
    raise ValueError(f"unknown sandbox kind {kind!r}; expected one of {', '.join(KINDS)}")


__all__ = [
    "CommandResult", "DEFAULT_COMMAND_TIMEOUT_S", "HOST_KINDS", "KINDS", "LABEL_KEY", "LABEL_VALUE", "NAME_PREFIX",
    "Sandbox", "SandboxError", "SandboxKind", "SandboxSpec", "make_sandbox",
]
