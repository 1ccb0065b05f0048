"""The config watcher against a single-file bind mount, a file no watch event reaches, and a
writer that pauses mid-file.

`docker-compose.gpu.yml` mounts ./deploy/kvgate.compose.toml at /etc/kvgate/config.toml and the
Dockerfile's example does the same with -v: one file, bind-mounted. An edit of it in place, on the
host or in the container, is reported by inotify to the directory it was opened through (the
host's) and to the file's own watch, never to /etc/kvgate's. A watch of the directory alone
never saw it: a removed API key kept working until a SIGHUP or a restart. The mount is made for
real, in a private mount namespace (`unshare -m`, root), so nothing outside the test sees it.

A rewrite in place that pauses mid-file leaves a prefix that is often valid TOML: a tenant without
its `isolate_cache`, `models` allowlist or limits. Read 0.2 s apart, that prefix was applied live.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from gateway import config_watcher
from gateway.config import Settings, load_settings
from gateway.config_watcher import ConfigWatcher
from tests.support.polling import until as _until

REPO = Path(__file__).resolve().parents[2]


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


# Runs inside `unshare -m --propagation private` (argv: a scratch directory, the scenario, and
# "watch" to take the stat poll out so that only the inotify watch can apply an edit). It makes
# the bind mounts, watches the container side, edits the host side in place, and prints what
# was applied as JSON on its last line.
_IN_NAMESPACE = r"""
import asyncio, hashlib, json, os, subprocess, sys
from pathlib import Path

from gateway import config_watcher
from gateway.config import load_settings
from gateway.config_watcher import ConfigWatcher

root, scenario, only = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
if only == "watch":
    config_watcher._POLL_S = 3600.0


def sha(key):
    return hashlib.sha256(key.encode()).hexdigest()


def cfg(keys, rpm):
    hashes = ", ".join(f'"{sha(k)}"' for k in keys)
    return f'[logging]\nlevel = "warning"\n[tenants.acme]\nkeys_sha256 = [{hashes}]\nrpm = {rpm}\n'


def edit_in_place(path, text):
    # What `cat > file`, or an editor that writes in place (vim's backupcopy=yes), does: the
    # same inode, truncated and written (a bind mount keeps its inode: a rename would not show).
    with open(path, "r+") as f:
        f.write(text)
        f.truncate()


def bind(source, mountpoint):
    if os.environ.get("KVGATE_TEST_HARD_LINKS"):
        # No mount namespace to be had (see `_in_private_mount_namespace`): a hard link in
        # another directory is the same case for inotify, one inode reached through a directory
        # that is not the one watched; only a watch of the file itself sees its edits.
        os.link(source, mountpoint)
        return
    mountpoint.touch()
    subprocess.run(["mount", "--bind", str(source), str(mountpoint)], check=True)


async def until(cond, seconds=15.0):
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while loop.time() < end and not cond():
        await asyncio.sleep(0.05)
    return cond()


async def main():
    host, ctr, mnt = root / "host", root / "etc-kvgate", root / "mnt"
    for d in (host, ctr, mnt):
        d.mkdir()
    (host / "a.toml").write_text(cfg(["k1", "k2"], 100))
    (host / "b.toml").write_text(cfg(["k1"], 300))
    path = ctr / "config.toml"
    if scenario == "file-mount":  # -v ./deploy/kvgate.compose.toml:/etc/kvgate/config.toml
        bind(host / "a.toml", path)
    else:  # config.toml -> a bind-mounted file, the link then swapped to another one
        bind(host / "a.toml", mnt / "a.toml")
        bind(host / "b.toml", mnt / "b.toml")
        path.symlink_to(mnt / "a.toml")
    assert os.stat(path).st_ino == os.stat(host / "a.toml").st_ino, "the bind mount is not there"
    applied = []
    errors = []
    w = ConfigWatcher(
        path,
        load_settings(path),
        lambda s: applied.append([len(s.tenants["acme"].keys_sha256), s.tenants["acme"].rpm]),
        errors.append,
    )
    await w.start()
    steps = []
    try:
        await asyncio.sleep(0.5)  # the watch is set up
        edit_in_place(host / "a.toml", cfg(["k1"], 100))  # k2 revoked on the host
        steps.append(await until(lambda: [1, 100] in applied))
        if scenario == "file-mount":
            edit_in_place(path, cfg(["k1"], 50))  # through the container's path
            steps.append(await until(lambda: [1, 50] in applied))
            edit_in_place(host / "a.toml", cfg(["k1"], 20))  # and the host's again
            steps.append(await until(lambda: [1, 20] in applied))
        else:
            (ctr / "next").symlink_to(mnt / "b.toml")
            os.replace(ctr / "next", path)
            steps.append(await until(lambda: [1, 300] in applied))
            edit_in_place(host / "b.toml", cfg(["k1"], 30))  # the new target, on the host
            steps.append(await until(lambda: [1, 30] in applied))
            # Again, well after the swap: the edit above may have been read by the catch-up
            # that follows a watch set up anew; this one only a watch of b.toml sees.
            edit_in_place(host / "b.toml", cfg(["k1"], 31))
            steps.append(await until(lambda: [1, 31] in applied))
    finally:
        await w.stop()
    print(json.dumps({"steps": steps, "applied": applied, "errors": errors}))


asyncio.run(main())
"""


def _in_private_mount_namespace(tmp_path: Path, scenario: str, only: str) -> dict[str, object]:
    """Run `_IN_NAMESPACE` as root in a mount namespace of its own, with real bind mounts. Where
    no such namespace can be made (not root, no unshare(1), a container without the privilege)
    the same scenario runs with hard links in place of the mounts: for inotify the same case
    (an inode edited through a directory nobody watches), so the test never skips."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, "-c", _IN_NAMESPACE, str(tmp_path), scenario, only]
    unshare = shutil.which("unshare")
    done = None
    if os.geteuid() == 0 and unshare is not None:
        done = subprocess.run(
            [unshare, "-m", "--propagation", "private", *cmd],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0:
            # No namespace, or no mount in it (refused in a container, however worded): the
            # hard links below run the same watcher through the same case. A watcher that
            # fails there fails the test all the same.
            done = None
    if done is None:
        for d in tmp_path.iterdir():  # what a refused try may have left
            shutil.rmtree(d)
        done = subprocess.run(
            cmd,
            cwd=REPO,
            env={**env, "KVGATE_TEST_HARD_LINKS": "1"},
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 0, f"rc {done.returncode}\n{done.stdout}\n{done.stderr}"
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize("only", ["watch", "watch+poll"])
def test_an_edit_in_place_of_a_single_file_bind_mount_is_applied(tmp_path: Path, only: str) -> None:
    # `only="watch"`: the poll fallback is off, so the file's own inotify watch alone must see
    # the edit; the default setup (both) must apply it too.
    r = _in_private_mount_namespace(tmp_path, "file-mount", only)
    assert r["steps"] == [True, True, True], r
    assert r["applied"] == [[1, 100], [1, 50], [1, 20]], r
    assert r["errors"] == [], r


def test_a_link_swapped_to_another_bind_mounted_file_follows_that_file(tmp_path: Path) -> None:
    # The file watch stays on the inode it was set on: when the path leads to another file, it
    # must be set up on that one (here only the file watch sees edits of either).
    r = _in_private_mount_namespace(tmp_path, "link-swap", "watch")
    assert r["steps"] == [True, True, True, True], r
    assert r["applied"] == [[1, 100], [1, 300], [1, 30], [1, 31]], r
    assert r["errors"] == [], r


async def _deaf_awatch(
    *_paths: object, stop_event: asyncio.Event | None = None, **_kw: object
) -> AsyncIterator[set[tuple[object, str]]]:
    """A watch that sets up fine and never reports anything: a network file system, or file
    sharing that does not pass inotify events into the container."""
    await (stop_event or asyncio.Event()).wait()
    return
    yield set()  # an async generator, as `watchfiles.awatch` is


async def test_an_edit_no_watch_reports_is_applied_by_the_poll(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import watchfiles

    monkeypatch.setattr(watchfiles, "awatch", _deaf_awatch)
    cfg = tmp_path / "kvgate.toml"
    cfg.write_text(f'[tenants.acme]\nkeys_sha256 = ["{_sha("k1")}", "{_sha("k2")}"]\n')
    applied: list[Settings] = []
    errors: list[str] = []
    w = ConfigWatcher(cfg, load_settings(cfg), applied.append, errors.append)
    await w.start()
    try:
        await asyncio.sleep(0.5)
        with cfg.open("r+") as f:  # k2 revoked, in place
            f.write(f'[tenants.acme]\nkeys_sha256 = ["{_sha("k1")}"]\n')
            f.truncate()
        assert await _until(lambda: bool(applied)), "an edit no event reported was never applied"
        cfg.write_text(f'[tenants.acme]\nkeys_sha256 = ["{_sha("k1")}"]\nrpm = 5\n')
        assert await _until(lambda: len(applied) >= 2)
    finally:
        await w.stop()
    assert [(len(s.tenants["acme"].keys_sha256), s.tenants["acme"].rpm) for s in applied] == [
        (1, None),
        (1, 5),
    ]
    assert errors == []


HEAD = f'[logging]\nlevel = "warning"\n[tenants.acme]\nkeys_sha256 = ["{_sha("k-acme")}"]\n'
TAIL = 'isolate_cache = true\nmodels = ["small"]\nrpm = {rpm}\nmax_output_tokens = 64\n'


async def test_a_writer_pausing_mid_file_never_gets_its_prefix_applied(tmp_path: Path) -> None:
    # The prefix (the tenant's key, nothing after it) is valid TOML and passes every reload
    # check: only waiting out the pause keeps it from being applied. The writer is a thread, so
    # that its pause is the one intended however slow this test's event loop runs.
    cfg = tmp_path / "kvgate.toml"
    cfg.write_text(HEAD + TAIL.format(rpm=10))
    applied: list[Settings] = []
    w = ConfigWatcher(cfg, load_settings(cfg), applied.append, lambda _m: None)

    def rewrite() -> None:
        with cfg.open("w") as f:  # rewrite in place: truncate, write, pause, write
            f.write(HEAD)
            f.flush()
            time.sleep(0.45)  # a templating step, a network copy; under the settle window
            f.write(TAIL.format(rpm=20))

    await w.start()
    try:
        await asyncio.sleep(0.5)
        await asyncio.to_thread(rewrite)
        assert await _until(lambda: any(s.tenants["acme"].rpm == 20 for s in applied))
    finally:
        await w.stop()
    seen = [
        (t.isolate_cache, t.models, t.rpm, t.max_output_tokens)
        for t in (s.tenants["acme"] for s in applied)
    ]
    assert seen == [(True, ["small"], 20, 64)], f"applied, in order: {seen}"


async def test_a_file_that_keeps_changing_is_applied_once_it_stops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A writer that never lets the file settle must not wedge the watch: the settle gives up
    # after a bound, applies nothing of what it saw, and the change after is applied once the
    # file stops changing.
    monkeypatch.setattr(config_watcher, "_SETTLE_S", 0.3)
    monkeypatch.setattr(config_watcher, "_SETTLE_TRIES", 2, raising=False)
    cfg = tmp_path / "kvgate.toml"
    cfg.write_text(HEAD + TAIL.format(rpm=1))
    applied: list[Settings] = []
    w = ConfigWatcher(cfg, load_settings(cfg), applied.append, lambda _m: None)
    stop = threading.Event()

    def churn() -> None:
        rpm = 2
        while not stop.is_set():
            with cfg.open("w") as f:  # never the same bytes twice 0.3 s apart
                f.write(HEAD + TAIL.format(rpm=rpm))
            rpm += 1
            time.sleep(0.05)
        cfg.write_text(HEAD + TAIL.format(rpm=999))

    await w.start()
    try:
        await asyncio.sleep(0.5)
        writer = asyncio.create_task(asyncio.to_thread(churn))
        await asyncio.sleep(2.5)  # several bounded settles given up
        stop.set()
        await writer
        assert await _until(lambda: any(s.tenants["acme"].rpm == 999 for s in applied))
    finally:
        stop.set()
        await w.stop()
    assert [s.tenants["acme"].rpm for s in applied] == [999]
