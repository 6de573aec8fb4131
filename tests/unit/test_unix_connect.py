"""`overlay_proto.connect_unix`: a socket path longer than sockaddr_un holds (108 bytes) is
still reached; a missing one fails as a short one does."""

from __future__ import annotations

import os
import socket

import pytest

from tmax.sandbox.overlay_proto import connect_unix


def _listen_at(path: str) -> socket.socket:
    """A listener at `path` of any length (bound through its directory's fd, as the helper
    binds inside its container under a short path)."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dir_fd = os.open(os.path.dirname(path), os.O_PATH | os.O_DIRECTORY)
    try:
        server.bind(f"/proc/self/fd/{dir_fd}/{os.path.basename(path)}")
    finally:
        os.close(dir_fd)
    server.listen(1)
    return server


@pytest.mark.parametrize("depth", [0, 3])
def test_a_socket_is_reached_whatever_its_path_length(tmp_path, depth):
    where = tmp_path.joinpath(*["x" * 50] * depth)
    where.mkdir(parents=True, exist_ok=True)
    path = str(where / "ctl.sock")
    assert (len(path) > 108) == (depth > 0)
    server = _listen_at(path)
    with server, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        connect_unix(client, path)
        conn, _ = server.accept()
        with conn:
            client.sendall(b"hello")
            assert conn.recv(5) == b"hello"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client, pytest.raises(FileNotFoundError):
        connect_unix(client, str(where / "gone.sock"))
    if depth:  # what connect_unix is for: a plain connect refuses the path
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as plain, pytest.raises(OSError, match="too long"):
            plain.connect(path)
