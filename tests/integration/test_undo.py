"""Undo of shell changes: snapshots of the workspace (local, bwrap) and of the container
(podman), through the store and through `/undo` in a real `tmax run` pty session."""

from __future__ import annotations

import pytest
from scripted_server import ScriptedServer
from test_cli_run import FOLLOW_UP, SUBMIT, env, run_args, spawn, user_texts, ws  # noqa: F401  (fixtures)

from tmax.sandbox.snapshot import UndoHistory
from tmax.sandbox.watched import WatchedSnapshots
from tmax.cli.run_settings import bwrap_works
from tmax.cli.run_undo import undo_count


def test_directory_snapshots_restore_deleted_changed_and_added(tmp_path):
    root = tmp_path / "ws"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "a.txt").write_text("v0")
    history = UndoHistory(WatchedSnapshots(root), keep=2)
    try:
        history.before("edit a")
        with open(root / "sub" / "a.txt", "a") as f:  # an in-place write
            f.write("+v1")
        history.before("rm a, add b")
        (root / "sub" / "a.txt").unlink()
        (root / "b").mkdir()
        history.before("third")  # only the last two snapshots are kept
        assert history.available == 2
        with pytest.raises(ValueError, match="only 2 command"):
            history.undo(3)
        undone = history.undo(2)
        assert undone.commands == ["rm a, add b", "third"]
        assert (undone.restored.recreated, undone.restored.removed) == ([f"{root}/sub/a.txt"], [f"{root}/b"])
        assert (root / "sub" / "a.txt").read_text() == "v0+v1"
        assert not (root / "b").exists()
        assert history.available == 0
    finally:
        history.close()
    assert not history.store.store.exists()


def test_a_snapshot_copies_only_what_changed_and_in_place_writes_come_back(tmp_path):
    root = tmp_path / "ws"
    (root / "deep" / "er").mkdir(parents=True)
    for i in range(50):
        (root / "deep" / "er" / f"f{i}.bin").write_bytes(b"0" * 4096)
    store = WatchedSnapshots(root)
    history = UndoHistory(store, keep=3)
    try:
        history.before("step 0")
        with open(root / "deep" / "er" / "f7.bin", "r+b") as f:  # in place: same inode, same size
            f.write(b"1")
        (root / "deep" / "er" / "f8.bin").rename(root / "moved.bin")
        (root / "new" / "sub").mkdir(parents=True)
        (root / "new" / "sub" / "n.txt").write_text("n")
        history.before("step 1")
        # Only the changed paths were logged: the pre-images of step 0 hold two files, not fifty.
        logged = [p for p in store.entries[0].dir.rglob("*") if p.is_file()]
        assert sorted(p.name for p in logged) == ["f7.bin", "f8.bin"]
        assert store.entries[0].was == {"deep/er/f7.bin": "file", "deep/er/f8.bin": "file", "moved.bin": "absent",
                                        "new": "absent"}
        undone = history.undo(2)
        assert (root / "deep" / "er" / "f7.bin").read_bytes() == b"0" * 4096
        assert (root / "deep" / "er" / "f8.bin").exists() and not (root / "moved.bin").exists()
        assert not (root / "new").exists()
        assert undone.restored.removed == [f"{root}/moved.bin", f"{root}/new"]
        assert undone.restored.changed == [f"{root}/deep/er/f7.bin"]
        assert undone.restored.recreated == [f"{root}/deep/er/f8.bin"]
        # After the undo the log goes on from the restored state.
        history.before("step 2")
        (root / "deep" / "er" / "f1.bin").unlink()
        history.undo(1)
        assert (root / "deep" / "er" / "f1.bin").read_bytes() == b"0" * 4096
    finally:
        history.close()


def test_inotify_overflow_falls_back_to_comparing(tmp_path):
    root = tmp_path / "ws"
    root.mkdir()
    (root / "a.txt").write_text("a")
    store = WatchedSnapshots(root)
    history = UndoHistory(store, keep=2)
    try:
        history.before("x")
        (root / "a.txt").write_text("changed")
        (root / "b.txt").write_text("b")
        store._changed()  # events lost, as after a queue overflow
        store._blind = True
        history.before("y")
        assert history.undo(2).restored.removed == [f"{root}/b.txt"]
        assert (root / "a.txt").read_text() == "a" and not (root / "b.txt").exists()
    finally:
        history.close()


def test_undo_count_parsing():
    assert undo_count("/undo") == 1 and undo_count(" /undo 3 ") == 3
    for bad in ("/undo 0", "/undo x", "/undo 1 2"):
        with pytest.raises(ValueError, match="usage"):
            undo_count(bad)


def _undo_session(kind: str, script: list[dict], ws, tmp_path, spawn, env, destroy: str) -> str:  # noqa: F811
    """Run the script's commands, `/undo 2` (submit + `destroy`), then one check command;
    returns the check's observation. The model must have been told what was undone."""
    extra = ["--env", kind, "--mode", "yolo", "--undo-steps", "3"]
    with ScriptedServer(script) as srv:
        if kind == "podman":
            args = ["--base-url", srv.base_url, "--model", srv.model, "-o", str(tmp_path / "run"), *extra, "go"]
        else:
            args = run_args(srv, ws, tmp_path / "run", *extra)
        t = spawn(args, env, ws, timeout=120 if kind == "podman" else 30)
        t.answer(FOLLOW_UP, "/undo 2")
        t.expect("undid your last 2 commands")
        t.answer(FOLLOW_UP, "check the files")
        t.answer(FOLLOW_UP, "")
        assert t.finish() == 0
        requests = srv.requests
    follow_up = len(script) - 2  # the request that carries the follow-up
    told = user_texts(requests[follow_up])[-1]
    assert told.startswith("[The user undid your last 2 commands") and told.endswith("check the files")
    assert f"1. {destroy}\n2. {SUBMIT}" in told
    return [m["content"] for m in requests[follow_up + 1]["messages"] if m["role"] == "tool"][-1], told


@pytest.mark.bwrap
@pytest.mark.skipif(not bwrap_works(), reason="bubblewrap cannot run here")
@pytest.mark.parametrize("kind", ["bwrap", "local"])
def test_undo_in_a_pty_session_restores_the_workspace(kind, env, ws, tmp_path, spawn):  # noqa: F811
    """The model is told exactly which paths came back and what the undo could not reach: in
    bwrap it used to hear that everything was gone while /tmp and $HOME kept their files."""
    (ws / "keep.txt").write_text("v1\n")
    (ws / "del.txt").write_text("gone\n")
    outside = "/tmp/o.txt ~/h.txt" if kind == "bwrap" else str(tmp_path / "outside.txt")
    destroy = f"mkdir -p sub && cd sub && rm ../del.txt && echo v2 > ../keep.txt && touch new.txt && tee {outside} </dev/null"
    script = [{"bash": destroy}, {"bash": SUBMIT}, {"bash": f"pwd; cat keep.txt del.txt; ls -1; ls {outside}"}, {"bash": SUBMIT}]
    seen, told = _undo_session(kind, script, ws, tmp_path, spawn, env, destroy)
    # The shell stood in sub/, which the undo removed: it is back in the workdir.
    assert seen.startswith(f"{ws}\nv1\ngone\ndel.txt\nkeep.txt\n"), seen
    assert (ws / "keep.txt").read_text() == "v1\n" and not (ws / "sub").exists()
    assert f"Put back as they were: {ws}/keep.txt" in told, told
    assert f"Brought back (deleted since): {ws}/del.txt" in told, told
    if kind == "bwrap":
        assert f"Deleted (created since): {ws}/sub, /tmp/o.txt, /root-home/h.txt" in told, told
        assert "No such file" in seen and "/tmp/o.txt" in seen  # gone inside the jail too
    else:
        assert f"Deleted (created since): {ws}/sub\n" in told, told
        assert f"Only files under {ws} are tracked" in told
        assert (tmp_path / "outside.txt").exists()  # not tracked, and the model was told so


@pytest.mark.podman
def test_undo_in_a_pty_session_restores_the_container(env, ws, tmp_path, spawn, base_image):  # noqa: F811
    setup = "echo v1 > /root/keep.txt && echo gone > /root/del.txt"
    destroy = "rm /root/del.txt /etc/issue && echo v2 > /root/keep.txt && echo x >> /etc/debian_version && mkdir /root/new"
    check = "cat /root/keep.txt /root/del.txt; ls -d /root/new; test -f /etc/issue && echo issue-back; tail -c 2 /etc/debian_version"
    script = [{"bash": setup}, {"bash": destroy}, {"bash": SUBMIT}, {"bash": check}, {"bash": SUBMIT}]
    seen, told = _undo_session("podman", script, ws, tmp_path, spawn, env, destroy)
    assert seen.startswith("v1\ngone\nls: cannot access '/root/new'"), seen
    assert "issue-back" in seen and "\nx\n" not in seen, seen
    assert "Put back as they were: /etc/debian_version, /root/keep.txt" in told, told
    assert "Deleted (created since): /root/new" in told and "/etc/issue" in told and "/root/del.txt" in told, told
