"""Servers on loopback for the scripts that drive them: a free port, and
waiting until a started server answers 200."""

import contextlib
import socket
import subprocess
import sys
import time
import urllib.request


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url, proc, what, timeout=180, hint=lambda: ""):
    """Polls `url` until it answers 200; exits the script if `proc` ends or
    `timeout` seconds pass (killing it), with `hint()` appended."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"{what} exited with {proc.returncode}{hint()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        time.sleep(0.3)
    proc.kill()
    sys.exit(f"{what} did not become ready{hint()}")


@contextlib.contextmanager
def tessera_serve(binary, model, *args):
    """`tessera serve` of `model` on a free loopback port, with `args`;
    yields its base URL once it answers, and stops it at the end."""
    port = free_port()
    server = subprocess.Popen([binary, "serve", "--model", model, "--port", str(port), *args],
                              stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(f"{base}/health", server, "the server", timeout=120,
                   hint=lambda: f": {server.stderr.read()}")
        yield base
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
