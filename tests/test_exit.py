"""Processes that use tvm_mamba exit with code 0, every time: plain calls (forward, backward, decode) and a DDP
pair (gloo) whose workers return normally. tvm_mamba starts no thread of its own that outlives a call (TVM's
worker pool is idle between kernels); the abort this guards against, "terminate called without an active
exception", is what any thread that takes the GIL while the interpreter finalizes causes, with or without
tvm_mamba: a thread still inside a torch op, or gloo's worker thread releasing DDP's last allreduce works
(docs/modules.md, "Exit"; the DDP worker below follows its advice)."""
from __future__ import annotations

import concurrent.futures
import subprocess
import sys

PLAIN = r"""
import torch, tvm_mamba
x = torch.randn(2, 16, 40, requires_grad=True)
w = torch.randn(16, 4, requires_grad=True)
tvm_mamba.causal_conv1d_fn(x, w, activation="silu").sum().backward()
u, dt = torch.randn(2, 16, 40), torch.rand(2, 16, 40)
A, B, C = -torch.rand(16, 8), torch.randn(2, 8, 40), torch.randn(2, 8, 40)
tvm_mamba.selective_scan_fn(u, dt, A, B, C, delta_softplus=True)
state = torch.zeros(2, 16, 8)
tvm_mamba.selective_state_update(state, torch.randn(2, 16), torch.rand(2, 16), A, torch.randn(2, 8), torch.randn(2, 8))
print("done")
"""

DDP = r"""
import os, socket, sys, time, torch, torch.distributed as dist, torch.multiprocessing as mp
import tvm_mamba

def worker(rank, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    m = tvm_mamba.Mamba2(32, d_state=16, headdim=16, chunk_size=16)
    ddp = torch.nn.parallel.DistributedDataParallel(m)
    (ddp(torch.randn(2, 24, 32)) ** 2).mean().backward()
    dist.barrier()
    dist.destroy_process_group()
    # torch 2.13's gloo threads release DDP's allreduce works after the barrier has woken this thread; each
    # holds the backward's Python context (a SafePyObject) whose release takes the GIL, which aborts the
    # process if the interpreter is finalizing by then (docs/modules.md, "Exit"). Let them finish first.
    time.sleep(0.5)

if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(worker, args=(port,), nprocs=2, join=True, start_method="spawn")
    print("done")
"""


def _run(code: str, tmp) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=tmp)
    return proc.returncode, proc.stdout + proc.stderr[-1500:]


def test_plain_processes_exit_cleanly(tmp_path):
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: _run(PLAIN, tmp_path), range(6)))
    bad = [out for rc, out in results if rc != 0 or "done" not in out]
    assert not bad, bad[0]


def test_ddp_pairs_exit_cleanly(tmp_path):
    script = tmp_path / "ddp.py"
    script.write_text(DDP)
    for _ in range(2):
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr[-2000:]
