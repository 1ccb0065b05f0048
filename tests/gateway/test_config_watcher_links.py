"""The config watcher against a config that is a link to a file elsewhere, and against changes made
while no watch was in place.

A link's target can go away and come back (`rm` + `cp`), its directory be made again (`rm -rf` +
`mkdir` by a deploy tool), or sit in a subdirectory of the link's own (`config.toml ->
releases/kvgate.toml`), which a non-recursive watch of that directory does not see into. And
when the watch moves (a directory link swapped), an edit made while the reload that moved it was
being applied has no watch to tell of it: the file is read again once the new one is set up.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from gateway.config import Settings, load_settings
from gateway.config_watcher import ConfigWatcher
from tests.support.polling import until as _until


def _cfg(port: int) -> str:
    return (
        f'[logging]\nlevel = "warning"\n[[workers]]\nname = "w"\nurl = "http://127.0.0.1:{port}"\n'
    )


def _port(w: ConfigWatcher) -> int:
    return int(w.current.workers[0].url.rsplit(":", 1)[1])


@contextlib.asynccontextmanager
async def _watching(
    cfg: Path, on_change: Callable[[Settings], None] | None = None
) -> AsyncIterator[tuple[list[str], ConfigWatcher]]:
    """A started watcher on ``cfg`` (its watch set up) and the errors it reported."""
    errors: list[str] = []
    w = ConfigWatcher(cfg, load_settings(cfg), on_change or (lambda _s: None), errors.append)
    await w.start()
    try:
        await asyncio.sleep(0.5)  # the watch is set up
        yield errors, w
    finally:
        await w.stop()


def _link_elsewhere(tmp_path: Path) -> tuple[Path, Path]:
    """run/config.toml -> etc/real.toml; returns (the link, the target)."""
    (tmp_path / "etc").mkdir()
    (tmp_path / "run").mkdir()
    real = tmp_path / "etc" / "real.toml"
    real.write_text(_cfg(9001), encoding="utf-8")
    cfg = tmp_path / "run" / "config.toml"
    cfg.symlink_to(real)
    return cfg, real


async def test_a_link_target_deleted_and_written_again_is_applied(tmp_path: Path) -> None:
    # With the target gone the watch was set up again without the target's directory (resolved
    # strictly, it was "no target"), and its return was never seen.
    cfg, real = _link_elsewhere(tmp_path)
    async with _watching(cfg) as (errors, w):
        real.unlink()
        assert await _until(lambda: any("file not found" in e for e in errors)), errors
        real.write_text(_cfg(9002), encoding="utf-8")
        assert await _until(lambda: _port(w) == 9002), "the re-created target was not applied"
        real.write_text(_cfg(9003), encoding="utf-8")
        assert await _until(lambda: _port(w) == 9003), "an edit after it was not applied"


async def test_a_link_targets_directory_made_again_is_watched_again(tmp_path: Path) -> None:
    # The watch stayed on the deleted directory's inode; the layout (paths only, and ext4 gives
    # the new directory the inode just freed) compared equal, so it was never set up again.
    cfg, real = _link_elsewhere(tmp_path)
    async with _watching(cfg) as (_errors, w):
        shutil.rmtree(real.parent)
        real.parent.mkdir()
        real.write_text(_cfg(9002), encoding="utf-8")
        assert await _until(lambda: _port(w) == 9002), "the re-created directory was not applied"
        for port in (9003, 9004):
            real.write_text(_cfg(port), encoding="utf-8")
            assert await _until(lambda port=port: _port(w) == port), f"edit to {port} missed"


async def test_a_link_into_a_subdirectory_follows_edits_of_its_target(tmp_path: Path) -> None:
    # config.toml -> releases/kvgate.toml counted as "inside the directory, followed by name"
    # (like a ConfigMap's ..data), but the directory's watch does not see into releases/.
    conf = tmp_path / "kvgate"
    (conf / "releases").mkdir(parents=True)
    real = conf / "releases" / "kvgate.toml"
    real.write_text(_cfg(9001), encoding="utf-8")
    (conf / "config.toml").symlink_to(Path("releases") / "kvgate.toml")
    async with _watching(conf / "config.toml") as (_errors, w):
        real.write_text(_cfg(9002), encoding="utf-8")
        assert await _until(lambda: _port(w) == 9002), "the edit in releases/ was not applied"


def _swap(link: Path, to: Path) -> None:
    """`ln -sfn to link`: a new link renamed over the old one."""
    tmp = link.with_name(link.name + ".tmp")
    tmp.symlink_to(to)
    os.replace(tmp, link)


async def test_an_edit_made_while_a_swap_is_applied_is_applied_after_it(tmp_path: Path) -> None:
    # /etc/kvgate -> v1 is swapped to v2; while that config is applied (Gateway.apply loads
    # tokenizers and syncs the fleet, synchronously) v2/config.toml is edited. Nothing watched
    # v2 yet, and the watch set up on it after the apply read nothing: the edit was lost.
    for v in (1, 2):
        (tmp_path / f"v{v}").mkdir()
        (tmp_path / f"v{v}" / "config.toml").write_text(_cfg(9000 + v), encoding="utf-8")
    _swap(tmp_path / "conf", tmp_path / "v1")
    applied: list[int] = []

    def on_change(s: Settings) -> None:
        applied.append(int(s.workers[0].url.rsplit(":", 1)[1]))
        if applied == [9002]:  # the edit, made during the apply of the swap
            (tmp_path / "v2" / "config.toml").write_text(_cfg(9003), encoding="utf-8")

    async with _watching(tmp_path / "conf" / "config.toml", on_change) as (errors, w):
        _swap(tmp_path / "conf", tmp_path / "v2")
        assert await _until(lambda: _port(w) == 9003), f"applied: {applied}"
    assert applied == [9002, 9003] and errors == []


async def test_a_rejected_file_is_not_reported_again_when_the_watch_moves(tmp_path: Path) -> None:
    # The read after a re-watch skips a file holding the bytes the last reload judged: an
    # invalid one is reported (and counted) once, not once more per watch set up.
    for v, text in ((1, _cfg(9001)), (2, "[server]\nport = -1\n"), (3, _cfg(9003))):
        (tmp_path / f"v{v}").mkdir()
        (tmp_path / f"v{v}" / "config.toml").write_text(text, encoding="utf-8")
    _swap(tmp_path / "conf", tmp_path / "v1")
    async with _watching(tmp_path / "conf" / "config.toml") as (errors, w):
        caught_up: list[bool] = []
        check = w._reload_if_changed

        def spy(force: bool) -> None:
            check(force)
            caught_up.append(force)

        w._reload_if_changed = spy  # type: ignore[method-assign]
        _swap(tmp_path / "conf", tmp_path / "v2")
        assert await _until(lambda: bool(caught_up)), "no read after the watch moved"
        assert errors and len(errors) == 1, errors
        # A good file then applies as ever.
        _swap(tmp_path / "conf", tmp_path / "v3")
        assert await _until(lambda: _port(w) == 9003)
    assert len(errors) == 1, errors
