"""docs/deploy.md, "Across clusters, start to end", run as written: the host is this machine's own non-loopback
address (in the certificate), so TLS, the token files and the probes work as across two hosts."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from diloco import exits
from liveness import wait_for

def own_address() -> str | None:
    """This machine's address on its default route (a UDP connect sends nothing); None without one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))
        except OSError:
            return None
        return s.getsockname()[0]


ADDRESS = own_address()
MISSING = next((f"`{tool}` is not installed (the recipe runs it): apt-get install {tool}"
                for tool in ("openssl", "curl") if shutil.which(tool) is None), None) or (
    None if ADDRESS else "this machine has no non-loopback IPv4 route to stand for a second host")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.needs(MISSING)]

DOC = Path(__file__).resolve().parents[2] / "docs" / "deploy.md"
HOST, IP = "syncer.example.org", "203.0.113.7"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def blocks() -> list[str]:
    text = DOC.read_text()
    section = text.split("## Across clusters, start to end", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)```", section, re.S)


def commands(block: str) -> list[str]:
    """A block's commands, continuation lines joined and comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [re.sub(r"\s+#.*$", "", line).strip() for line in joined.splitlines() if line.strip()]


def shell(command: str, cwd: Path, env: dict, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-euo", "pipefail", "-c", command], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120, **kwargs)


def test_the_cross_cluster_quickstart_runs_as_written(tmp_path):
    ip = ADDRESS
    grpc_port, http_port = free_port(), free_port()
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", OMP_NUM_THREADS="1")
    env.pop("DILOCO_TOKEN", None), env.pop("DILOCO_STATUS_TOKEN", None)
    setup, serve, learn = blocks()
    mine = lambda text: (text.replace(f"SYNCER={HOST} SYNCER_IP={IP}", f"SYNCER={ip} SYNCER_IP={ip}")  # noqa: E731
                         .replace(HOST, ip).replace(":50051", f":{grpc_port}").replace(":8080", f":{http_port}"))

    done = shell(mine(setup), tmp_path, env)
    assert done.returncode == 0, done.stderr
    assert all(oct((tmp_path / f).stat().st_mode)[-3:] == "600" for f in ("site-b.token", "status.token", "ca.key"))

    syncer_line, curl_line = commands(mine(serve))
    assert syncer_line.endswith("&") and curl_line.startswith("curl")
    # the block's shell variables, for the syncer and curl lines run on their own
    env_setup = dict(env, SYNCER=ip, SYNCER_IP=ip)
    syncer = subprocess.Popen(["bash", "-c", "exec " + syncer_line.rstrip("& ")], cwd=tmp_path, env=env_setup,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        def ready() -> bool:
            assert syncer.poll() is None, syncer.stdout.read()
            return shell(curl_line, tmp_path, env_setup).returncode == 0  # curl -f: 200 only once ready

        wait_for(ready, timeout=120)
        assert json.loads(shell(curl_line, tmp_path, env_setup).stdout)["ready"] is True

        chmod, learner_line = commands(mine(learn))
        steps = " --max-steps 6 --model tiny"
        learner = shell(f"{chmod} && {learner_line}{steps}", tmp_path, env)
        assert learner.returncode == exits.FINISHED, learner.stderr[-3000:]

        # the status line of the doc, with the status token from the environment
        status_env = dict(env, DILOCO_STATUS_TOKEN=(tmp_path / "status.token").read_text().strip())
        shown = subprocess.run([sys.executable, "-m", "diloco", "status", f"{ip}:{http_port}", "--once"], env=status_env,
                               capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0 and "site-b" in shown.stdout, shown.stderr
        refused = subprocess.run([sys.executable, "-m", "diloco", "status", f"{ip}:{http_port}", "--once"], env=env,
                                 capture_output=True, text=True, timeout=60)
        assert refused.returncode != 0

        # the same credential on the command line still joins; a wrong one is refused, not retried
        token = (tmp_path / "site-b.token").read_text().strip()
        typed = learner_line.replace("--token-file site-b.token", f"--token {token}")
        assert shell(typed + steps, tmp_path, env).returncode == exits.FINISHED
        wrong = shell(learner_line.replace("--token-file site-b.token", "--token not-it") + steps, tmp_path, env)
        assert wrong.returncode == exits.REFUSED, wrong.stderr[-2000:]
    finally:
        syncer.terminate()
        try:
            syncer.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(syncer.pid, 9)
            syncer.wait()
