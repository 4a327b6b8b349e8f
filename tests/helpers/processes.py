"""Helpers that run real processes: a free local port, and two ranks of a gloo job on the CPU."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(**extra):
    """This process's environment without kv's or torchrun's variables, one OpenMP thread, a
    local master address, and ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KV_", "RANK", "WORLD_SIZE", "LOCAL_RANK"))}
    env.update(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", **extra)
    return env


def two_ranks(tmp_path, source: str, **env_vars: str) -> tuple[dict, dict]:
    """Run ``source`` (formatted with ``base``) as ranks 0 and 1 under gloo; each rank's last
    stdout line, as JSON."""
    script = tmp_path / "ranks.py"
    script.write_text(textwrap.dedent(source.format(base=str(tmp_path))))
    env = rank_env(WORLD_SIZE="2", MASTER_PORT=str(free_port()), **env_vars)
    procs = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(2)]
    done = []
    try:
        for p in procs:
            done.append(p.communicate(timeout=120))
    finally:
        for p in procs:
            p.kill()
            p.communicate()
    for p, (_, err) in zip(procs, done, strict=True):
        assert p.returncode == 0, err[-4000:]
    rank0, rank1 = (json.loads(stdout.strip().splitlines()[-1]) for stdout, _ in done)
    return rank0, rank1
