"""A Docker daemon on this host and the images the compose stack runs: the
daemon (the running one, else `dockerd` started here, installed with apt-get
when missing), the base image (python:3.11-slim if present or pullable, else a
stand-in built from Debian with debootstrap, kept between runs; the host's extra
CA certificates go into the stand-in only), a wheel folder from pip's
configuration served to builds over loopback, and the images built from
deploy/Dockerfile.*. Every command it runs is echoed, long ones with their
progress and a log under WORK."""

from __future__ import annotations

import contextlib
import functools
import http.server
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORK = Path(os.environ.get("UNDERCURRENT_COMPOSE_WORK", "/tmp/undercurrent-compose-test"))
PUBLIC_BASE = "python:3.11-slim"
STANDIN_BASE = "local/python:3.11-slim-standin"
DEBIAN_IMAGE = "local/debian:bookworm"
WHEELS_PORT = 18777
PROGRESS_EVERY_S = 20


class Failure(Exception):
    """A step that did not do what it must; the message says what was seen."""


def log(message: str) -> None:
    print(message, flush=True)


def run(cmd: list[str], *, check: bool = True, timeout: float = 600, env: dict | None = None,
        quiet: bool = False) -> subprocess.CompletedProcess:
    if not quiet:
        log("   $ " + " ".join(cmd))
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if check and result.returncode != 0:
        raise Failure(f"{cmd[0]} {cmd[1] if len(cmd) > 1 else ''} exited {result.returncode}:\n"
                      f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def run_streamed(cmd: list[str], log_file: Path, show: re.Pattern, *, env: dict | None = None,
                 timeout: float = 1800) -> str:
    """Runs a long command, writes all its output to log_file and echoes as progress
    the lines matching `show`, and the latest line when none was shown for a while.
    Returns the output."""
    log(f"   $ {' '.join(cmd)}  (full output: {log_file})")
    lines = []
    deadline = time.monotonic() + timeout
    last_shown = time.monotonic()
    with log_file.open("w") as out, subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            lines.append(line)
            if show.search(line) or time.monotonic() - last_shown > PROGRESS_EVERY_S:
                log("     " + line.rstrip()[:160])
                last_shown = time.monotonic()
            if time.monotonic() > deadline:
                proc.kill()
                raise Failure(f"{cmd[:3]} ran over {timeout:.0f} s; see {log_file}")
        code = proc.wait()
    if code != 0:
        tail = "".join(lines[-40:])
        raise Failure(f"{' '.join(cmd[:3])} exited {code}; last lines:\n{tail}")
    return "".join(lines)



# ---------------------------------------------------------------------------
# Daemon
# ---------------------------------------------------------------------------


def daemon_running() -> bool:
    if shutil.which("docker") is None:
        return False
    return run(["docker", "info"], check=False, quiet=True, timeout=30).returncode == 0


def uplink_mtu() -> int | None:
    """The MTU of the default route's interface: container traffic must fit in it."""
    try:
        for line in Path("/proc/net/route").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[1] == "00000000":
                return int(Path(f"/sys/class/net/{fields[0]}/mtu").read_text())
    except (OSError, IndexError, ValueError):
        pass
    return None


def apt_install(*packages: str) -> None:
    run(["apt-get", "update", "-qq"], timeout=300)
    run(["apt-get", "install", "-y", "-qq", *packages], timeout=600,
        env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})


def start_daemon() -> subprocess.Popen:
    if shutil.which("dockerd") is None or shutil.which("docker") is None:
        apt_install("docker.io")
    WORK.mkdir(parents=True, exist_ok=True)
    cmd = ["dockerd", "--storage-driver=overlay2"]
    mtu = uplink_mtu()
    if mtu:
        cmd.append(f"--mtu={mtu}")
    log(f"   $ {' '.join(cmd)} &  (log: {WORK / 'dockerd.log'})")
    proc = subprocess.Popen(cmd, stdout=(WORK / "dockerd.log").open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.monotonic() + 120
    while not daemon_running():
        if proc.poll() is not None:
            raise Failure(f"dockerd exited {proc.returncode}; see {WORK / 'dockerd.log'}")
        if time.monotonic() > deadline:
            raise Failure(f"dockerd did not answer within 120 s; see {WORK / 'dockerd.log'}")
        time.sleep(1)
    return proc


def stop_daemon(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()

# ---------------------------------------------------------------------------
# Base image
# ---------------------------------------------------------------------------


def image_exists(name: str) -> bool:
    return run(["docker", "image", "inspect", name], check=False, quiet=True).returncode == 0


def debian_mirror() -> str:
    """The Debian mirror apt already uses (deb822 or one-line sources)."""
    sources = list(Path("/etc/apt").glob("sources.list.d/*")) + [Path("/etc/apt/sources.list")]
    for path in sources:
        with contextlib.suppress(OSError):
            text = path.read_text()
            match = re.search(r"^URIs:\s*(\S+/debian)/?\s*$", text, re.M) or re.search(
                r"^deb\s+(?:\[[^]]*\]\s+)?(\S+/debian)/?\s+bookworm", text, re.M)
            if match:
                return match.group(1)
    return "http://deb.debian.org/debian"


def build_debian_image() -> None:
    if shutil.which("debootstrap") is None:
        apt_install("debootstrap")
    rootfs = WORK / "rootfs"
    shutil.rmtree(rootfs, ignore_errors=True)
    run_streamed(["debootstrap", "--variant=minbase", "bookworm", str(rootfs), debian_mirror()],
                 WORK / "debootstrap.log", re.compile(r"^I: (Retrieving Release|Unpacking the base|"
                                                      r"Installing core|Base system installed)"))
    log(f"   $ tar -C {rootfs} -c . | docker import - {DEBIAN_IMAGE}")
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    imported = subprocess.run(["docker", "import", "-", DEBIAN_IMAGE], stdin=tar.stdout,
                              capture_output=True, text=True)
    tar.wait()
    shutil.rmtree(rootfs, ignore_errors=True)
    if imported.returncode != 0 or tar.returncode != 0:
        raise Failure(f"docker import failed: {imported.stderr}")


def build_standin_base() -> None:
    if not image_exists(DEBIAN_IMAGE):
        build_debian_image()
    with tempfile.TemporaryDirectory(dir=WORK) as tmp:
        context = Path(tmp)
        shutil.copy(REPO / "tools" / "standin_base" / "Dockerfile", context / "Dockerfile")
        (context / "ca").mkdir()
        for cert in Path("/usr/local/share/ca-certificates").glob("**/*.crt"):
            shutil.copy(cert, context / "ca" / cert.name)
        run_streamed(["docker", "build", "--build-arg", f"DEBIAN_IMAGE={DEBIAN_IMAGE}",
                      "-t", STANDIN_BASE, str(context)],
                     WORK / "standin-build.log", re.compile(r"^Step \d+/\d+"))


def base_image(requested: str | None) -> str:
    if requested:
        if not image_exists(requested):
            run(["docker", "pull", requested], timeout=600)
        return requested
    if image_exists(PUBLIC_BASE):
        return PUBLIC_BASE
    if run(["docker", "pull", PUBLIC_BASE], check=False, timeout=120).returncode == 0:
        return PUBLIC_BASE
    if image_exists(STANDIN_BASE):
        log(f"   {PUBLIC_BASE} cannot be pulled; reusing the stand-in {STANDIN_BASE}")
        return STANDIN_BASE
    log(f"   {PUBLIC_BASE} cannot be pulled; building the stand-in {STANDIN_BASE}")
    build_standin_base()
    return STANDIN_BASE

# ---------------------------------------------------------------------------
# Wheels and images
# ---------------------------------------------------------------------------


def pip_wheel_folder() -> Path | None:
    """The first wheel folder in pip's configuration (find-links) that holds wheels."""
    result = run([sys.executable, "-m", "pip", "config", "list"], check=False, quiet=True)
    for line in result.stdout.splitlines():
        key, _, value = line.partition("=")
        if key.endswith("find-links"):
            for entry in value.strip().strip("'\"").split():
                path = Path(entry.removeprefix("file://"))
                if path.is_dir() and any(path.glob("*.whl")):
                    return path
    return None


class QuietFileHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 (the stdlib's signature)
        pass


@contextlib.contextmanager
def serve_folder(folder: Path | None):
    """An HTTP listing of the folder on loopback (pip's find-links reads it; the
    builds use the host network); yields its URL."""
    if folder is None:
        yield ""
        return
    handler = functools.partial(QuietFileHandler, directory=str(folder))
    # A fixed port when free: the URL is a build argument, and a new one each run
    # would invalidate the image's cached pip layer.
    try:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", WHEELS_PORT), handler)
    except OSError:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def build_image(dockerfile: str, tag: str, base: str, wheels_url: str = "") -> None:
    cmd = ["docker", "build", "--network", "host", "-f", str(REPO / dockerfile),
           "--build-arg", f"BASE_IMAGE={base}", "-t", tag]
    if wheels_url:
        cmd += ["--build-arg", f"WHEELS_URL={wheels_url}"]
    name = Path(dockerfile).name.replace("Dockerfile.", "")
    run_streamed([*cmd, str(REPO)], WORK / f"{name}-build.log",
                 re.compile(r"^Step \d+/\d+|^Successfully (installed|tagged)|Using cache"))
