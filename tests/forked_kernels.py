"""Jupyter kernels forked from one process that has already imported the book's libraries.

    python forked_kernels.py serve SOCKET                        # the zygote
    python forked_kernels.py launch SOCKET -f CONNECTION_FILE    # a kernel spec's command

Why: a chapter's kernel spends about four CPU-seconds before its first line of chapter
code runs: ipykernel starts, then the first cell imports torch, pandas, Altair, seaborn
(with scipy) and the package. tests/fill_cache.py executes every chapter, so that is over
a minute of CPU per test run, spent on the same imports. Here one process (the zygote)
imports them once (tests/preload.py) and forks a kernel per notebook: every kernel starts
as a copy of that pristine process, as tests/section_runner.py does for sections.

How: :func:`kernel_spec` writes a kernel spec whose command is ``launch``. The kernel
manager (nbclient's) starts that small process as the kernel; it asks the zygote for a
kernel with the manager's connection file, working folder and environment, forwards the
manager's signals (interrupt, terminate) to it, and exits when it exits. The forked
kernel exits if its launcher dies, so a kernel the manager kills does not linger.

What the kernel sees is what a fresh ``python -m ipykernel_launcher`` sees: the
notebook's folder as working directory, the same ``sys.path``, the manager's
environment, and ipykernel's inline plotting backend (set before matplotlib is
imported, as ipykernel does it). A zygote that cannot import a library leaves its
error in a file beside the socket, and every launcher fails at once with it: the
notebooks are then not cached, and the build executes them in fresh kernels.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from preload import import_libraries

KERNEL_NAME = "python3-forked"


@contextmanager
def zygote() -> Iterator[str]:
    """Start a zygote, and put a kernel spec for it on ``JUPYTER_PATH`` for the processes
    started inside the block; yields the spec's name (``KERNEL_NAME``)."""
    # A short folder: a socket's path has at most 107 bytes.
    with tempfile.TemporaryDirectory(prefix="kernels-") as folder:
        socket_path = Path(folder) / "zygote.sock"
        kernel_spec(Path(folder), socket_path)
        before = os.environ.get("JUPYTER_PATH")
        os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, [folder, before]))
        process = subprocess.Popen([sys.executable, __file__, "serve", str(socket_path)])
        try:
            yield KERNEL_NAME
        finally:
            process.kill()  # its kernels have exited, or exit with their launchers
            process.wait()
            if before is None:
                del os.environ["JUPYTER_PATH"]
            else:
                os.environ["JUPYTER_PATH"] = before


def kernel_spec(folder: Path, socket_path: Path) -> Path:
    """Write the kernel spec ``KERNEL_NAME`` under ``folder`` (put ``folder`` on
    ``JUPYTER_PATH``); returns its file."""
    spec = folder / "kernels" / KERNEL_NAME / "kernel.json"
    spec.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(Path(__file__).resolve()), "launch", str(socket_path)]
    spec.write_text(
        json.dumps(
            {
                "argv": [*command, "-f", "{connection_file}"],
                "display_name": "Python 3 (ipykernel)",
                "language": "python",
                "interrupt_mode": "signal",
            }
        )
    )
    return spec


def serve(socket_path: Path) -> None:
    """The zygote: import the libraries, then fork a kernel for each request. Never returns."""
    try:  # the inline backend: what ipykernel sets before a notebook imports matplotlib
        import_libraries(
            "ipykernel.kernelapp", "ipykernel.ipkernel",
            plots="module://matplotlib_inline.backend_inline",
        )  # fmt: skip
    except Exception:
        socket_path.with_suffix(".failed").write_text(traceback.format_exc())
        raise
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the system reaps the exited kernels
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    ready = socket_path.with_suffix(".binding")
    server.bind(str(ready))
    server.listen(8)
    ready.rename(socket_path)  # launchers connect only once the zygote has imported everything
    while True:
        connection, _ = server.accept()
        with connection:
            request = json.loads(connection.makefile().readline())
            pid = os.fork()
            if pid == 0:
                server.close()
                connection.close()
                become_kernel(request)
            connection.sendall(f"{pid}\n".encode())


def become_kernel(request: dict) -> None:
    """In the forked child: take the launcher's folder, environment and arguments, and
    run ipykernel. Never returns."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the kernel's subprocesses report back
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    del sys.path[0]  # this script's folder: ipykernel_launcher removes its own, the working folder
    launcher = request["launcher"]

    def follow_launcher() -> None:
        while alive(launcher):
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=follow_launcher, daemon=True).start()
    # Its parent is this zygote, not the kernel manager (JPY_PARENT_PID): watch the zygote.
    sys.argv = ["ipykernel_launcher", *request["argv"], f"--IPKernelApp.parent_handle={os.getppid()}"]
    from ipykernel import kernelapp

    try:
        kernelapp.launch_new_instance()
    finally:
        os._exit(0)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def launch(socket_path: Path, argv: list[str], wait: float = 120.0) -> int:
    """The kernel spec's command: ask the zygote for a kernel and stand for it until it exits."""
    deadline, failed = time.monotonic() + wait, socket_path.with_suffix(".failed")
    while not socket_path.exists():  # the zygote is still importing
        if failed.exists() or time.monotonic() > deadline:
            print(f"no zygote at {socket_path}\n{failed.exists() and failed.read_text()}", file=sys.stderr)
            return 1
        time.sleep(0.05)
    request = {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ), "launcher": os.getpid()}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.connect(str(socket_path))
        client.sendall(json.dumps(request).encode() + b"\n")
        kernel = int(client.makefile().readline())
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(signum, lambda number, _: os.kill(kernel, number))
    while alive(kernel):
        time.sleep(0.02)
    return 0


if __name__ == "__main__":
    role, where, *rest = sys.argv[1:]
    if role == "serve":
        serve(Path(where))
    sys.exit(launch(Path(where), rest))
