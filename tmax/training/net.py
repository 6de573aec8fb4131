"""Network addresses of this host: a free TCP port, and the IP other nodes reach it on.

Used by the vLLM server (`training.inference.serving`), the learners' process group
(`training.learner.parallel`), the weight group and the Ray head a Slurm job starts
(`training.cluster.launch`), and the Ray node an actor runs on. No torch; Ray only for
`ray_node_id`.
"""

from __future__ import annotations

import socket


def free_port(host: str = "") -> int:
    """A TCP port nothing listens on now (on every interface when `host` is empty)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def node_ip() -> str:
    """This host's address as other nodes see it: Ray's view when Ray is running, else
    the source address of the default route (what a UDP "connect" would use)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("10.255.255.255", 1))  # no packet is sent
        return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())
    finally:
        s.close()


def ray_node_id() -> str:
    """The id of the Ray node this process runs on (an actor's answer to where it was placed)."""
    import ray

    return ray.get_runtime_context().get_node_id()
