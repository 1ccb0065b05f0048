"""Live config reload: the file watched for edits and SIGHUP, applied only when it validates.

`gateway.config` declares and loads `Settings`; this is the running side of it. Every change
loads the whole file again (`load_settings`), so a reload either replaces the config entirely or,
when the file fails validation, is rejected and reported while the running config stays.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import stat
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gateway.config import ConfigError, Settings, load_settings

log = logging.getLogger("kvgate.config")

# What a reload cannot change (`Gateway.apply` warns "takes effect after a restart"): whole
# sections, and these keys of [cluster]. `kvgate serve --processes N` pins them for a child it
# restarts (`gateway.process_child.start_settings`), so that every child runs the same ones.
RESTART_ONLY_SECTIONS = ("server", "upstream", "quota")
RESTART_ONLY_CLUSTER = ("enabled", "redis_url", "key_prefix", "share_learned")

# A change is applied once the file reads the same at both ends of this window: writers that
# truncate and then write, or write in chunks, leave a file that is empty or a prefix (a prefix
# of a valid file is often itself valid: fewer workers, a tenant without its `isolate_cache`,
# `models` or limits) until they are done. Any pause shorter than this is waited through (a
# templating step, a network copy); 0.2 s let such a prefix be applied live. Not longer, so that
# an edit still applies within about a second (50 ms of quiet, this, the load). A writer that
# may pause longer must write beside the file and rename it over (README, Configuration).
_SETTLE_S = 0.75
# Windows a file still changing is waited through before this change is given up on (logged;
# the writes that kept it changing are events or poll changes themselves, so the next one tries
# again): a file that never stops changing must not hold the watch, which also re-arms itself.
_SETTLE_TRIES = 20
# How often the file's stat (inode, size, times) is compared with the last: a change that no
# watch reports (a network file system, a mount whose inotify events do not reach this side)
# still applies, this late.
_POLL_S = 2.0
# After the file watch fails (its directory went away, inotify limits), it starts again this late.
_RETRY_S = 5.0
# Symlinks followed to find what in the directory the path reads through (bounds a link loop).
_MAX_LINKS = 16


@dataclass(frozen=True, slots=True)
class _Layout:
    """Where reading the path leads, as far as choosing what to watch goes: when any of it
    differs after a change, the watch is set up again (a watch stays on the inode it was set
    on, so one of a directory swapped for another would go on watching the old one)."""

    target: Path | None  # the file, when it is outside the path's directory
    links: frozenset[tuple[Path, str]]  # links on the way outside that directory, and their text
    # Every directory watched, with its (st_dev, st_ino) (None: not there). The inode of each,
    # not only of the path's own directory: the target's directory removed and made again
    # (`rm -rf` + `mkdir` by a deploy tool) has the same path, and the watch would stay on the
    # deleted one, seeing no edit again.
    watched: tuple[tuple[Path, tuple[int, int] | None], ...]
    # The file the path resolves to, with its (st_dev, st_ino), watched itself (None: not there,
    # or not a regular file). A single-file bind mount (`-v ./kvgate.toml:/etc/kvgate/config.toml`)
    # edited in place sends its directory's watch nothing: the write is reported to the parent
    # the file was opened through, the host's. A watch of the file itself sees it. That watch
    # stays on the inode too, so a file renamed over (an editor's save, `mv new config.toml`)
    # gives another layout and the watch is set up again on the new one.
    file: tuple[Path, tuple[int, int]] | None

    @property
    def where(self) -> list[Path]:
        return [d for d, _ident in self.watched]

    @property
    def paths(self) -> list[Path]:
        """What the watch is set on: the directories, and the file when it is there (a watch
        of a missing path fails to start; its directory's watch sees it arrive)."""
        return self.where if self.file is None else [*self.where, self.file[0]]


class ConfigWatcher:
    """Reloads the file on change (watchfiles) and on SIGHUP; applies only valid configs.

    `on_change(new)` runs for every valid, different config, and refuses one by raising
    (`ConfigError` for a refusal it explains: logged as its reason alone); `on_error(msg)` runs
    for every rejected one, after which the running config stays as it was.
    """

    def __init__(
        self,
        path: Path,
        current: Settings,
        on_change: Callable[[Settings], None],
        on_error: Callable[[str], None],
        *,
        watch: bool = True,
    ) -> None:
        self.path = path
        # False: SIGHUP (and `reload` calls: POST /admin/reload) only, no watch, no poll.
        self.watch = watch
        self.current = current
        self._on_change = on_change
        self._on_error = on_error
        self._task: asyncio.Task[None] | None = None
        self._poll_task: asyncio.Task[None] | None = None
        # Held while a change is settled and applied, by the watch, its catch-up and the poll:
        # two of them settling one change at once would apply (or reject and count) it twice.
        self._lock = asyncio.Lock()
        # Every reload, whoever ran it: the watch tells by it whether one read the file after
        # its events came (see `_apply_events`).
        self._reloads = 0
        self._watched: frozenset[str] = frozenset()
        self._links: frozenset[Path] = frozenset()
        self._directory = path.absolute().parent
        # The bytes the last reload judged, (None,) for no file; None until a reload ran. A
        # catch-up read (`_catch_up`) that finds the same skips the reload: an unchanged file
        # rejected once is not reported, and counted, again.
        self._judged: tuple[bytes | None] | None = None

    def reload(self) -> bool:
        self._reloads += 1
        try:
            new = self._load()
        except ConfigError as e:
            log.error("config reload rejected, keeping the running config: %s", e)
            self._on_error(str(e))
            return False
        if new != self.current:
            try:
                self._on_change(new)
            except ConfigError as e:
                # Refused on purpose (a reload that would open an authenticated gateway): the
                # reason is the message, a traceback would only bury it.
                log.error("config reload rejected, keeping the running config: %s", e)
                self._on_error(str(e))
                return False
            except Exception as e:
                # Rejected whole (Gateway.apply does its fallible part first), and not taken
                # as current: the same file, fixed in place (a tokenizer), loads next time.
                log.exception("config reload rejected, keeping the running config")
                self._on_error(str(e))
                return False
            self.current = new
            log.info("config reloaded from %s", self.path)
        return True

    def _load(self) -> Settings:
        """`load_settings`, but never of a file with no settings in it, nor of one being rewritten.

        An empty file is a valid config (every section defaulted): no workers, and no tenants, so
        the gateway would take anonymous requests. On a reload it is a file caught between
        truncation and write far more likely than a config meant to replace a running fleet.
        Comparing the bytes before and after the load makes sure the validated text is the text
        checked here.
        """
        for _ in range(3):
            try:
                before = self._read()
            except ConfigError:
                self._judged = (None,)  # as `_read_quietly` sees it
                raise
            self._judged = (before,)
            if before is not None and _has_no_settings(before):
                raise ConfigError(f"{self.path}: file has no settings (empty, or comments only)")
            new = load_settings(self.path)  # a missing file raises ConfigError with the reason
            if self._read() == before:
                return new
        raise ConfigError(f"{self.path}: kept changing while being read")

    def _read(self) -> bytes | None:
        try:
            return self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:  # permission, a directory in its place: reported, never fatal
            raise ConfigError(f"{self.path}: cannot read: {e.strerror or e}") from e

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        # Not available off the main thread or on some platforms; the file watch still works.
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signal.SIGHUP, self.reload)
        if not self.watch:
            return
        self._task = asyncio.create_task(self._watch(), name="config-watch")
        self._poll_task = asyncio.create_task(self._poll(), name="config-poll")

    async def _watch(self) -> None:
        from watchfiles import Change, awatch

        # Watch the directory: editors replace files by rename, which a file watch would miss.
        # And the file itself (see `_Layout.file`): a single-file bind mount edited in place
        # is seen by nothing else.
        # Its unresolved path: behind a symlink swapped to a new directory (a Kubernetes
        # ConfigMap: config.toml -> ..data/config.toml, ..data -> ..<timestamp>/, the old one
        # deleted) a watch of the resolved directory would go with the first directory deleted.
        # Only its own level and only the names the path reads through (its own, the links'): a
        # config beside logs or a checkout (config.example.toml in the repo root) must not wake
        # the watcher per write below it.
        # A link to a file elsewhere (config.toml -> /etc/kvgate/real.toml) is followed too: that
        # file's own directory is watched for it, so an edit of the target in place applies.
        # So is a link the directory itself is reached through (/etc/kvgate -> /srv/cfg-v1, then
        # `ln -sfn /srv/cfg-v2 /etc/kvgate`): the swap is a rename in the link's parent, which
        # is watched for the link's name, and the watch is moved to the new directory. And a
        # real directory renamed into place (`mv conf.new conf`): the parent is watched for the
        # directory's name, and the new inode's change of `_Layout` moves the watch there.
        # After the first watch, every watch set up again reads the file once it is in place
        # (`_catch_up`): a change made while none was (during the reload that moved it, often a
        # slow one: tokenizers, the fleet; or during the retry delay) sends no event to it.
        directory = self._directory = self.path.absolute().parent
        failed: _Layout | None = None  # where things stood when the watch last failed
        first = True
        while True:
            self._watched = self._names(directory)
            layout = self._layout(directory)
            self._links = frozenset(link for link, _text in layout.links)
            # Changed while nothing watched (a link pointed at a directory not there yet, then
            # pointed right or the directory made): read again even if the bytes are the same.
            force = failed is not None and layout != failed
            moved = asyncio.Event()  # set by the catch-up: awatch returns, the watch moves
            catch_up = None
            if not first:
                # Its first step runs once this task waits, in awatch, which sets its watch up
                # before its first wait: what the catch-up reads is either read or seen.
                catch_up = asyncio.create_task(self._catch_up(layout, force, moved))
            first, failed = False, None
            where = frozenset(layout.where)
            file = None if layout.file is None else layout.file[0]
            try:
                async for changes in awatch(
                    *layout.paths,
                    debounce=200,
                    step=50,
                    recursive=False,
                    stop_event=moved,
                    watch_filter=functools.partial(
                        self._wanted, layout.target, frozenset(layout.paths)
                    ),
                ):
                    await self._apply_events()
                    self._watched = self._names(directory)
                    # A watched directory itself deleted or renamed away: its watch is dead even
                    # when one made in its place compares equal (ext4 gives the inode just freed
                    # to the next `mkdir`), so it is set up again on the event alone. So is the
                    # watched file's, deleted (renamed over, the inode freed): the file written
                    # anew may get that very inode.
                    if any(
                        Path(p) in where or (c == Change.deleted and Path(p) == file)
                        for c, p in changes
                    ):
                        break
                    if self._layout(directory) != layout:
                        break  # a link now points elsewhere, or a new file: watch that instead
                continue  # at once: no retry delay after a break
            except Exception as e:
                # Replaced between `_layout` and the watch starting (a watch of a path not
                # there fails): nothing wrong, set it up again at once on what is there now.
                replaced = isinstance(e, FileNotFoundError) and self._layout(directory) != layout
                if replaced:
                    log.info("config file replaced while its watch started; watching it again")
                else:
                    # Without this the task would end silently and every later edit be ignored.
                    log.exception("config file watch failed; watching %s again", directory)
                failed = layout
                if catch_up is not None and not catch_up.done():
                    # No watch to wait for: read now what the catch-up would have.
                    catch_up.cancel()
                    self._reload_if_changed(force)
                if replaced:
                    continue
            finally:
                if catch_up is not None:
                    catch_up.cancel()
            await asyncio.sleep(_RETRY_S)

    async def _apply_events(self) -> None:
        """Reload once the file has settled, after a batch of watch events.

        Always a reload, even of bytes judged before: a file touched is how a reload refused
        for something outside it (a tokenizer since fixed) is tried again. Unless another
        reload (the poll's, SIGHUP's) ran since the events came: that one read the file after
        them, and the same bytes judged again would be reported and counted twice.
        """
        seen = self._reloads
        async with self._lock:
            if not await self._settle():
                return
            if self._reloads == seen:
                self.reload()
            else:
                self._reload_if_changed(False)

    async def _poll(self) -> None:
        """Apply a change no watch event told of, found by the file's stat every `_POLL_S`.

        The watch is the fast way and this the fallback: an edit that sends no inotify event
        here (a network file system; file sharing that does not pass events into a container)
        would otherwise wait for a SIGHUP or a restart, the old config (a removed API key among
        it) in force until then. After a change the watch already applied, this reads the same
        bytes and applies nothing.
        """
        last = _signature(self.path)
        while True:
            await asyncio.sleep(_POLL_S)
            now = _signature(self.path)
            if now == last:
                continue
            last = now
            try:
                async with self._lock:
                    if await self._settle():
                        self._reload_if_changed(False)
            except Exception:  # never silently, and the poll goes on
                log.exception("config poll reload failed")

    async def _catch_up(self, layout: _Layout, force: bool, moved: asyncio.Event) -> None:
        """Reload a file changed before the watch just set up was in place (see `_watch`); and
        when where the path leads moved again meanwhile, have the watch set up anew."""
        try:
            async with self._lock:
                if await self._settle():
                    self._reload_if_changed(force)
            self._watched = self._names(self._directory)
            if self._layout(self._directory) != layout:
                moved.set()
        except Exception:  # never silently: the watch itself goes on
            log.exception("config catch-up reload failed")

    def _reload_if_changed(self, force: bool) -> None:
        """`reload`, unless the file holds the bytes the last reload judged: nothing to apply,
        and an invalid file already reported would be reported and counted twice."""
        if force or self._judged != (self._read_quietly(),):
            self.reload()

    async def _settle(self) -> bool:
        """Wait until the file reads the same twice `_SETTLE_S` apart: a writer that paused for
        less than that mid-file has written more by the second read, so a prefix of the file
        (valid TOML often) is never what is applied. False when it was still changing after
        `_SETTLE_TRIES` windows: the caller applies nothing, and the next change tries again."""
        before = self._read_quietly()
        for _ in range(_SETTLE_TRIES):
            await asyncio.sleep(_SETTLE_S)
            now = self._read_quietly()
            if now == before:
                return True
            before = now
        log.warning(
            "config file %s still changing after %.0f s; applied once it stays the same for %s s",
            self.path,
            _SETTLE_S * _SETTLE_TRIES,
            _SETTLE_S,
        )
        return False

    def _read_quietly(self) -> bytes | None:
        try:
            return self._read()
        except ConfigError:
            return None  # unreadable: the reload that follows reports why

    def _wanted(
        self, target: Path | None, where: frozenset[Path], _change: object, path: str
    ) -> bool:
        """An entry the path reads through (by name, in its directory), the outside target, a
        link on the way to either (by its path, in its own parent), or a watched directory or
        the watched file itself (deleted or renamed away: its watch must be set up again; the
        file's own watch reports an edit no directory watch sees, see `_Layout.file`)."""
        p = Path(path)
        if p == self._directory or p in where:  # `_directory`: renamed over, in its parent
            return True
        if p.parent != self._directory and p.parent == self._directory.parent:
            return p in self._links or p == target  # the parent's other entries: not ours
        return p.name in self._watched or p == target or p in self._links

    def _layout(self, directory: Path) -> _Layout:
        """What the watch depends on, read now (see `_Layout`): the directories to watch are
        ``directory``, the outside target's, those of the links on the way, and the parent of
        ``directory`` (for the directory's own name: see `_wanted`); and the file itself."""
        target = self._outside_target(directory)
        links = self._links_outside(directory)
        where = [directory] if target is None else [directory, target.parent]
        where += sorted({link.parent for link, _text in links} - set(where))
        if directory.parent != directory and directory.parent not in where:
            where.append(directory.parent)
        return _Layout(target, links, tuple((d, _identity(d)) for d in where), self._file())

    def _file(self) -> tuple[Path, tuple[int, int]] | None:
        """The file the path resolves to and its (st_dev, st_ino), when it is a regular file:
        watched itself (see `_Layout.file`)."""
        try:
            resolved = self.path.resolve()
            st = os.stat(resolved)
        except (OSError, RuntimeError):
            return None  # not there, or a link loop: the directory watches see what comes
        return (resolved, (st.st_dev, st.st_ino)) if stat.S_ISREG(st.st_mode) else None

    def _links_outside(self, directory: Path) -> frozenset[tuple[Path, str]]:
        """Every symlink reading the path goes through, with its text, except those in
        ``directory`` itself (followed by name, see `_names`).

        Each one's target is searched too: ``/etc/kvgate -> /opt/current`` with ``/opt/current
        -> /srv/cfg-v1`` is swapped by replacing ``/opt/current``. A link's target is kept as
        written, not normalised: ``..`` after a link leaves the link's target, not its parent.
        """
        links: dict[Path, str] = {}
        todo = [self.path.absolute()]
        while todo and len(links) < _MAX_LINKS:
            path = todo.pop()
            for prefix in (*reversed(path.parents), path):
                if prefix in links:
                    continue
                try:
                    text = os.readlink(prefix)
                except OSError:
                    continue  # not a link, or not there: nothing that can be swapped
                links[prefix] = text
                todo.append(prefix.parent / text)
        return frozenset((link, text) for link, text in links.items() if link.parent != directory)

    def _outside_target(self, directory: Path) -> Path | None:
        """The file the path resolves to, when that is not in ``directory`` itself: its own
        directory is watched for it.

        Resolved even while the file is missing (not `strict`): a target deleted and written
        again (`rm` + `cp`) keeps its directory watched, and its return is seen. A target in a
        subdirectory (``config.toml -> releases/kvgate.toml``) is outside too: the watch of
        ``directory`` is not recursive, so an edit of it in place would go unseen.
        """
        try:
            target = self.path.resolve()
            home = directory.resolve()
        except (OSError, RuntimeError):
            return None  # a link loop: the reload that follows says why
        return None if target.parent == home else target

    def _names(self, directory: Path) -> frozenset[str]:
        """Entries of `directory` that reading the path goes through: its own name and those of
        the symlinks on the way (`..data` and the directory it points at), found anew after
        every change because a swap changes them."""
        names = {self.path.name}
        todo = [directory / self.path.name]
        for _ in range(_MAX_LINKS):
            if not todo:
                break
            link = todo.pop()
            try:
                target = Path(os.path.normpath(link.parent / os.readlink(link)))
                head = target.relative_to(directory).parts[0]
            except (OSError, ValueError, IndexError):
                continue  # not a link, or one out of the directory (not watched: no event)
            names.add(head)
            todo += [directory / head, target]
        return frozenset(names)

    async def stop(self) -> None:
        for task in (self._task, self._poll_task):
            if task:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task


def _identity(directory: Path) -> tuple[int, int] | None:
    """(st_dev, st_ino) of what ``directory`` leads to: the inode a watch of it is set on."""
    try:
        st = os.stat(directory)
    except OSError:
        return None  # gone: the watch fails and is set up again, the reload says why
    return (st.st_dev, st.st_ino)


def _signature(path: Path) -> tuple[int, ...] | None:
    """What an edit of the file changes, by a stat alone (no read every `_POLL_S`): which file
    the path leads to, its size, and its times (ctime too: `cp -p`, `touch -r` set mtime back)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _has_no_settings(text: bytes) -> bool:
    try:
        return not tomllib.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError, RecursionError):
        return False  # not TOML at all, or nested too deeply: `load_settings` says so
