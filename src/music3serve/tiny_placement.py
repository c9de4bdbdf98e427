"""How `tiny.write_tiny` puts a checkpoint in place of a folder safely: written whole into a staging folder beside
it, then renamed into place; a folder already there is moved aside and removed only once the new one is in, and
staging folders whose writer is gone are cleaned up."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from .errors import Music3Error


STAGING_PREFIX = ".tiny-new-"  # then the writer's pid, a dash and a random suffix


def current_folder() -> Path | None:
    """The working folder, links resolved; None where it was removed."""
    try:
        return Path(os.path.realpath(os.getcwd()))
    except OSError:
        return None


def remove_orphaned_staging(folder: Path) -> None:
    """Staging folders in `folder` whose writer is gone (killed with SIGKILL, or the machine went down: no cleanup
    ran) are removed; a living writer's are left alone."""
    for path in folder.glob(f"{STAGING_PREFIX}*-*"):
        pid = path.name.removeprefix(STAGING_PREFIX).split("-", 1)[0]
        if pid.isascii() and pid.isdigit() and path.is_dir() and not process_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def process_alive(pid: int) -> bool:
    """Whether a process `pid` exists (another user's too); a number no pid can be counts as alive, so its folder,
    which none of our writers made, stays."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        pass
    return True


def refuse_foreign_entries(target: Path, staging: Path) -> None:
    """Replacing `target` removes what it holds: refused when that is more than a checkpoint like `staging` (any file
    or folder, at any depth, that `staging` does not have)."""
    def entries(root: Path) -> set[str]:
        return {p.relative_to(root).as_posix() for p in root.rglob("*")}

    foreign = sorted(entries(target) - entries(staging)) if target.is_dir() else []
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise Music3Error(f"{target} holds files a tiny checkpoint does not ({shown}); only a folder holding nothing "
                          "but a tiny checkpoint is replaced: move them, or pick another folder")


def put_in_place(staging: Path, target: Path) -> None:
    """Rename `staging` to `target`; a folder already there is moved aside first and removed only once the new one
    is in place (put back if that fails), so a failed replace loses nothing."""
    if not target.exists():
        staging.rename(target)
        return
    aside = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tiny-old-"))
    try:
        target.rename(aside)  # onto the empty folder just made
    except BaseException:
        aside.rmdir()
        raise
    try:
        staging.rename(target)
    except BaseException:
        aside.rename(target)
        raise
    shutil.rmtree(aside, ignore_errors=True)
