"""Whether a Ray actor died: `actor_died`, whether an error is the death of given actors,
and `group_member_died`, the death of a group's member behind an error of any of them.

Below both the cluster's actors and the weight sync, which each tell a dead actor (Ray
restarts it, or the run stops) from any other failure. Ray is imported in the functions."""

from __future__ import annotations

from typing import Any

# How long each member of a group gets to answer whether it is alive after a collective
# failed in one of them (Ray notices a dead actor's process within seconds).
PEER_PROBE_S = 30.0


def actor_died(e: BaseException, actors: list[Any]) -> bool:
    """Whether `e` is the death of one of `actors` (a call on it, or on a result it made)."""
    import ray

    return isinstance(e, ray.exceptions.RayActorError) and e.actor_id in {a._actor_id.hex() for a in actors}


def group_member_died(e: BaseException, group: list[Any], probe_s: float = PEER_PROBE_S) -> BaseException | None:
    """The death of one of `group` (actors that run collectives together, the learner
    ranks) behind `e`, or None. Either `e` is that death, or `e` came from a call on a
    survivor whose collective failed because a peer went away (gloo: "Connection closed
    by peer"), which may reach the caller first: each member is then asked whether it is
    alive, and the dead one's error is returned."""
    import ray

    if actor_died(e, group):
        return e
    if not isinstance(e, ray.exceptions.RayError):
        return None
    for actor in group:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=probe_s)
        except ray.exceptions.RayActorError as died:
            return died
        except ray.exceptions.RayError:
            continue  # busy past the probe, or not answering for another reason: not known dead
    return None
