"""`tmax sandbox build-base | clean | prune`."""

from __future__ import annotations

from pathlib import Path

import typer

from tmax.cli.exits import fail

sandbox_app = typer.Typer(help="Manage sandboxes: the base image and leftovers.", no_args_is_help=True)


@sandbox_app.command("build-base")
def build_base_cmd(
    tag: str = typer.Option("localhost/tmax-base:bookworm", help="Image tag to build."),
    force: bool = typer.Option(False, "--force", help="Rebuild even if the image exists."),
    mirror: str = typer.Option("http://deb.debian.org/debian", help="Debian mirror for debootstrap."),
    rootfs: Path | None = typer.Option(None, help="Import this debootstrapped tree instead of running debootstrap.",
                                      exists=True, file_okay=False),
) -> None:
    """Build the offline base image (debootstrap bookworm -> podman import, host CA bundle baked in)."""
    from rich.console import Console

    from tmax.sandbox.base import SandboxError
    from tmax.sandbox.base_image import build_base

    console = Console(stderr=True)
    with console.status("building base image ...") as status:
        def progress(line: str) -> None:
            status.update(f"[bold]build-base[/] {line[:150]}")
            if line.startswith(("debootstrap", "podman import", "built", tag)):
                console.log(line)

        try:
            build_base(tag=tag, force=force, mirror=mirror, rootfs=rootfs, progress=progress)
        except SandboxError as e:
            console.print(f"[red]build-base failed:[/] {e}")
            raise typer.Exit(1) from None
    typer.echo(tag)


@sandbox_app.command("clean")
def clean_cmd(
    images: bool = typer.Option(False, "--images", help="Also remove task images tmax built."),
    base: bool = typer.Option(False, "--base", help="With --images, remove the base image too."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Only list what would be removed."),
    all_owners: bool = typer.Option(False, "--all", help="Also remove containers of tmax processes still running."),
) -> None:
    """Remove containers carrying the tmax label (of dead tmax runs unless --all), stale podman
    services and temp dirs."""
    from tmax.sandbox.cleanup import clean

    rep = clean(images=images, include_base=base, dry_run=dry_run, all_owners=all_owners)
    verb = "would remove" if dry_run else "removed"
    for what, items in (("containers", rep.containers), ("images", rep.images),
                        ("podman services", rep.services), ("temp dirs", rep.dirs)):
        typer.echo(f"{verb} {len(items)} {what}" + (f": {', '.join(items)}" if items else ""))
    for e in rep.errors:
        typer.echo(f"error: {e}", err=True)
    if rep.errors:
        raise typer.Exit(1)


def _labels_option(items: list[str]) -> dict[str, str]:
    from tmax.tasks.task_images import parse_labels

    try:
        return parse_labels(items)
    except ValueError as e:
        raise typer.BadParameter(f"--label {e}") from None


@sandbox_app.command("prune")
def prune_cmd(
    keep_gb: float = typer.Option(0.0, "--keep-gb", min=0, help="Keep at most this many GB of task images."),
    label: list[str] = typer.Option([], "--label", help="Only images with this label (KEY=VALUE; repeatable)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Only list what would be removed."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document on stdout."),
) -> None:
    """Remove task images tmax built, least recently used first, down to --keep-gb (the
    base image and images pulled from a registry are never removed)."""
    import json

    from tmax.tasks.task_images import ImageBuildError, prune_images

    try:
        rep = prune_images(int(keep_gb * 1e9), _labels_option(label), dry_run=dry_run)
    except ImageBuildError as e:
        fail(str(e), 1)
    gb = lambda imgs: round(sum(i.size for i in imgs) / 1e9, 3)  # noqa: E731
    data = {"dry_run": dry_run, "removed": [i.names[0] for i in rep.removed], "removed_gb": gb(rep.removed),
            "kept": [i.names[0] for i in rep.kept], "kept_gb": gb(rep.kept), "errors": rep.errors}
    if as_json:
        typer.echo(json.dumps(data, indent=2))
    else:
        verb = "would remove" if dry_run else "removed"
        typer.echo(f"{verb} {len(rep.removed)} image(s), {data['removed_gb']} GB; kept {len(rep.kept)}, "
                   f"{data['kept_gb']} GB")
        for name in data["removed"]:
            typer.echo(f"  {name}")
    for e in rep.errors:
        typer.echo(f"error: {e}", err=True)
    if rep.errors:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.add_typer(sandbox_app, name="sandbox")
