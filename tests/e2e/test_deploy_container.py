"""The syncer's container image, for real: built from deploy/containers/Containerfile.syncer with podman, run with
its state on a mounted folder, live and ready on its probes, a learner trains against it, and `podman stop`
(SIGTERM) saves its state and final model.

Building takes minutes (torch goes into the image), so this runs only when DILOCO_CONTAINER_TEST=1, as root with a
working podman; DILOCO_CONTAINER_BUILD_ARGS adds `podman build` flags (e.g. `--build-arg BASE=...`, `--build-arg
PIP_ARGS=...` for a local index). docs/deploy.md ("Kubernetes") says how it was run here."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "localhost/diloco-syncer:test"

pytestmark = pytest.mark.timeout(1800)


def unavailable() -> str | None:
    if os.environ.get("DILOCO_CONTAINER_TEST") != "1":
        return "building the syncer image takes minutes: set DILOCO_CONTAINER_TEST=1 to run this test"
    if os.geteuid() != 0 or shutil.which("podman") is None:
        return "needs root and podman (Debian: apt-get install podman runc)"
    probe = subprocess.run(["podman", "info"], capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        return f"podman does not work here: {probe.stderr.strip().splitlines()[-1:]}"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.status


def test_the_syncer_image_serves_probes_and_a_learner_and_saves_its_state(tmp_path):
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    volumes = [arg for path in ("/opt/wheels", "/opt/pypi", "/opt/pypi-more") if Path(path).exists()
               for arg in ("-v", f"{path}:{path}:ro")]  # a machine's local package index, if it has one
    if Path("/etc/ssl/certs/ca-certificates.crt").exists():  # the host's CAs (pip --cert /host-ca.crt)
        volumes += ["-v", "/etc/ssl/certs/ca-certificates.crt:/host-ca.crt:ro"]
    build = ["podman", "build", "--network=host", *volumes, "-f", "deploy/containers/Containerfile.syncer",
             "-t", IMAGE, "."]
    build[2:2] = shlex.split(os.environ.get("DILOCO_CONTAINER_BUILD_ARGS", ""))
    built = subprocess.run(build, cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]

    state = tmp_path / "state"
    state.mkdir()
    os.chown(state, 10001, 10001)  # the image's user
    grpc_port, http_port = free_port(), free_port()
    name = f"diloco-syncer-test-{os.getpid()}"
    # the image listens on 50051/8080; with the host's network, move them to free ports with the syncer's own flags
    run = ["podman", "run", "-d", "--name", name, "--network=host", "-v", f"{state}:/state",
           "-e", "DILOCO_TOKEN=container-secret", "--entrypoint", "python3", IMAGE, "-m", "diloco", "--log-level",
           "INFO", "syncer", "--listen", f"127.0.0.1:{grpc_port}", "--http", f"127.0.0.1:{http_port}", "--state",
           "/state", "--token", "container-secret", "--fragments", "2", "--sync-every", "4"]
    subprocess.run(run, check=True, capture_output=True, timeout=120)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if get(f"http://127.0.0.1:{http_port}/readyz") == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, subprocess.run(["podman", "logs", name], capture_output=True,
                                                               text=True).stdout[-3000:]
            time.sleep(0.5)
        assert get(f"http://127.0.0.1:{http_port}/healthz") == 200

        import torch
        from torch import nn

        from diloco.learner.grpc_transport import GrpcTransport
        from diloco.learner.learner import Learner

        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(16, 8), nn.Flatten(), nn.Linear(32, 16))
        learner = Learner(model, GrpcTransport(f"127.0.0.1:{grpc_port}", token="container-secret"), "from-host")
        opt = torch.optim.AdamW(model.parameters(), 1e-2)
        for _ in range(12):
            x = torch.randint(0, 16, (4, 4))
            loss = nn.functional.cross_entropy(model(x), x.sum(1) % 16)
            opt.zero_grad()
            loss.backward()
            opt.step()
            learner.step(16, loss=loss.item())
        learner.finish()
        assert learner.applied >= 1
        stop = subprocess.run(["podman", "stop", "-t", "60", name], capture_output=True, text=True, timeout=120)
        assert stop.returncode == 0
        code = subprocess.run(["podman", "inspect", name, "--format", "{{.State.ExitCode}}"], capture_output=True,
                              text=True, timeout=60).stdout.strip()
        assert code == "0"
        final = json.loads((state / "syncer.json").read_text())
        assert final["rounds"] >= 1 and (state / "model.safetensors").exists()
    finally:
        subprocess.run(["podman", "rm", "-f", name], capture_output=True, timeout=120)
