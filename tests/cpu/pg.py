"""A real PostgreSQL server on loopback for the storage tests, from the binaries that the
`pgserver` wheel ships (the test extra installs it: CI needs nothing else).

PostgreSQL refuses to run as root, and CI runs as root. pgserver's own launcher handles that
by adding a user and opening every directory above its install to the world; instead we copy
the binaries (~27 MB) into a private temporary directory and run them as `nobody`, so the
machine is left as it was. The server listens on 127.0.0.1 only, on a free port, with trust
authentication (nothing but this machine can reach it), and is stopped at the end.
"""
from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


class PostgresUnavailable(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self):
        import importlib.util
        spec = importlib.util.find_spec("pgserver")   # located, not imported: its import has side effects
        if spec is None or spec.origin is None:
            raise PostgresUnavailable("the pgserver package is missing; install the test extra "
                                      "(python3 -m pip install -e '.[test]')")
        src = Path(spec.origin).parent / "pginstall"
        self.root = Path(tempfile.mkdtemp(prefix="moeforge-pg-"))
        for part in ("bin", "lib", "share"):
            shutil.copytree(src / part, self.root / part, symlinks=True)
        vendored = src.parent.parent / "pgserver.libs"   # libpq & co, renamed by auditwheel
        if vendored.is_dir():
            shutil.copytree(vendored, self.root / "vendored")
        self.data = self.root / "data"
        self.data.mkdir()
        self.port = _free_port()
        self.user = None
        if os.geteuid() == 0:
            self.user = "nobody"
            ent = pwd.getpwnam(self.user)
            os.chmod(self.root, 0o755)
            os.chown(self.data, ent.pw_uid, ent.pw_gid)
        self.env = {**os.environ, "LD_LIBRARY_PATH": f"{self.root / 'lib'}:{self.root / 'vendored'}", "LC_ALL": "C", "LANG": "C"}
        self.log = self.root / "server.log"
        self._run(["initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8"])
        if self.user:   # pg_ctl, running as that user, appends to the log
            os.close(os.open(self.log, os.O_CREAT | os.O_WRONLY, 0o644))
            ent = pwd.getpwnam(self.user)
            os.chown(self.log, ent.pw_uid, ent.pw_gid)
        opts = f"-h 127.0.0.1 -p {self.port} -k {self.data} -c max_connections=200 -c fsync=off"
        self._run(["pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", opts, "-w", "-t", "60", "start"])
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, argv: list[str]) -> None:
        exe = str(self.root / "bin" / argv[0])
        try:
            subprocess.run([exe, *argv[1:]], env=self.env, user=self.user, check=True, timeout=120,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=self.root)
        except subprocess.CalledProcessError as e:
            log = self.log.read_text() if self.log.exists() else ""
            raise PostgresUnavailable(f"{argv[0]} failed ({e.returncode}):\n{e.stdout}\n{log}") from None

    def stop(self) -> None:
        try:
            self._run(["pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop"])
        except Exception:
            pass
        time.sleep(0.2)
        shutil.rmtree(self.root, ignore_errors=True)
