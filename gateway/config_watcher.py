"""Live config reload: the file watched for edits and SIGHUP, applied only when it validates.

`gateway.config` declares and loads `Settings`; this is the running side of it. Every change
loads the whole file again (`load_settings`), so a reload either replaces the config entirely or,
when the file fails validation, is rejected and reported while the running config stays.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable
from pathlib import Path

from gateway.config import ConfigError, Settings, load_settings

log = logging.getLogger("kvgate.config")


class ConfigWatcher:
    """Reloads the file on change (watchfiles) and on SIGHUP; applies only valid configs.

    `on_change(new)` runs for every valid, different config; `on_error(msg)` for every rejected
    one, after which the running config stays as it was.
    """

    def __init__(
        self,
        path: Path,
        current: Settings,
        on_change: Callable[[Settings], None],
        on_error: Callable[[str], None],
    ) -> None:
        self.path = path
        self.current = current
        self._on_change = on_change
        self._on_error = on_error
        self._task: asyncio.Task[None] | None = None

    def reload(self) -> bool:
        try:
            new = load_settings(self.path)
        except ConfigError as e:
            log.error("config reload rejected, keeping the running config: %s", e)
            self._on_error(str(e))
            return False
        if new != self.current:
            self.current = new
            log.info("config reloaded from %s", self.path)
            self._on_change(new)
        return True

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        # Not available off the main thread or on some platforms; the file watch still works.
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signal.SIGHUP, self.reload)
        self._task = asyncio.create_task(self._watch(), name="config-watch")

    async def _watch(self) -> None:
        from watchfiles import awatch

        # Watch the directory: editors replace files by rename, which a file watch would miss.
        # Only its own level and only this file's name: a config beside logs or a checkout
        # (config.example.toml in the repo root) must not wake the watcher per write below it.
        target = self.path.resolve()
        name = target.name
        async for changes in awatch(
            target.parent,
            debounce=200,
            step=50,
            recursive=False,
            watch_filter=lambda _change, path: Path(path).name == name,
        ):
            if any(Path(p) == target for _, p in changes):
                self.reload()

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
