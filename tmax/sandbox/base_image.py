"""The offline base image `localhost/tmax-base:bookworm`.

There is no Docker Hub on these machines, only Debian and PyPI mirrors, so the base
image is built from scratch: debootstrap a minimal bookworm rootfs, bake the host's CA
bundle into it (the mirrors may sit behind a TLS-inspecting proxy, so pip and curl inside
the sandbox need the host's trust roots), then `podman import` the tree with a WORKDIR,
CMD and PATH, which a bare import does not set.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from tmax.sandbox.base import LABEL_VALUE, SandboxError

DEFAULT_BASE_TAG = "localhost/tmax-base:bookworm"  # declared here only; the rest import it
# The base of generated tasks: the base plus python3 (tasks/data/image_map.toml builds it).
PYTHON_BASE_TAG = f"{DEFAULT_BASE_TAG}-python"
DEFAULT_SUITE = "bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
# The base image is labelled apart from task images, so `tmax sandbox clean --images`
# keeps it unless asked.
BASE_LABEL_KEY = "io.tmax.base"
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

Progress = Callable[[str], None]


def image_exists(tag: str) -> bool:
    from tmax.sandbox import podman_service

    with podman_service.client() as client:
        return client.images.exists(tag)


def _run(argv: list[str], progress: Progress, what: str, **kw) -> None:
    """Run a build step, streaming its lines to `progress`; a failure is a SandboxError."""
    progress(what)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", **kw)
    tail: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip()
        if line:
            tail = (tail + [line])[-20:]
            progress(line)
    if proc.wait() != 0:
        raise SandboxError(f"{what} failed (exit {proc.returncode}):\n" + "\n".join(tail))


def debootstrap(rootfs: Path, suite: str = DEFAULT_SUITE, mirror: str = DEFAULT_MIRROR,
                progress: Progress = lambda s: None) -> None:
    if shutil.which("debootstrap") is None:
        raise SandboxError("debootstrap is not installed (apt-get install debootstrap)")
    if os.geteuid() != 0:
        raise SandboxError("debootstrap needs root to build the base image")
    rootfs.mkdir(parents=True, exist_ok=True)
    _run(["debootstrap", "--variant=minbase", suite, str(rootfs), mirror], progress,
         f"debootstrap --variant=minbase {suite}")


def prepare_rootfs(rootfs: Path, ca_bundle: Path = HOST_CA_BUNDLE) -> None:
    """Make a debootstrapped tree ready to import: trust roots, clean apt caches."""
    if not (rootfs / "bin" / "bash").exists() and not (rootfs / "usr" / "bin" / "bash").exists():
        raise SandboxError(f"{rootfs} does not look like a Debian rootfs (no bash)")
    if ca_bundle.exists():
        dst = rootfs / "etc" / "ssl" / "certs" / "ca-certificates.crt"
        dst.parent.mkdir(parents=True, exist_ok=True)
        # The file must be a real file inside the image, not a link to the host.
        if dst.is_symlink():
            dst.unlink()
        shutil.copyfile(ca_bundle, dst)
    # Cached .debs only make the image bigger.
    for d in (rootfs / "var" / "cache" / "apt" / "archives").glob("*.deb"):
        d.unlink()


def import_rootfs(rootfs: Path, tag: str = DEFAULT_BASE_TAG, workdir: str = "/root",
                  progress: Progress = lambda s: None) -> str:
    """`tar | podman import` the tree as `tag`; returns the image id."""
    ca = "/etc/ssl/certs/ca-certificates.crt"
    changes = [
        f"WORKDIR {workdir}",
        'CMD ["/bin/bash"]',
        f"ENV PATH={BASE_PATH}",
        "ENV LANG=C.UTF-8",
        f"ENV SSL_CERT_FILE={ca}",
        f"ENV REQUESTS_CA_BUNDLE={ca}",
        f"ENV PIP_CERT={ca}",
        f"ENV CURL_CA_BUNDLE={ca}",
        f"LABEL {BASE_LABEL_KEY}={LABEL_VALUE}",
    ]
    progress(f"podman import -> {tag}")
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "--numeric-owner", "-cf", "-", "."],
                           stdout=subprocess.PIPE)
    argv = ["podman", "import"]
    for c in changes:
        argv += ["--change", c]
    argv += ["-", tag]
    imp = subprocess.run(argv, stdin=tar.stdout, capture_output=True, text=True)
    assert tar.stdout is not None
    tar.stdout.close()
    tar_rc = tar.wait()
    if tar_rc != 0 or imp.returncode != 0:
        raise SandboxError(f"podman import of {rootfs} failed (tar {tar_rc}, podman {imp.returncode}): "
                           f"{imp.stderr.strip()[-2000:]}")
    return imp.stdout.strip().splitlines()[-1] if imp.stdout.strip() else tag


def build_base(tag: str = DEFAULT_BASE_TAG, force: bool = False, suite: str = DEFAULT_SUITE,
               mirror: str = DEFAULT_MIRROR, rootfs: Path | None = None,
               progress: Progress = lambda s: None) -> str:
    """Build the base image unless it exists (or `force`). `rootfs` reuses an existing
    debootstrapped tree instead of running debootstrap. Returns the tag."""
    if shutil.which("podman") is None:
        raise SandboxError("podman is not installed")
    if not force and image_exists(tag):
        progress(f"{tag} exists (use --force to rebuild)")
        return tag
    if rootfs is not None:
        prepare_rootfs(rootfs)
        import_rootfs(rootfs, tag, progress=progress)
    else:
        with tempfile.TemporaryDirectory(prefix="tmax-base-") as tmp:
            tree = Path(tmp) / "rootfs"
            debootstrap(tree, suite, mirror, progress)
            prepare_rootfs(tree)
            import_rootfs(tree, tag, progress=progress)
    # The CLI, as for the import: building the base image is the podman binary's work (`sandbox.podman_service`).
    r = subprocess.run(["podman", "run", "--rm", "--runtime", "runc", "--network", "none", tag,
                        "bash", "-c", "test -s /etc/ssl/certs/ca-certificates.crt && echo ok"],
                       capture_output=True, text=True)
    if r.stdout.strip() != "ok":
        raise SandboxError(f"built {tag} but a smoke run failed: {r.stderr.strip()[-1000:]}")
    progress(f"built {tag}")
    return tag
