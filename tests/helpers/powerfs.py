"""PowerFS: a FUSE passthrough filesystem for tests that can lose power.

Every operation on the mount passes through to a backing directory, so a writer sees an
ordinary filesystem. Beside the live tree, the server keeps a *durable* model: what a power
loss would leave, under the strictest POSIX reading.

* A file's contents become durable on ``fsync``/``fdatasync`` of that file (FUSE ``fsync``):
  the bytes it holds at that instant. ``flush``/``close`` make nothing durable.
* A directory's entries (creates, ``mkdir``, ``unlink``, ``rmdir``, renames in or out) become
  durable on ``fsync`` of that directory (an fd opened with ``O_DIRECTORY``; FUSE
  ``fsyncdir``): the whole entry table at that instant. A file's fsync makes no entry durable.
* Both are tracked per inode, not per name: every file and directory gets an id that follows
  it across renames. ``durable_entries[dir id]`` maps names to ids, ``durable_data[file id]``
  holds bytes. An fsync of a file renamed later therefore makes its bytes durable under
  whatever name its directory durably records (possibly the old name).
* What was in the backing directory at mount time is durable (the baseline).

``cut()`` is the power loss: the server stops serving (every later operation fails with
``EIO``), closes its files, and rebuilds the backing directory from the durable model alone,
starting at the root: a durable entry naming a directory whose own entries were never made
durable comes back empty; one naming a file whose bytes were never fsynced comes back empty;
an inode no durable entry names is gone. Then the mount goes away. (A cross-directory rename
made durable in only one of its two directories can leave a directory reachable twice; it is
then materialised twice, and never inside itself.)

Persistence points are counted: each file ``fsync``, each directory ``fsyncdir`` and each
``rename``, in the order the server receives them (``log()`` lists them). ``arm(after=k)``
freezes the durable model right after the k-th point since mount (``k <= points()``
freezes at once). Frozen, the filesystem keeps serving: every later operation still
succeeds for the writer, but nothing more becomes durable, so a later ``cut()`` leaves
exactly what a power loss at that instant would (the writer just runs on a little past its
own death; the points it reaches are still counted and logged).

Limits, on purpose: regular files and directories only (no symlinks, hard links, device
nodes, xattrs); modes, owners and times pass through but are not modelled (a rebuilt tree
has default modes); durable bytes are held in the server's memory, so keep the trees small.

Usage::

    ok, reason = PowerFS.available()
    with PowerFS(backing_dir) as fs:          # the FUSE server runs in a child process
        path = os.path.join(fs.mountpoint, "x")
        ...                                    # write through fs.mountpoint
        fs.arm(after=fs.points() + 3)          # freeze after the 3rd point from now
        ...
        fs.cut()                               # backing_dir now holds the durable state only
    # unmounted here (``fusermount3 -u``, then ``-u -z``) even if the block raised

The server is this file run as a script (``python powerfs.py serve BACKING MOUNTPOINT FD``):
it serves FUSE from its main thread (libfuse's worker threads) and answers JSON-line
commands on a socket from a control thread. It needs only the standard library and
``mfusepy`` (libfuse3). When the test process goes away, the server unmounts itself.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from typing import Any

ROOT_ID = 1
FILE = "f"
DIR = "d"
POINT_KINDS = ("fsync", "fsyncdir", "rename")
FUSERMOUNT = "fusermount3"
MOUNT_TIMEOUT_S = 20.0
COMMAND_TIMEOUT_S = 60.0
_DIR_HANDLE_BASE = 1 << 40  # directory handles never collide with file descriptors


# --------------------------------------------------------------------------------------------
# The durable model (pure Python: no FUSE needed to use or test it)
# --------------------------------------------------------------------------------------------

class DurableModel:
    """The live tree and the durable tree of one mount, by inode id.

    ``live[dir id]`` and ``durable_entries[dir id]`` map entry names to ids; ``kind[id]`` is
    ``"f"`` or ``"d"``; ``durable_data[file id]`` holds the bytes made durable last.
    """

    def __init__(self) -> None:
        self.kind: dict[int, str] = {}
        self.live: dict[int, dict[str, int]] = {}
        self.durable_entries: dict[int, dict[str, int]] = {}
        self.durable_data: dict[int, bytes] = {}
        self.points: list[tuple[str, str]] = []  # (kind, what), in order
        self.freeze_after: int | None = None
        self.frozen_at: int | None = None  # number of points applied when it froze
        self._next_id = ROOT_ID

    # ---- ids and paths ----

    def _new(self, kind: str) -> int:
        ident = self._next_id
        self._next_id += 1
        self.kind[ident] = kind
        if kind == DIR:
            self.live[ident] = {}
        return ident

    @staticmethod
    def _parts(path: str) -> list[str]:
        return [p for p in path.split("/") if p]

    def resolve(self, path: str) -> int:
        ident = ROOT_ID
        for part in self._parts(path):
            ident = self.live[ident][part]
        return ident

    def _parent(self, path: str) -> tuple[int, str]:
        parts = self._parts(path)
        if not parts:
            raise ValueError("the root has no parent")
        return self.resolve("/" + "/".join(parts[:-1])), parts[-1]

    # ---- baseline ----

    def scan(self, backing: str) -> None:
        """Make everything now in ``backing`` the durable baseline (and the live tree)."""
        self.__init__()
        root = self._new(DIR)
        self._scan_dir(backing, root)

    def _scan_dir(self, path: str, ident: int) -> None:
        for entry in os.scandir(path):
            if entry.is_dir(follow_symlinks=False):
                child = self._new(DIR)
                self._scan_dir(entry.path, child)
            elif entry.is_file(follow_symlinks=False):
                child = self._new(FILE)
                with open(entry.path, "rb") as handle:
                    self.durable_data[child] = handle.read()
            else:
                continue  # not modelled: a rebuild drops it
            self.live[ident][entry.name] = child
        self.durable_entries[ident] = dict(self.live[ident])

    # ---- live changes (after the same change succeeded on the backing directory) ----

    def created(self, path: str, kind: str) -> int:
        parent, name = self._parent(path)
        existing = self.live[parent].get(name)
        if existing is not None and kind == FILE and self.kind[existing] == FILE:
            return existing  # O_CREAT of an existing file: the same inode
        ident = self._new(kind)
        self.live[parent][name] = ident
        return ident

    def removed(self, path: str) -> None:
        parent, name = self._parent(path)
        self.live[parent].pop(name, None)

    def renamed(self, old: str, new: str) -> None:
        old_parent, old_name = self._parent(old)
        new_parent, new_name = self._parent(new)
        ident = self.live[old_parent].pop(old_name)
        self.live[new_parent][new_name] = ident  # replaces (unlinks) any entry there
        self._point("rename", f"{old} -> {new}")

    # ---- persistence points ----

    def _point(self, kind: str, what: str) -> bool:
        """Count a persistence point; True when its durable effect applies (not frozen)."""
        self.points.append((kind, what))
        if self.frozen_at is not None:
            return False
        if self.freeze_after is not None and len(self.points) >= self.freeze_after:
            self.frozen_at = len(self.points)
        return True

    def arm(self, after: int) -> None:
        """Freeze the durable model right after point ``after`` (counted since mount)."""
        self.freeze_after = after
        if self.frozen_at is None and len(self.points) >= after:
            self.frozen_at = len(self.points)

    def file_synced(self, ident: int, data: bytes, what: str) -> None:
        if self._point("fsync", what):
            self.durable_data[ident] = data

    def dir_synced(self, ident: int, what: str) -> None:
        if self._point("fsyncdir", what):
            self.durable_entries[ident] = dict(self.live[ident])

    # ---- the power loss ----

    def rebuild(self, backing: str) -> dict[str, int]:
        """Replace the contents of ``backing`` with the durable tree; returns counts."""
        for name in os.listdir(backing):
            path = os.path.join(backing, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        counts = {"files": 0, "dirs": 0}
        self._materialise(ROOT_ID, backing, (ROOT_ID,), counts)
        return counts

    def _materialise(self, ident: int, path: str, ancestors: tuple[int, ...],
                     counts: dict[str, int]) -> None:
        for name, child in sorted(self.durable_entries.get(ident, {}).items()):
            target = os.path.join(path, name)
            if self.kind[child] == DIR:
                if child in ancestors:
                    continue  # a cycle only half-durable renames can make
                os.mkdir(target)
                counts["dirs"] += 1
                self._materialise(child, target, (*ancestors, child), counts)
            else:
                with open(target, "wb") as handle:
                    handle.write(self.durable_data.get(child, b""))
                counts["files"] += 1

    def status(self) -> dict[str, Any]:
        return {"points": len(self.points), "frozen_at": self.frozen_at,
                "freeze_after": self.freeze_after}


# --------------------------------------------------------------------------------------------
# The FUSE server (child process)
# --------------------------------------------------------------------------------------------

def _make_operations(mfusepy: Any, model: DurableModel, backing: str) -> Any:
    FuseOSError = mfusepy.FuseOSError

    class PowerOperations(mfusepy.Operations):
        """Passthrough to ``backing``; every change is mirrored into ``model``."""

        use_ns = True

        def __init__(self) -> None:
            self.lock = threading.RLock()
            self.dead = False  # after cut(): the power is off
            self.files: dict[int, int] = {}  # fd (the FUSE fh) -> inode id
            self.dirs: dict[int, int] = {}  # directory handle -> inode id
            self.next_dir_handle = _DIR_HANDLE_BASE
            self.ready = threading.Event()

        @contextmanager
        def op(self):
            with self.lock:
                if self.dead:
                    raise FuseOSError(errno.EIO)
                yield

        @staticmethod
        def full(path: str) -> str:
            return backing + path if path != "/" else backing

        # ---- lifecycle ----

        def init(self, path: str) -> None:
            self.ready.set()

        def power_off(self) -> dict[str, Any]:
            with self.lock:
                self.dead = True
                for fd in self.files:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
                self.files.clear()
                self.dirs.clear()
                counts = model.rebuild(backing)
                return {**model.status(), **counts}

        # ---- metadata ----

        def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
            with self.op():
                st = os.fstat(fh) if fh in self.files else os.lstat(self.full(path))
                return {"st_mode": st.st_mode, "st_nlink": st.st_nlink, "st_uid": st.st_uid,
                        "st_gid": st.st_gid, "st_size": st.st_size, "st_atime": st.st_atime_ns,
                        "st_mtime": st.st_mtime_ns, "st_ctime": st.st_ctime_ns}

        def access(self, path: str, amode: int) -> int:
            with self.op():
                if not os.access(self.full(path), amode):
                    raise FuseOSError(errno.EACCES)
                return 0

        def chmod(self, path: str, mode: int) -> int:
            with self.op():
                os.chmod(self.full(path), mode)
                return 0

        def chown(self, path: str, uid: int, gid: int) -> int:
            with self.op():
                os.chown(self.full(path), uid, gid)
                return 0

        def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
            with self.op():
                if times is None:
                    os.utime(self.full(path))
                else:
                    os.utime(self.full(path), ns=(int(times[0]), int(times[1])))
                return 0

        def statfs(self, path: str) -> dict[str, int]:
            with self.op():
                sv = os.statvfs(backing)
                return {key: getattr(sv, key) for key in (
                    "f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files",
                    "f_ffree", "f_favail", "f_namemax")}

        # ---- directories ----

        def opendir(self, path: str) -> int:
            with self.op():
                handle = self.next_dir_handle
                self.next_dir_handle += 1
                self.dirs[handle] = model.resolve(path)
                return handle

        def releasedir(self, path: str, fh: int) -> int:
            with self.lock:
                self.dirs.pop(fh, None)
                return 0

        def readdir(self, path: str, fh: int) -> list[str]:
            with self.op():
                return [".", "..", *os.listdir(self.full(path))]

        def fsyncdir(self, path: str, datasync: int, fh: int) -> int:
            with self.op():
                ident = self.dirs.get(fh)
                if ident is None:
                    ident = model.resolve(path)
                model.dir_synced(ident, path)
                return 0

        def mkdir(self, path: str, mode: int) -> int:
            with self.op():
                os.mkdir(self.full(path), mode)
                model.created(path, DIR)
                return 0

        def rmdir(self, path: str) -> int:
            with self.op():
                os.rmdir(self.full(path))
                model.removed(path)
                return 0

        def unlink(self, path: str) -> int:
            with self.op():
                os.unlink(self.full(path))
                model.removed(path)
                return 0

        def rename(self, old: str, new: str) -> int:
            with self.op():
                os.rename(self.full(old), self.full(new))
                model.renamed(old, new)
                return 0

        # ---- files ----

        def _open_backing(self, path: str, flags: int, mode: int = 0o644) -> int:
            # read access too, so that fsync can take the bytes from the same inode even
            # after an unlink; O_APPEND dropped: the kernel sends the offset to write at
            flags &= ~os.O_APPEND
            wanted = (flags & ~os.O_ACCMODE) | os.O_RDWR
            try:
                return os.open(self.full(path), wanted, mode)
            except OSError as exc:
                if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ETXTBSY):
                    raise
                return os.open(self.full(path), flags, mode)

        def create(self, path: str, mode: int, flags: int = os.O_WRONLY) -> int:
            with self.op():
                fd = self._open_backing(path, flags | os.O_CREAT, mode)
                self.files[fd] = model.created(path, FILE)
                return fd

        def open(self, path: str, flags: int) -> int:
            with self.op():
                fd = self._open_backing(path, flags)
                self.files[fd] = model.resolve(path)
                return fd

        def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
            with self.op():
                return os.pread(fh, size, offset)

        def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
            with self.op():
                return os.pwrite(fh, data, offset)

        def truncate(self, path: str, length: int, fh: int | None = None) -> int:
            with self.op():
                if fh in self.files:
                    os.ftruncate(fh, length)
                else:
                    os.truncate(self.full(path), length)
                return 0

        def flush(self, path: str, fh: int) -> int:
            with self.op():
                return 0  # not a persistence point

        def release(self, path: str, fh: int) -> int:
            with self.lock:
                if self.files.pop(fh, None) is not None:
                    os.close(fh)
                return 0

        def fsync(self, path: str, datasync: int, fh: int) -> int:
            with self.op():
                ident = self.files.get(fh)
                if ident is None:
                    ident = model.resolve(path)
                model.file_synced(ident, self._contents(path, fh), path or "<unlinked>")
                return 0

        def _contents(self, path: str, fh: int) -> bytes:
            try:
                size = os.fstat(fh).st_size
                chunks, offset = [], 0
                while offset < size:
                    chunk = os.pread(fh, size - offset, offset)
                    if not chunk:
                        break
                    chunks.append(chunk)
                    offset += len(chunk)
                return b"".join(chunks)
            except OSError as exc:
                if exc.errno != errno.EBADF:  # opened write-only: read by name
                    raise
                with open(self.full(path), "rb") as handle:
                    return handle.read()

    return PowerOperations()


def _fusermount(mountpoint: str, lazy: bool = False) -> bool:
    args = [FUSERMOUNT, "-u", "-z", mountpoint] if lazy else [FUSERMOUNT, "-u", mountpoint]
    try:
        return subprocess.run(args, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _serve(backing: str, mountpoint: str, control_fd: int) -> int:
    control = socket.socket(fileno=control_fd)
    reader = control.makefile("r", encoding="utf-8")
    send_lock = threading.Lock()

    def send(message: dict[str, Any]) -> None:
        with send_lock:
            try:
                control.sendall((json.dumps(message) + "\n").encode("utf-8"))
            except OSError:
                pass

    try:
        import mfusepy
    except Exception as exc:  # noqa: BLE001 - reported to the parent as "unavailable"
        send({"ready": False, "error": f"import mfusepy failed: {exc!r}"})
        return 2
    if getattr(mfusepy, "fuse_version_major", None) != 3:
        send({"ready": False, "error": f"mfusepy found libfuse {mfusepy.fuse_version_major}, not 3"})
        return 2

    model = DurableModel()
    model.scan(backing)
    ops = _make_operations(mfusepy, model, backing)
    stopping = threading.Event()

    def control_loop() -> None:
        if ops.ready.wait(MOUNT_TIMEOUT_S):
            send({"ready": True})
        for line in reader:
            request = json.loads(line)
            command = request["op"]
            try:
                if command == "status":
                    with ops.lock:
                        send({"ok": True, **model.status()})
                elif command == "log":
                    with ops.lock:
                        send({"ok": True, "log": [list(p) for p in model.points]})
                elif command == "arm":
                    with ops.lock:
                        model.arm(int(request["after"]))
                        send({"ok": True, **model.status()})
                elif command == "cut":
                    send({"ok": True, **ops.power_off()})
                else:
                    send({"ok": False, "error": f"unknown command {command!r}"})
            except Exception as exc:  # noqa: BLE001 - the parent raises it
                send({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        # the parent closed the socket (done, or gone): never leave a mount behind
        if not stopping.is_set() and is_mounted(mountpoint):
            _fusermount(mountpoint, lazy=True)

    threading.Thread(target=control_loop, name="powerfs-control", daemon=True).start()
    try:
        mfusepy.FUSE(ops, mountpoint, foreground=True, hard_remove=True, fsname="powerfs",
                     subtype="powerfs")
    except Exception as exc:  # noqa: BLE001 - a failed mount is "unavailable" to the parent
        send({"ready": False, "error": f"mount failed: {exc!r}"})
        return 3
    finally:
        stopping.set()
    return 0


# --------------------------------------------------------------------------------------------
# The test-side handle
# --------------------------------------------------------------------------------------------

class PowerFSError(RuntimeError):
    pass


def is_mounted(mountpoint: str) -> bool:
    escaped = mountpoint.replace("\\", "\\134").replace(" ", "\\040").replace("\t", "\\011") \
        .replace("\n", "\\012")
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as handle:
            return any(line.split()[4] == escaped for line in handle)
    except OSError:
        return os.path.ismount(mountpoint)


class PowerFS:
    """A mounted PowerFS over ``backing`` (see the module docstring)."""

    _available: tuple[bool, str] | None = None

    def __init__(self, backing: str | os.PathLike, mountpoint: str | os.PathLike | None = None) -> None:
        self.backing = os.path.abspath(os.fspath(backing))
        self._own_mountpoint = mountpoint is None
        self.mountpoint = (tempfile.mkdtemp(prefix="powerfs-mnt-") if mountpoint is None
                           else os.path.abspath(os.fspath(mountpoint)))
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._reader: Any = None
        self._errors: Any = None  # the server's stderr (a temporary file)
        self._lock = threading.Lock()
        self.last_cut: dict[str, Any] | None = None

    # ---- availability ----

    @classmethod
    def available(cls) -> tuple[bool, str]:
        """(True, "") where a PowerFS can be mounted here, else (False, why). Probed once."""
        if cls._available is None:
            cls._available = cls._probe()
        return cls._available

    @classmethod
    def _probe(cls) -> tuple[bool, str]:
        if not os.path.exists("/dev/fuse"):
            return False, "no /dev/fuse"
        try:
            os.close(os.open("/dev/fuse", os.O_RDWR))
        except OSError as exc:
            return False, f"cannot open /dev/fuse: {exc}"
        if shutil.which(FUSERMOUNT) is None:
            return False, f"{FUSERMOUNT} not found (install fuse3)"
        scratch = tempfile.mkdtemp(prefix="powerfs-probe-")
        try:
            backing = os.path.join(scratch, "backing")
            os.mkdir(backing)
            with cls(backing) as fs:
                with open(os.path.join(fs.mountpoint, "probe"), "wb") as handle:
                    handle.write(b"probe")
                    os.fsync(handle.fileno())
                if fs.points() != 1:
                    return False, "the FUSE server saw no fsync"
        except Exception as exc:  # noqa: BLE001 - any failure means "not here"
            return False, f"cannot mount a FUSE filesystem: {exc}"
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return True, ""

    # ---- mount / unmount ----

    def __enter__(self) -> PowerFS:
        try:
            self.mount()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def mounted(self) -> bool:
        return self._proc is not None

    def mount(self) -> None:
        """Start the server over the current backing directory (its contents: the baseline)."""
        if self._proc is not None:
            raise PowerFSError("already mounted")
        os.makedirs(self.mountpoint, exist_ok=True)
        parent_end, child_end = socket.socketpair()
        self._errors = tempfile.TemporaryFile()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "serve", self.backing, self.mountpoint,
                 str(child_end.fileno())],
                pass_fds=(child_end.fileno(),), stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=self._errors, start_new_session=True)
        finally:
            child_end.close()
        self._sock = parent_end
        parent_end.settimeout(MOUNT_TIMEOUT_S)
        self._reader = parent_end.makefile("r", encoding="utf-8")
        try:
            message = self._receive()
            if not message.get("ready"):
                raise PowerFSError(message.get("error") or "the FUSE server did not start")
            deadline = time.monotonic() + MOUNT_TIMEOUT_S
            while not is_mounted(self.mountpoint):
                if time.monotonic() > deadline:
                    raise PowerFSError(f"{self.mountpoint} did not appear as a mount")
                time.sleep(0.01)
        except BaseException:
            self._stop()
            raise
        parent_end.settimeout(COMMAND_TIMEOUT_S)

    def _receive(self) -> dict[str, Any]:
        try:
            line = self._reader.readline()
        except (OSError, TimeoutError) as exc:
            raise PowerFSError(f"no answer from the FUSE server: {exc}{self._stderr()}") from exc
        if not line:
            raise PowerFSError(f"the FUSE server exited{self._stderr()}")
        return json.loads(line)

    def _stderr(self) -> str:
        if self._errors is None:
            return ""
        self._errors.seek(0)
        text = self._errors.read().decode("utf-8", "replace").strip()
        return f": {text[-2000:]}" if text else ""

    def _command(self, op: str, **fields: Any) -> dict[str, Any]:
        if self._sock is None:
            raise PowerFSError("not mounted")
        with self._lock:
            self._sock.sendall((json.dumps({"op": op, **fields}) + "\n").encode("utf-8"))
            reply = self._receive()
        if not reply.get("ok"):
            raise PowerFSError(reply.get("error", "command failed"))
        return reply

    def close(self) -> None:
        """Unmount (the backing directory keeps the live state) and stop the server."""
        self._stop()
        if self._own_mountpoint:
            try:
                os.rmdir(self.mountpoint)
            except OSError:
                pass

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        lazy = False
        try:
            if is_mounted(self.mountpoint):
                for attempt in range(5):  # EBUSY while a writer's last close is in flight
                    if _fusermount(self.mountpoint) or not is_mounted(self.mountpoint):
                        break
                    time.sleep(0.05 * (attempt + 1))
                else:  # a file is still open: detach now, stop serving it below
                    lazy = _fusermount(self.mountpoint, lazy=True)
        finally:
            for closing in (self._reader, self._sock):
                try:
                    if closing is not None:
                        closing.close()
                except OSError:
                    pass
            self._reader = self._sock = None
            if lazy:
                proc.terminate()  # libfuse's handler leaves its loop
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.terminate()
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            if self._errors is not None:
                self._errors.close()
                self._errors = None
            if is_mounted(self.mountpoint):
                _fusermount(self.mountpoint, lazy=True)

    # ---- persistence points and the cut ----

    def points(self) -> int:
        """Persistence points (file fsyncs, directory fsyncs, renames) since mount."""
        return int(self._command("status")["points"])

    def log(self) -> list[tuple[str, str]]:
        """Every persistence point since mount, in order: (kind, path or "old -> new")."""
        return [(kind, what) for kind, what in self._command("log")["log"]]

    def status(self) -> dict[str, Any]:
        return self._command("status")

    def arm(self, after: int) -> None:
        """Freeze the durable model right after point ``after`` (counted since mount)."""
        self._command("arm", after=after)

    def cut(self) -> dict[str, Any]:
        """Power loss now: the backing directory becomes the durable state; unmounted after.
        Returns the server's status (points, frozen_at) and what the rebuild holds."""
        self.last_cut = self._command("cut")
        self._stop()
        return self.last_cut


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "serve":
        sys.exit(_serve(sys.argv[2], sys.argv[3], int(sys.argv[4])))
    sys.exit(f"usage: {sys.argv[0]} serve BACKING MOUNTPOINT CONTROL_FD")
