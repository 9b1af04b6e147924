"""Flower's deployment engine on 127.0.0.1: a SuperLink, two SuperNodes and `flwr run` against it.

Every process is started in its own session and killed (with its children) in a finally block.
Ports are free ports picked by the OS; FLWR_HOME is a temporary folder, so the user's Flower
config is untouched.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from proc_utils import free_port, kill_tree, wait_for_port

from server.offline import OFFLINE_ENV
from server.rounds import ServerOutcome
from server.tap import load_tapped_updates

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("flower-superlink") is None, reason="Flower CLI not installed")
def test_deployment_engine_superlink_two_supernodes(tmp_path):
    env = {**os.environ, **OFFLINE_ENV, "FLWR_HOME": str(tmp_path / "flwr-home")}
    link, node0, node1 = free_port(), free_port(), free_port()
    (tmp_path / "flwr-home").mkdir()
    (tmp_path / "flwr-home" / "config.toml").write_text(
        f'[superlink]\ndefault = "e2e"\n\n[superlink.e2e]\naddress = "127.0.0.1:{link}"\ninsecure = true\n')
    out = tmp_path / "out"
    procs: list[subprocess.Popen] = []
    logs = []

    def start(name: str, cmd: list[str]) -> None:
        log = open(tmp_path / f"{name}.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))

    try:
        # A file database: the in-memory one hit "cannot commit transaction" under concurrent pushes.
        start("superlink", ["flower-superlink", "--insecure", "--disable-runtime-dependency-installation", "--host", "127.0.0.1", "--port", str(link),
                            "--database", str(tmp_path / "state.db")])
        wait_for_port(link, 60)
        for pid, port in ((0, node0), (1, node1)):
            start(f"supernode{pid}", ["flower-supernode", "--insecure", "--superlink", f"127.0.0.1:{link}",
                                      "--host", "127.0.0.1", "--port", str(port),
                                      "--node-config", f"partition-id={pid} num-partitions=2"])
        run_config = (f"out-dir='{out}' num-server-rounds=1 server-eval=false setting='c' num-images=8 "
                      "model-kwargs='{\"depth\": 2}'")
        done = subprocess.run(["flwr", "run", str(ROOT), "e2e", "--stream", "-c", run_config], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=200)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        outcome = ServerOutcome.load(out)
        assert outcome.ok and outcome.failures == [], outcome.history
        updates = load_tapped_updates(out / "updates")
        assert [u.server_round for u in updates] == [1, 1]
        assert sorted(u.partition_id for u in updates) == [0, 1]
        assert len({u.node_id for u in updates}) == 2
        check = subprocess.run([sys.executable, "-m", "server.run", "--check", str(out)], cwd=ROOT, env=env,
                               capture_output=True, text=True, timeout=60)
        assert check.returncode == 0, check.stderr[-2000:]
    finally:
        kill_tree(procs)
        for log in logs:
            log.close()
