"""Sandboxes: where the agent's commands run (see `sandbox.base.Sandbox`)."""

from __future__ import annotations

from tmax.sandbox.base import (
    DEFAULT_COMMAND_TIMEOUT_S, HOST_KINDS, KINDS, LABEL_KEY, LABEL_VALUE, NAME_PREFIX, CommandResult, Forked,
    ForkRecord, Sandbox, SandboxCapabilities, SandboxError, SandboxKind, SandboxSpec,
)


def sandbox_class(kind: str) -> type:
    """The backend class of a sandbox kind (what `make_sandbox` makes; its `capabilities`)."""
    if kind == "local":
        from tmax.sandbox.local import LocalSandbox

        return LocalSandbox
    if kind == "bwrap":
        from tmax.sandbox.bwrap import BwrapSandbox

        return BwrapSandbox
    if kind == "podman":
        from tmax.sandbox.podman import PodmanSandbox

        return PodmanSandbox
    raise ValueError(f"unknown sandbox kind {kind!r}; expected one of {', '.join(KINDS)}")


def make_sandbox(kind: str, spec: SandboxSpec | None = None, **options) -> Sandbox:
    """A new, not yet started sandbox. `options` go to the backend (podman: runtime,
    ulimits)."""
    spec = spec or SandboxSpec()
    if spec.files is not None:  # only an overlay episode writes a files layer (`sandbox.overlay_pool`)
        raise SandboxError("a files layer needs an overlay episode; a sandbox of its own needs the built image")
    return sandbox_class(kind)(spec, **options)


__all__ = [
    "CommandResult", "DEFAULT_COMMAND_TIMEOUT_S", "Forked", "ForkRecord", "HOST_KINDS", "KINDS", "LABEL_KEY",
    "LABEL_VALUE", "NAME_PREFIX", "Sandbox", "SandboxCapabilities", "SandboxError", "SandboxKind", "SandboxSpec",
    "make_sandbox", "sandbox_class",
]
