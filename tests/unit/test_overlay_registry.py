"""Which host directories the overlay registry forgets: only those whose helper is gone (no
podman here: a host is its state directory, `host.json` and a real socket)."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

from tmax.sandbox.overlay import HostInfo
from tmax.sandbox.overlay_pool import HostRegistry


def _host_dir(reg: HostRegistry, key: str, name: str) -> Path:
    d = reg.root / key / name
    d.mkdir(parents=True)
    HostInfo(str(d), "c-" + name, name, 2, True, True, "/", time.time()).save()
    return d


def test_a_host_whose_helper_still_listens_keeps_its_directory_after_a_failed_lease(tmp_path):
    """A lease that got no answer (the episode's setup died) is not a host that is gone:
    the helper still listens, and its directory holds its other episodes' sockets and layers.
    One whose socket refuses connections is gone, and its directory goes."""
    reg = HostRegistry(tmp_path / "hosts")
    live, dead = _host_dir(reg, "k", "h-live"), _host_dir(reg, "k", "h-dead")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(live / "ctl.sock"))
    listener.listen(8)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as gone:
        gone.bind(str(dead / "ctl.sock"))  # a socket file nobody listens on: a killed helper's

    def hang_up_on_each() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.close()

    threading.Thread(target=hang_up_on_each, daemon=True).start()
    try:
        assert reg.lease("k") is None  # neither host gave an episode
        assert (live / "ctl.sock").exists() and (live / "host.json").exists()
        assert not dead.exists()
    finally:
        listener.close()
