"""Atomic file and directory writes: a crash never leaves a half-written artifact.

Every artifact is first written under a hidden temporary name in the destination's own
directory (same filesystem), then moved into place with ``os.replace``.
"""

from __future__ import annotations

import contextlib
import ctypes
import fnmatch
import hashlib
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from planner.errors import InputError, MoeplanError


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM back until the block ends, so that renames that belong
    together all happen: two outputs that must match (a split's two sides) are never left
    one new, one old by Ctrl-C. A signal that arrives meanwhile is raised again at the end,
    to the handler it would have met. Python runs signal handlers in the main thread only,
    whichever thread the signal reached (blocking it there alone would not do), so
    elsewhere this holds nothing back.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    held = (signal.SIGINT, signal.SIGTERM)
    before = {s: signal.signal(s, lambda signum, _frame: pending.append(signum)) for s in held}
    try:
        yield
    finally:
        for s, handler in before.items():  # None: set outside Python, the default
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        for signum in dict.fromkeys(pending):
            signal.raise_signal(signum)


@contextlib.contextmanager
def atomic_path(dest: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``dest``; on success rename it onto ``dest``.

    Works for a file or a directory written at the yielded path. On error the temporary
    path is removed and ``dest`` is left exactly as it was. A file never replaces a
    directory; callers that replace a directory check first that it is theirs
    (:func:`check_output`).
    """
    dest = Path(dest)
    made = make_folders_for(dest)  # removed again if dest is not written
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    tmp.unlink()
    written = False
    try:
        try:
            yield tmp
        except OSError as e:
            if e.filename is not None:  # the message names its path already
                raise
            # a write that failed (a full disk): "[Errno 28] No space left on device" alone
            # did not say which output
            why = e.strerror or str(e)
            raise (
                OSError(e.errno, f"{why} (writing {dest})")
                if e.errno
                else OSError(f"{why} (writing {dest})")
            ) from e
        _default_file_modes(tmp)
        if dest.is_dir() and not dest.is_symlink():
            if not tmp.is_dir():
                raise InputError(f"{dest}: is a directory; a file cannot replace it")
            # os.replace cannot replace a non-empty directory. Linux swaps the two in one
            # step (renameat2 RENAME_EXCHANGE), so there is no moment without ``dest``; the
            # old directory, now at ``tmp``, is removed below.
            if exchange_paths(tmp, dest):
                written = True
                return
            # Elsewhere: via a backup name of its own (a fixed name could be a user's file),
            # renamed onto a fresh empty directory
            backup = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".old", dir=dest.parent))
            try:
                os.replace(dest, backup)
            except BaseException:
                backup.rmdir()  # still the empty folder mkdtemp made
                raise
            try:
                os.replace(tmp, dest)
            except BaseException:
                os.replace(backup, dest)
                raise
            shutil.rmtree(backup)
        elif tmp.is_dir() and dest.exists():
            raise InputError(f"{dest}: exists and is a file; a directory cannot replace it")
        else:
            os.replace(tmp, dest)
        written = True
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()
        if not written:
            remove_empty_folders(made)


def make_folders_for(path: Path) -> list[Path]:
    """Make ``path``'s missing parent folders; returns them, deepest first, for
    :func:`remove_empty_folders` to take back if nothing is written there."""
    made = [d for d in (path.parent, *path.parent.parents) if not d.exists()]
    path.parent.mkdir(parents=True, exist_ok=True)
    return made


def remove_empty_folders(made: list[Path]) -> None:
    """Remove the folders :func:`make_folders_for` made, deepest first, while they are
    empty (another output may have landed in one)."""
    for folder in made:
        try:
            folder.rmdir()
        except OSError:
            break


def refuse_existing(out: str | os.PathLike, overwrite: bool) -> None:
    """InputError where ``out`` exists and ``overwrite`` (the CLI's ``--force``) is not given."""
    if Path(out).exists() and not overwrite:
        raise InputError(
            f"{out}: already exists; choose another path or pass --force (overwrite=True from Python)"
        )


def exchange_paths(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Swap paths ``a`` and ``b`` atomically (Linux renameat2 RENAME_EXCHANGE); False where
    the call or the filesystem does not support it, or it failed (both paths as they were).

    A reader of either path sees the old entry or the new one, never none: this is how a
    directory (a bundle) replaces another with no moment between.
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    done = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0
    return bool(done)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _default_file_modes(path: Path) -> None:
    """Give the files written at ``path`` the permissions of any new file (0644 under the
    usual umask): safetensors writes 0600, so a bundle exported by one user (the nightly CI
    job) could not be read by the serving engine's."""
    mode = 0o666 & ~_umask()
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for f in files:
        if not f.is_symlink() and f.stat().st_mode & 0o777 != mode:
            os.chmod(f, mode)


def check_place(path: Path, inputs: tuple = ()) -> None:
    """InputError if an output at ``path`` would be one of ``inputs``, hold one or lie
    inside one, lie under a file, or lie inside another moeplan artifact."""
    here = path.resolve()
    for given in inputs:
        source = Path(given).resolve()
        # an output inside an input is refused too: replacing that input later (say, fit
        # --out PRED once more) would delete the output with it
        if here == source or here in source.parents or source in here.parents:
            raise InputError(
                f"{path}: the command reads its input {given} there; choose another output path"
            )
    check_parents(path)
    owner = artifact_holding(path)
    if owner is not None:
        raise InputError(
            f"{path}: is inside the {owner}; writing there would change it; choose another "
            f"output path"
        )


def check_output(
    path: str | os.PathLike,
    *,
    marker: str | None,
    what: str,
    inputs: tuple = (),
    suffixes: tuple[str, ...] = (),
    members: tuple[str, ...] = (),
) -> Path:
    """``path`` as a Path if a ``what`` may be written there, else :class:`InputError`.

    A directory artifact (``marker`` given) may replace nothing, an empty directory, or an
    earlier ``what`` (a directory holding an entry that matches the glob ``marker``, and,
    given ``members``, nothing but entries matching those globs: the files a ``what`` is
    made of, so that a user's notes beside them, or a project that happens to hold a
    ``manifest.json``, are never deleted with it); a file, or any other non-empty
    directory, is refused. A file artifact (``marker`` None)
    may replace a file, never a directory; given ``suffixes``, only an empty file or one
    whose name ends in one of them (so that ``--out prompts.jsonl`` for a JSON placement
    file does not wipe the prompts). Either kind refuses one of the command's ``inputs``, a
    directory holding one (replacing it would delete the input while the command reads it)
    and a path inside one (replacing the input later would delete the output). So a
    mistyped output path deletes nothing; nor is a read-only output replaced (its own mode
    says it is to be kept, even to root; the files inside a directory artifact are the
    artifact's, and go with it). A path under an existing file, and a directory
    artifact's path that is a symbolic link, are refused too: the write would fail once the
    work is done.
    """
    if not os.fspath(path):  # Path("") is ".", the folder the command runs in
        raise InputError(f"the output path is empty; give the path of the {what}")
    path = Path(path)
    check_place(path, inputs)
    if path.exists() and not path.stat().st_mode & 0o222:
        # root may write anything: the mode is the owner's word that this is to be kept
        raise InputError(
            f"{path}: is read-only, so it is not replaced; make it writable first or choose "
            f"another output path"
        )
    if marker is None:
        if path.is_dir():
            raise InputError(f"{path}: is a directory; a {what} is a file")
        if path.exists() and not path.is_file():  # renaming onto it would replace the device
            raise InputError(
                f"{path}: exists and is not a regular file (a device, pipe or socket); a {what} "
                f"is written as a new file there; choose another output path"
            )
        if (
            suffixes
            and path.is_file()
            and path.stat().st_size > 0
            and path.suffix.lower() not in suffixes
        ):
            raise InputError(
                f"{path}: exists and is not a {what} (a name ending in {' or '.join(suffixes)}); "
                f"choose another output path"
            )
        check_writable(path)  # last: it makes (and removes) a file beside the output
        return path
    if path.exists() and not path.is_dir():  # also a link to a file
        raise InputError(f"{path}: exists and is a file; a {what} is a directory")
    if path.is_symlink():  # the atomic write would have to replace the link by a directory
        raise InputError(
            f"{path}: is a symbolic link; give the {what} directory itself "
            f"({path.resolve()}) or another output path"
        )
    cwd = Path.cwd().resolve()
    if (here := path.resolve()) == cwd or here in cwd.parents:
        # `--out .`: the swap cannot rename the folder the command runs in (it left a
        # backup folder behind); done from outside, it would leave the shell in a deleted one
        raise InputError(
            f"{path}: is the current directory or holds it; run the command from outside it "
            "or choose another output path"
        )
    if path.is_dir() and os.path.ismount(path):
        # the swap renames the old directory away, which a mount point refuses (EBUSY):
        # found before the work, not after it
        raise InputError(
            f"{path}: is a mount point, which cannot be replaced; write the {what} to a "
            "directory inside it"
        )
    if path.is_dir() and any(path.iterdir()) and not any(path.glob(marker)):
        raise InputError(
            f"{path}: is a non-empty directory that is not a {what}; choose another output path"
        )
    if members and path.is_dir():
        foreign = sorted(
            e.name
            for e in path.iterdir()
            if not any(fnmatch.fnmatchcase(e.name, m) for m in members)
        )
        if foreign:
            shown = ", ".join(foreign[:3]) + (
                f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
            )
            raise InputError(
                f"{path}: holds {shown} besides a {what}'s own files, which replacing it would "
                "delete; move them or choose another output path"
            )
    check_writable(path)
    return path


# The file that marks each moeplan directory artifact (bundle.MANIFEST_FILE,
# predictor.MANIFEST, plan.PLAN_FILE; tests/test_atomic.py keeps them in step); a bundle's
# manifest.json is told from a project's by its "format".
_ARTIFACT_MARKERS = {"predictor.json": "predictor", "plan.json": "plan"}
_BUNDLE_MANIFEST, _BUNDLE_FORMAT = "manifest.json", "moeplan-bundle"


def artifact_holding(path: str | os.PathLike) -> str | None:
    """The moeplan artifact ``path``'s directory is ("plan DIR", "predictor DIR" or
    "moeplan bundle DIR"), or None.

    An output written into an artifact would change what its manifest describes (a bundle's
    checksums cover its engine files)."""
    folder = Path(path).absolute().parent
    for name, what in _ARTIFACT_MARKERS.items():
        if (folder / name).is_file():
            return f"{what} {folder}"
    manifest = folder / _BUNDLE_MANIFEST
    if manifest.is_file():
        try:
            is_bundle = json.loads(manifest.read_bytes()).get("format") == _BUNDLE_FORMAT
        except (OSError, ValueError, AttributeError):
            is_bundle = False
        if is_bundle:
            return f"moeplan bundle {folder}"
    return None


def check_parents(path: str | os.PathLike) -> None:
    """InputError if a directory above ``path`` is a file or a symbolic link to nothing:
    ``path`` could not be made."""
    for parent in Path(path).absolute().parents:
        if parent.exists() and not parent.is_dir():
            raise InputError(f"{path}: {parent} is a file, not a directory; choose another path")
        if parent.is_symlink() and not parent.exists():
            raise InputError(
                f"{path}: {parent} is a symbolic link to {os.readlink(parent)!r}, which does not "
                f"exist; choose another path"
            )


def check_writable(path: str | os.PathLike) -> None:
    """InputError unless a file can be made in the directory ``path`` is written from: its
    own, or the nearest existing one above it, where its missing parents would be made. A
    directory one may not write in (or /proc, /sys) failed only once the work was done,
    naming a temporary file of the atomic write."""
    folder = Path(path).absolute().parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        fd, probe = tempfile.mkstemp(prefix=".moeplan-probe.", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise InputError(
            f"{path}: cannot write in {folder} ({exc.strerror}); choose another output path"
        ) from None
    os.close(fd)
    os.unlink(probe)


def write_bytes_atomic(dest: str | os.PathLike, data: bytes) -> None:
    with atomic_path(dest) as tmp:
        tmp.write_bytes(data)


def write_json_atomic(dest: str | os.PathLike, obj: object) -> None:
    write_bytes_atomic(dest, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def read_json_object(
    file: str | os.PathLike, where: str, error: type[MoeplanError] = InputError
) -> dict:
    """The JSON object in ``file``; ``error`` in one line ("{where} is not valid JSON (...)" /
    "{where} must hold a JSON object") otherwise."""
    try:
        value = json.loads(Path(file).read_text())
    except ValueError as e:  # UnicodeDecodeError included
        raise error(f"{where} is not valid JSON ({e})") from None
    except RecursionError:  # json's decoder recurses once per nesting level
        raise error(f"{where} is not valid JSON (nested too deeply)") from None
    if not isinstance(value, dict):
        raise error(f"{where} must hold a JSON object")
    return value


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file, read in 4 MiB blocks (artifact manifests record it)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def native_stdout(log: bool = False) -> Iterator[None]:
    """Send what native code writes to file descriptor 1 elsewhere for the block: to
    descriptor 2 when ``log`` (a solver's log the user asked for), else to /dev/null.

    METIS (printf: "Cannot bisect a graph with 0 vertices!"), HiGHS through PuLP (a licence
    banner, in its child process too, which inherits the descriptor) and HiGHS through
    scipy's milp (debug lines no option silences) write there directly, past sys.stdout:
    ``--json`` output must stay JSON. What C buffered meanwhile is flushed to the sink too.
    """
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no descriptor 1 (a detached process): nothing to protect
        yield
        return
    sink = None if log else os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(2 if sink is None else sink, 1)
        yield
    finally:
        sys.stdout.flush()
        with contextlib.suppress(OSError, AttributeError, TypeError):  # no C library
            ctypes.CDLL(None).fflush(None)
        os.dup2(saved, 1)
        os.close(saved)
        if sink is not None:
            os.close(sink)
