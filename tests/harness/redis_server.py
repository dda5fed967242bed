"""A real redis-server on loopback for the shared-state tests: a free port,
nothing saved (`--save '' --appendonly no`), killed at the end. Debian's
redis-server package (.ci/run installs it)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile

from harness.wait import wait_until

BINARY = "redis-server"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, host: str = "127.0.0.1", port: int | None = None, password: str | None = None) -> None:
        if shutil.which(BINARY) is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.host, self.port, self.password = host, port or free_port(host), password
        self.dir = tempfile.mkdtemp(prefix="sluice-redis-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self) -> RedisServer:
        args = [BINARY, "--bind", self.host, "--port", str(self.port), "--save", "", "--appendonly", "no",
                "--dir", self.dir, "--protected-mode", "no"]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(self._answers, timeout=10, what=f"redis-server answering on {self.host}:{self.port}")
        return self

    def _answers(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith((b"+PONG", b"-NOAUTH"))
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
