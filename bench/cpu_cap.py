"""A CPU quota for the router under test (`bench overhead --router-cpu F`), through a cgroup.

Why: a router's capacity per core only shows when the router, not the fleet or the load
generator, is the bottleneck. On a 16-core host pinning it to one core does that; on the 2-core
development machine the simulated worker and the load generator share the other core and
saturate first (no router there uses more than ~60% of its core), so req/s measures the fleet.
Capping the router at a fraction F of its core (CFS bandwidth control: F x period of CPU time
per period) makes it the bottleneck there too: every router then runs at F of a core, and its
req/s at that cap, divided by F, is what one core of it carries. The cap applies to the process
and everything it starts (threads, children), from before its first instruction (the child joins
the cgroup before exec).

The period is short (10 ms) so that a throttled router waits at most (1 - F) x 10 ms for its next
slice, small beside the tails being measured. Needs root (or a delegated cgroup) and the cpu
controller, v2 (`cpu.max`) or v1 (`cpu.cfs_quota_us`); `CpuCap.create` says why not, in one line.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

__all__ = ["PERIOD_US", "CpuCap", "CpuCapError"]

PERIOD_US = 10_000
_ROOT = Path("/sys/fs/cgroup")


class CpuCapError(RuntimeError):
    """No cgroup could be made (not root, no cpu controller): the reason, in one line."""


class CpuCap:
    """One cgroup with a CPU quota of `share` of one core; `join()` runs in a child before exec."""

    def __init__(self, path: Path, share: float) -> None:
        self.path = path
        self.share = share
        self._procs = str(path / "cgroup.procs")

    @classmethod
    def create(cls, share: float, name: str | None = None, root: Path = _ROOT) -> CpuCap:
        if not 0.0 < share <= 64.0:
            raise CpuCapError(f"--router-cpu {share}: a share of one core, above 0")
        name = name or f"kvgate-bench-{os.getpid()}"
        quota = max(1_000, round(share * PERIOD_US))  # the kernel's floor is 1 ms
        v2 = (root / "cgroup.controllers").exists()
        parent = root if v2 else root / "cpu"
        if v2 and "cpu" not in (root / "cgroup.controllers").read_text().split():
            raise CpuCapError(f"{root}: the cpu controller is not available (cgroup v2)")
        if not v2 and not (parent / "cpu.cfs_quota_us").exists():
            raise CpuCapError(f"{parent}: no cgroup v1 cpu controller")
        path = parent / name
        try:
            if v2:
                control = root / "cgroup.subtree_control"
                if "cpu" not in control.read_text().split():
                    control.write_text("+cpu")
            path.mkdir(exist_ok=True)
            if v2:
                (path / "cpu.max").write_text(f"{quota} {PERIOD_US}")
            else:
                (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (path / "cpu.cfs_quota_us").write_text(str(quota))
        except OSError as e:
            with contextlib.suppress(OSError):
                path.rmdir()
            raise CpuCapError(f"cannot make a cgroup at {path}: {e.strerror or e}") from e
        return cls(path, share)

    def join(self) -> None:
        """Move the calling process into the cgroup (a `preexec_fn`: before exec, so all of it)."""
        fd = os.open(self._procs, os.O_WRONLY)
        try:
            os.write(fd, str(os.getpid()).encode())
        finally:
            os.close(fd)

    def remove(self) -> bool:
        """Remove the cgroup once its processes are gone; False when it could not be (a process
        still in it: the kernel refuses, and the empty group is harmless until the next boot)."""
        try:
            self.path.rmdir()
        except FileNotFoundError:
            return True
        except OSError:
            return False
        return True
