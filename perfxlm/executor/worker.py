"""One tensor-parallel rank: a spawned process pinned to its cores, holding its shard of the model and
its share of the KV cache, running every step the engine sends.

Protocol on the pipe to the engine (pickled tuples): the worker sends ("ready", info) once its shard is
loaded; the engine answers ("init_cache", num_blocks) and the worker ("ok", None) once the cache exists;
then ("step", StepDelta) per step, answered by rank 0 with ("out", ModelRunnerOutput); ("stop",) ends it.
Any failure is sent as ("error", text) before the process exits. The worker also exits when the engine
process goes away (the pipe closes, or its parent changes) and ignores Ctrl-C, which the engine handles.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import time
import traceback
from typing import Any


def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(3)  # the engine is gone: nobody will read our results or stop us


def worker_main(rank: int, world_size: int, config: Any, conn: Any, init_method: str, cpus: list[int] | None,
                parent_pid: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True, name="perfxlm-parent-watch").start()
    comm = None
    try:
        import torch

        from perfxlm.distributed.comm import init_process_group, make_communicator
        from perfxlm.distributed.parallel_state import TPGroup
        from perfxlm.distributed.topology import bind_current_process
        from perfxlm.executor.delta import DeltaDecoder
        from perfxlm.model.layers.attention import Attention, common_head_dim
        from perfxlm.model.loader import load_model
        from perfxlm.ops import cpu_plan
        from perfxlm.worker.model_runner import ModelRunner

        threads = bind_current_process(cpus)
        resolved = config.resolved
        cpu_plan.use(resolved.cpu_plan)  # the engine's decisions (layout, GEMM, ISA tier), not this process's own
        if config.seed is not None:
            torch.manual_seed(config.seed)
        init_process_group(rank, world_size, init_method)
        comm = make_communicator(rank, world_size)
        model = load_model(config, tp=TPGroup(rank, world_size, comm))  # the parallel layers hold this rank's shard
        attn = next(m for m in model.modules() if isinstance(m, Attention))
        info = {
            "kv_bytes_per_block": ModelRunner.kv_bytes_per_block(model, resolved.block_size, resolved.kv_cache_spec),
            "comm": comm.name, "threads": threads, "cpus": cpus, "pid": os.getpid(),
            "heads": attn.num_heads, "kv_heads": attn.num_kv_heads, "head_dim": common_head_dim(model),
            "cpu_plan": cpu_plan.plan().describe(),
        }  # fmt: skip
        conn.send(("ready", info))
        kind, num_blocks = conn.recv()
        if kind != "init_cache":
            return
        runner = ModelRunner(model, num_blocks, resolved.block_size, resolved.kv_cache_spec)
        comm.barrier()
        conn.send(("ok", None))
        decoder = DeltaDecoder()
        while True:
            msg = pickle.loads(conn.recv_bytes())
            if msg[0] == "stop":
                break
            out = runner.execute(decoder.decode(msg[1]))
            if rank == 0:
                conn.send_bytes(pickle.dumps(("out", out), protocol=pickle.HIGHEST_PROTOCOL))
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass  # the engine went away or stopped us
    except BaseException as exc:
        text = f"tensor-parallel rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        try:
            conn.send(("error", text))
        except Exception:
            print(text, file=sys.stderr, flush=True)
        os._exit(1)
    finally:
        if comm is not None:
            comm.close()
    os._exit(0)  # no interpreter teardown: nothing left to flush, and no atexit wait on the process group
