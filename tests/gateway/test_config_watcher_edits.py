"""The config watcher against the ways files really change: truncate-then-write, writes in
parts, a Kubernetes ConfigMap's symlink swaps, and a config directory that is itself a link
swapped to another directory. A reload must only ever apply a whole file the writer is done
with; anything else keeps the running config (an empty file, valid as a config, would mean no
fleet and no tenants: anonymous requests accepted)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from gateway import config_watcher
from gateway.config import Settings, load_settings
from gateway.config_watcher import ConfigWatcher
from tests.support.polling import until as _until

KEY_HASH = "a" * 64


def _cfg(*ports: int) -> str:
    workers = "".join(
        f'[[workers]]\nname = "w{i}"\nurl = "http://127.0.0.1:{p}"\n' for i, p in enumerate(ports)
    )
    return f'[logging]\nlevel = "warning"\n[tenants.t]\nkeys_sha256 = ["{KEY_HASH}"]\n{workers}'


@pytest.mark.parametrize("text", ["", " \n\t\n", "# kvgate configuration\n\n# [server]\n"])
def test_reload_of_a_file_with_no_settings_keeps_the_running_config(
    tmp_path: Path, text: str, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = tmp_path / "kvgate.toml"
    cfg.write_text(_cfg(9, 10))
    applied: list[Settings] = []
    errors: list[str] = []
    w = ConfigWatcher(cfg, load_settings(cfg), applied.append, errors.append)
    cfg.write_text(text)
    with caplog.at_level(logging.ERROR, logger="kvgate.config"):
        assert not w.reload()  # SIGHUP and POST /admin/reload take this path
    assert applied == []
    assert len(w.current.workers) == 2 and len(w.current.tenants) == 1
    assert errors and "no settings" in errors[0]
    assert "no settings" in caplog.text and "keeping the running config" in caplog.text


def test_reload_of_an_unreadable_path_is_rejected_and_reported(tmp_path: Path) -> None:
    cfg = tmp_path / "kvgate.toml"
    cfg.write_text(_cfg(9))
    errors: list[str] = []
    w = ConfigWatcher(cfg, load_settings(cfg), lambda _s: None, errors.append)
    cfg.unlink()
    cfg.mkdir()  # something the file cannot be read from, whoever runs the test
    assert not w.reload()
    assert errors and str(cfg) in errors[0]
    assert len(w.current.workers) == 1


async def test_truncate_then_write_applies_only_the_written_config(tmp_path: Path) -> None:
    cfg = tmp_path / "kvgate.toml"
    cfg.write_text(_cfg(9, 10))
    applied: list[Settings] = []
    w = ConfigWatcher(cfg, load_settings(cfg), applied.append, lambda _m: None)
    await w.start()
    try:
        await asyncio.sleep(0.5)  # the watch is set up
        with cfg.open("w"):  # truncate ...
            pass
        await asyncio.sleep(0.15)  # ... a writer slower than the watcher's 50 ms of quiet ...
        cfg.write_text(_cfg(9, 11))  # ... then the new content
        landed = await _until(lambda: any(len(s.workers) == 2 for s in applied))
    finally:
        await w.stop()
    seen = [(len(s.workers), len(s.tenants)) for s in applied]
    assert landed and seen == [(2, 1)], f"(workers, tenants) of each applied config: {seen}"


async def test_a_file_written_in_two_parts_is_applied_only_once_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A settle window far longer than the writer's pause, so a slow test machine cannot make the
    # pause look like the end of the write.
    monkeypatch.setattr(config_watcher, "_SETTLE_S", 1.0, raising=False)
    cfg = tmp_path / "kvgate.toml"
    cfg.write_text(_cfg(9, 10))
    applied: list[Settings] = []
    w = ConfigWatcher(cfg, load_settings(cfg), applied.append, lambda _m: None)
    await w.start()
    whole = _cfg(9, 11)
    part = whole[: whole.index('[[workers]]\nname = "w1"')]  # valid TOML: one worker
    try:
        await asyncio.sleep(0.5)
        with cfg.open("w") as f:
            f.write(part)
            f.flush()
            await asyncio.sleep(0.15)
            f.write(whole[len(part) :])
        landed = await _until(lambda: any(len(s.workers) == 2 for s in applied))
    finally:
        await w.stop()
    seen = [[wk.url for wk in s.workers] for s in applied]
    assert landed and seen == [["http://127.0.0.1:9", "http://127.0.0.1:11"]], seen


def _publish(root: Path, version: int, text: str) -> None:
    """What kubelet's AtomicWriter does for a ConfigMap update: a new timestamped directory,
    the `..data` link swapped to it by rename, the old directory deleted."""
    new = root / f"..v{version}"
    new.mkdir()
    (new / "config.toml").write_text(text)
    tmp = root / "..data_tmp"
    tmp.symlink_to(new.name)
    old = os.readlink(root / "..data") if (root / "..data").is_symlink() else None
    os.replace(tmp, root / "..data")
    if old is not None:
        shutil.rmtree(root / old)


async def test_every_configmap_update_is_applied(tmp_path: Path) -> None:
    root = tmp_path / "etc-kvgate"
    root.mkdir()
    _publish(root, 1, _cfg(9001))
    (root / "config.toml").symlink_to("..data/config.toml")
    cfg = root / "config.toml"
    applied: list[Settings] = []
    w = ConfigWatcher(cfg, load_settings(cfg), applied.append, lambda _m: None)
    await w.start()
    try:
        await asyncio.sleep(0.5)
        for version in (2, 3, 4):
            _publish(root, version, _cfg(9000 + version))
            url = f"http://127.0.0.1:{9000 + version}"
            if not await _until(lambda url=url: any(s.workers[0].url == url for s in applied)):
                break  # the rest would not be seen either
    finally:
        await w.stop()
    urls = [s.workers[0].url for s in applied]
    assert urls == [f"http://127.0.0.1:{p}" for p in (9002, 9003, 9004)], urls


async def test_a_link_to_a_file_elsewhere_follows_edits_of_that_file(tmp_path: Path) -> None:
    # config.toml -> /etc/kvgate/real.toml: the target is edited in place, in a directory the
    # link's own does not contain. Watching only the link's directory missed every such edit.
    (tmp_path / "etc").mkdir()
    (tmp_path / "run").mkdir()
    real = tmp_path / "etc" / "real.toml"
    real.write_text(_cfg(9001), encoding="utf-8")
    cfg = tmp_path / "run" / "config.toml"
    cfg.symlink_to(real)
    applied: list[Settings] = []
    w = ConfigWatcher(cfg, load_settings(cfg), applied.append, lambda _m: None)
    await w.start()
    try:
        await asyncio.sleep(0.5)
        real.write_text(_cfg(9002), encoding="utf-8")
        assert await _until(lambda: any(s.workers[0].url.endswith(":9002") for s in applied))
        # ... and after the link is pointed at another file elsewhere, that file's edits.
        other = tmp_path / "etc" / "other.toml"
        other.write_text(_cfg(9003), encoding="utf-8")
        (tmp_path / "run" / "next").symlink_to(other)
        os.replace(tmp_path / "run" / "next", cfg)
        assert await _until(lambda: any(s.workers[0].url.endswith(":9003") for s in applied))
        other.write_text(_cfg(9004), encoding="utf-8")
        assert await _until(lambda: any(s.workers[0].url.endswith(":9004") for s in applied))
    finally:
        await w.stop()


@contextlib.asynccontextmanager
async def _watching(
    cfg: Path,
) -> AsyncIterator[tuple[list[Settings], list[str], ConfigWatcher]]:
    """A started watcher on ``cfg`` (its watch set up), what it applied and what it reported."""
    applied: list[Settings] = []
    errors: list[str] = []
    w = ConfigWatcher(cfg, load_settings(cfg), applied.append, errors.append)
    await w.start()
    try:
        await asyncio.sleep(0.5)  # the watch is set up
        yield applied, errors, w
    finally:
        await w.stop()


def _point(link: Path, to: Path | str) -> None:
    """`ln -sfn to link`: a new link renamed over the old one, so readers never see no link."""
    tmp = link.with_name(link.name + ".tmp")
    tmp.symlink_to(to)
    os.replace(tmp, link)


@pytest.mark.parametrize("chain", [False, True], ids=["dir-link", "dir-link-to-a-link"])
async def test_a_swapped_directory_link_is_followed(tmp_path: Path, chain: bool) -> None:
    # /etc/kvgate -> /srv/cfg-v1, then `ln -sfn /srv/cfg-v2 /etc/kvgate`: the file's own
    # directory is the link. A watch of the directory stays on cfg-v1 and saw nothing after the
    # swap. With `chain`, /etc/kvgate -> /opt/current -> cfg-vN and /opt/current is the link
    # swapped (relative, through "..": where it points is not its own directory).
    srv, etc, opt = tmp_path / "srv", tmp_path / "etc", tmp_path / "opt"
    for d in (srv, etc, opt):
        d.mkdir()
    for v in (1, 2, 3):
        (srv / f"cfg-v{v}").mkdir()
        (srv / f"cfg-v{v}" / "config.toml").write_text(_cfg(9000 + v), encoding="utf-8")
    swapped = opt / "current" if chain else etc / "kvgate"
    _point(swapped, Path("..") / "srv" / "cfg-v1" if chain else srv / "cfg-v1")
    if chain:
        _point(etc / "kvgate", opt / "current")
    cfg = etc / "kvgate" / "config.toml"
    applied: list[Settings] = []
    w = ConfigWatcher(cfg, load_settings(cfg), applied.append, lambda _m: None)
    await w.start()

    def seen(port: int) -> Callable[[], bool]:
        return lambda: any(s.workers[0].url.endswith(f":{port}") for s in applied)

    try:
        await asyncio.sleep(0.5)
        _point(swapped, Path("..") / "srv" / "cfg-v2" if chain else srv / "cfg-v2")
        assert await _until(seen(9002)), "the swap to cfg-v2 was not applied"
        shutil.rmtree(srv / "cfg-v1")  # the old directory goes, as after a rollout
        # ... then edits of the new directory's file in place ...
        (srv / "cfg-v2" / "config.toml").write_text(_cfg(9012), encoding="utf-8")
        assert await _until(seen(9012)), "an edit in the new directory was not applied"
        # ... and the next swap.
        _point(swapped, Path("..") / "srv" / "cfg-v3" if chain else srv / "cfg-v3")
        assert await _until(seen(9003)), "the swap to cfg-v3 was not applied"
    finally:
        await w.stop()
    urls = [s.workers[0].url for s in applied]
    assert urls == [f"http://127.0.0.1:{p}" for p in (9002, 9012, 9003)], urls


async def test_a_swap_of_the_directory_to_an_empty_file_keeps_the_running_config(
    tmp_path: Path,
) -> None:
    # The guarantees hold across a directory swap too: an empty file (valid TOML, no fleet, no
    # tenants) behind the new link is rejected and reported; a later good one applies.
    for v, text in ((1, _cfg(9001)), (2, ""), (3, _cfg(9003))):
        (tmp_path / f"v{v}").mkdir()
        (tmp_path / f"v{v}" / "config.toml").write_text(text, encoding="utf-8")
    _point(tmp_path / "conf", tmp_path / "v1")
    async with _watching(tmp_path / "conf" / "config.toml") as (applied, errors, w):
        _point(tmp_path / "conf", tmp_path / "v2")
        assert await _until(lambda: any("no settings" in e for e in errors)), errors
        assert applied == [] and w.current.workers[0].url.endswith(":9001")
        _point(tmp_path / "conf", tmp_path / "v3")
        assert await _until(lambda: bool(applied))
    assert [s.workers[0].url for s in applied] == ["http://127.0.0.1:9003"]


async def test_a_swap_to_a_missing_directory_and_back_is_applied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A slip (`ln -sfn /srv/cfg-v2 ...` before cfg-v2 exists) is reported, not fatal; while the
    # link points nowhere there is no directory to watch, so the fix, whether the link is
    # pointed right or the directory created, must still be picked up by the watch's retry.
    monkeypatch.setattr(config_watcher, "_RETRY_S", 0.2)
    for v in (1, 3):
        (tmp_path / f"v{v}").mkdir()
        (tmp_path / f"v{v}" / "config.toml").write_text(_cfg(9000 + v), encoding="utf-8")
    _point(tmp_path / "conf", tmp_path / "v1")
    async with _watching(tmp_path / "conf" / "config.toml") as (applied, errors, _w):
        _point(tmp_path / "conf", tmp_path / "v2")  # not there (yet)
        assert await _until(lambda: bool(errors)), "the missing file was not reported"
        _point(tmp_path / "conf", tmp_path / "v3")
        assert await _until(lambda: bool(applied)), "the link pointed right was not applied"
        _point(tmp_path / "conf", tmp_path / "v2")
        assert await _until(lambda: len(errors) >= 2)
        (tmp_path / "v2").mkdir()  # ... and now the directory it names is created
        (tmp_path / "v2" / "config.toml").write_text(_cfg(9002), encoding="utf-8")
        assert await _until(lambda: len(applied) >= 2), "the created directory was not applied"
    assert [s.workers[0].url for s in applied] == ["http://127.0.0.1:9003", "http://127.0.0.1:9002"]


async def test_a_real_directory_renamed_into_place_is_followed(tmp_path: Path) -> None:
    # No link at all: a deploy builds the new directory beside the old one and renames it into
    # place (`mv conf conf.old && mv conf.new conf`). The watch stays on the inode it was set
    # on, the old directory, and saw nothing; the directory's name in its parent is watched too.
    conf, new, old = tmp_path / "conf", tmp_path / "conf.new", tmp_path / "conf.old"
    for d, port in ((conf, 9001), (new, 9002)):
        d.mkdir()
        (d / "config.toml").write_text(_cfg(port), encoding="utf-8")
    async with _watching(conf / "config.toml") as (applied, _errors, _w):
        os.rename(conf, old)
        os.rename(new, conf)
        assert await _until(lambda: bool(applied)), "the renamed-in directory was not applied"
        shutil.rmtree(old)
        (conf / "config.toml").write_text(_cfg(9012), encoding="utf-8")  # then edits in place
        assert await _until(lambda: len(applied) >= 2), "an edit in the new directory was missed"
    assert [s.workers[0].url for s in applied] == ["http://127.0.0.1:9002", "http://127.0.0.1:9012"]
