"""Opt-in (PAGEDSERVE_K8S_POD_SIM=1): the Kubernetes pod's lifecycle played on this host,
without a cluster. It starts the real server (minutes on a cold machine), so the CI suite
skips it; tests/test_kubernetes.py checks the manifests themselves."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from kubernetes_utils import FAKE_KEY, container, container_env, pod_spec, rendered
from test_docker import DOCKER
from test_server_utils import free_port


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.skipif(os.environ.get("PAGEDSERVE_K8S_POD_SIM") != "1",
                    reason="starts the real server (minutes): needs PAGEDSERVE_K8S_POD_SIM=1")
def test_pod_lifecycle_on_this_host(tmp_path):
    """What the kubelet would do, without a cluster: the rendered CPU pod's command and
    environment start the real server through docker/entrypoint.sh; /health is 503 until it
    is ready; then, with a stream in flight, the preStop hook runs while a new request
    arrives (served), SIGTERM follows, the stream still ends with [DONE] and the process
    exits 0 well inside terminationGracePeriodSeconds."""
    objs = rendered("overlays/cpu")
    c, grace = container(objs), pod_spec(objs)["terminationGracePeriodSeconds"]
    entrypoint = tmp_path / "pagedserve-entrypoint"  # the image's, before the real pagedserve
    entrypoint.write_text(f'#!/bin/sh\nexec sh "{DOCKER / "entrypoint.sh"}" "$@"\n')
    entrypoint.chmod(0o755)
    port = free_port()
    url, auth = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {FAKE_KEY}"}
    env = dict(container_env(objs), PAGEDSERVE_PORT=str(port), OMP_NUM_THREADS="1",
               HOME=os.environ.get("HOME", "/tmp"),
               PATH=f"{tmp_path}:{Path(sys.executable).parent}:/usr/bin:/bin",
               # this checkout's code and prebuilt kernels, where the caller set them
               **{k: os.environ[k] for k in ("PYTHONPATH", "PAGEDSERVE_CPU_KERNELS_LIB")
                  if k in os.environ})
    proc = subprocess.Popen([*c["command"], *c["args"]], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        statuses = set()
        deadline = time.monotonic() + 1000
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                statuses.add(status := httpx.get(url + "/health", timeout=2).status_code)
                if status == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        assert statuses <= {200, 503} and 200 in statuses, (statuses, proc.poll())
        assert httpx.get(url + "/v1/models", timeout=5).status_code == 401  # the key is on

        events: list[str] = []
        body = {"prompt": "Count with me", "max_tokens": 32, "ignore_eos": True, "stream": True}

        def stream():
            with httpx.stream("POST", url + "/v1/completions", json=body, headers=auth,
                              timeout=grace) as r:
                events.extend(line[6:] for line in r.iter_lines() if line.startswith("data: "))

        reader = threading.Thread(target=stream)
        reader.start()
        start = time.monotonic()
        while not events and time.monotonic() - start < 120:
            time.sleep(0.05)
        pre_stop = subprocess.Popen(c["lifecycle"]["preStop"]["exec"]["command"])
        r = httpx.post(url + "/v1/completions", headers=auth, timeout=120,
                       json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200  # still served during the drain
        assert pre_stop.wait(60) == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(grace) == 0
        reader.join(grace)
        assert time.monotonic() - start < grace
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
