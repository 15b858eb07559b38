"""Tensor parallelism: one process per rank, rank 0 in the engine's process driving the others.

Every step, rank 0 broadcasts the step's plain-data input (engine/step_io.py) over a gloo group, then all ranks run
the same step: each holds its slice of every layer and its share of the KV heads, and the layers' all-reduces and
all-gathers (layers/linear.py, layers/vocab_parallel.py) meet in the middle: through shared memory for ranks spawned
on one CPU machine (distributed/shm_collectives.py), through gloo or NCCL otherwise. Every rank samples from the same
gathered logits with the same seeds, so the ranks stay in step without sending tokens back; rank 0's output is the
step's.

The other ranks are spawned here on this machine (`tensor_parallel_size` processes in all), or were started by
torchrun (on one machine or several), in which case ranks other than 0 enter `run_worker` from the command line
and never build an engine.

A rank that dies closes its sockets, so rank 0's next collective fails at once (gloo raises "Connection closed by
peer"; a shared-memory wait checks its peers every few milliseconds); the step raises WorkerDiedError (503), the
engine stops, and the server exits. `failure()` also notices a spawned worker that died while the engine was idle.
"""

from __future__ import annotations

import atexit
import base64
import logging
import os
import pickle
import socket
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass

import torch

from llmserve.config import EngineConfig, ModelConfig
from llmserve.distributed import parallel_state as ps
from llmserve.distributed import shm_collectives
from llmserve.distributed.shm_collectives import SharedMemoryCollectives
from llmserve.engine.step_io import StepInput, StepOutput
from llmserve.errors import InvalidRequestError, LLMServeError
from llmserve.executor.base import Executor, ExecutorInfo
from llmserve.gc_policy import freeze_startup_heap
from llmserve.platforms import get_platform

logger = logging.getLogger(__name__)

# How long a collective waits for a rank that neither answers nor dies (a hung process). A step of a full token
# budget on a slow CPU takes seconds, never minutes.
COLLECTIVE_TIMEOUT_S = 300.0
STARTUP_TIMEOUT_S = 120.0  # for spawned ranks to import torch and join


class WorkerDiedError(LLMServeError):
    status_code = 503
    error_type = "ServiceUnavailableError"


def check_tensor_parallel(model_config: ModelConfig, size: int) -> None:
    """The model splits over `size` ranks: every rank needs whole KV heads (with their query heads) and an equal
    slice of the MLP (layers/linear.py)."""
    kv_heads = model_config.num_key_value_heads
    if kv_heads < size:
        raise InvalidRequestError(f"the model has {kv_heads} KV heads, fewer than --tensor-parallel-size {size}: "
                                  "each rank needs at least one", "tensor_parallel_size")
    if model_config.intermediate_size % size:
        raise InvalidRequestError(f"the model's MLP width ({model_config.intermediate_size}) is not divisible by "
                                  f"--tensor-parallel-size {size}", "tensor_parallel_size")


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def torchrun_worker_rank(config: EngineConfig) -> int | None:
    """Under torchrun, this process's rank when it is one of the non-engine ranks (the CLI hands them to
    run_worker); None for rank 0 or a plain launch. Raises if torchrun's world does not match the flag."""
    if not launched_by_torchrun():
        return None
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if world != config.tensor_parallel_size:
        raise InvalidRequestError(f"torchrun started {world} processes but --tensor-parallel-size is "
                                  f"{config.tensor_parallel_size}: they must be equal", "tensor_parallel_size")
    return rank or None


def run_torchrun_worker(config: EngineConfig) -> bool:
    """Runs this process as a worker if torchrun made it a rank other than 0; False for rank 0 or a plain launch."""
    rank = torchrun_worker_rank(config)
    if rank is None:
        return False
    run_worker(config, rank, config.tensor_parallel_size, None, *_local_rank())
    return True


def _local_rank() -> tuple[int, int]:
    return int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))


@dataclass
class _Ready:
    """What a rank tells rank 0 once its model is built (or why it could not build it)."""

    kv_heads: int = 0
    error: str | None = None


def _build_runner(config: EngineConfig, model_config: ModelConfig | None, weights, platform):
    from llmserve.worker.model_runner import ModelRunner

    if model_config is None:  # a worker reads the model files itself (only paths cross the process boundary)
        from llmserve.loader import load_engine_model_files

        files = load_engine_model_files(config, load_tokenizer=False)
        model_config, weights = files.config, files.weights
    return ModelRunner(config, model_config, weights, platform=platform)


def run_worker(config: EngineConfig, rank: int, size: int, store_address: tuple[str, int] | None,
               local_rank: int, local_size: int, shm_path: str | None = None) -> None:
    """A rank other than 0: build its slice of the model, then run whatever rank 0 broadcasts until told to stop.
    store_address: rank 0's rendezvous store (spawned ranks); None: torchrun's environment. shm_path: the
    shared-memory segment for all-reduces that rank 0 made (spawned ranks on a CPU machine)."""
    platform = get_platform(config.device)
    if store_address is None:
        ps.init_tensor_parallel(rank, size, platform.dist_backend, COLLECTIVE_TIMEOUT_S, init_method="env://")
    else:
        store = torch.distributed.TCPStore(*store_address, world_size=size, is_master=False,
                                           timeout=ps.timedelta_s(STARTUP_TIMEOUT_S))
        store.set(f"joined/{rank}", "1")
        ps.init_tensor_parallel(rank, size, platform.dist_backend, COLLECTIVE_TIMEOUT_S, store=store)
    if shm_path:
        parent = os.getppid()  # rank 0, which spawned this process: while it lives, so does the step
        ps.use_shared_memory(SharedMemoryCollectives(shm_path, rank, size, lambda: os.getppid() == parent,
                                                     COLLECTIVE_TIMEOUT_S, create=False))
    ready = _Ready()
    try:
        platform.bind_rank(local_rank, local_size)
        runner = _build_runner(config, None, None, platform)
        ready.kv_heads = runner.attention.num_kv_heads
    except Exception as e:  # noqa: BLE001 - reported to rank 0, which raises it for the user
        ready.error = f"{type(e).__name__}: {e}"
    ps.gather_objects(ready)
    if ready.error:
        return
    freeze_startup_heap()  # this rank's process is llmserve's (gc_policy.py)
    while True:
        call = ps.broadcast_object()
        if call is None:
            break
        method, args = call
        if method == "execute":
            runner.execute(*args)
        elif method == "read_block":
            ps.gather_objects(runner.read_block(*args))
        elif method == "write_block":
            runner.write_block(args[0], ps.scatter_objects(None))
    ps.destroy_tensor_parallel()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, model_config: ModelConfig, weights, vocab_size: int | None = None):
        size = config.tensor_parallel_size
        if torch.distributed.is_initialized():  # torch keeps one default process group per process
            raise InvalidRequestError("this process already runs a tensor-parallel engine: shut it down "
                                      "(engine.shutdown()) before starting another", "tensor_parallel_size")
        self.platform = platform = get_platform(config.device)
        platform.resolve_deterministic(config)  # refuses what this platform cannot do, before any process starts
        self.workers: list[subprocess.Popen] = []
        self._closed = False
        self._running = False  # every rank built its model and waits in its step loop
        self._failure: str | None = None
        self._shm_path: str | None = None
        try:
            if launched_by_torchrun():
                if torchrun_worker_rank(config) is not None:
                    raise RuntimeError("torchrun ranks other than 0 run llmserve.executor.multiproc.run_worker")
                ps.init_tensor_parallel(0, size, platform.dist_backend, COLLECTIVE_TIMEOUT_S, init_method="env://")
                local_rank, local_size = _local_rank()
            else:
                self._spawn_workers(config, size, platform)
                local_rank, local_size = 0, size
            platform.bind_rank(local_rank, local_size)
            self.runner = runner = _build_runner(config, model_config, weights, platform)
            reports = ps.gather_objects(_Ready(kv_heads=runner.attention.num_kv_heads))
            self._remove_shm_file()  # every rank has mapped it by now: the mappings outlive the name
        except BaseException as e:
            self.shutdown()
            if isinstance(e, RuntimeError) and self._failure:
                raise WorkerDiedError(self._failure) from e
            raise
        errors = [f"rank {r}: {rep.error}" for r, rep in enumerate(reports) if rep.error]
        if errors:
            self.shutdown()
            raise RuntimeError("tensor-parallel workers failed to load the model: " + "; ".join(errors))
        self._running = True
        atexit.register(_shutdown_at_exit, weakref.ref(self))  # the workers leave cleanly when this process ends
        self.kv_heads_per_rank = [rep.kv_heads for rep in reports]
        self.info = ExecutorInfo.of_runner(runner, size)
        logger.info("tensor parallel: %d ranks (%s), KV heads per rank %s", size,
                    "torchrun" if not self.workers else "pids " + ", ".join(str(p.pid) for p in self.workers),
                    self.kv_heads_per_rank)

    def _spawn_workers(self, config: EngineConfig, size: int, platform) -> None:
        """Starts ranks 1.. as processes of this machine and joins them through a store that this process serves;
        a rank that exits before it joins (an import error, a bad environment) fails start-up at once."""
        port = _free_port()
        store = torch.distributed.TCPStore("127.0.0.1", port, world_size=size, is_master=True,
                                           timeout=ps.timedelta_s(STARTUP_TIMEOUT_S), wait_for_workers=False)
        shm = None
        if platform.device_is_host and shm_collectives.supported():  # CPU ranks of this machine: shared memory
            path = shm_collectives.segment_path()
            try:
                shm = SharedMemoryCollectives(path, 0, size, lambda: self.failure() is None, COLLECTIVE_TIMEOUT_S,
                                              create=True)
                self._shm_path = path
            except OSError as e:
                logger.warning("tensor parallel: no room for the shared-memory all-reduce in %s (%s); using gloo",
                               os.path.dirname(path), e)
        # Plain child processes running this module (not multiprocessing's spawn, which re-runs the user's script
        # in each child unless it is guarded by `if __name__ == "__main__"`).
        for rank in range(1, size):
            args = base64.b64encode(pickle.dumps((config, rank, size, ("127.0.0.1", port), rank, size,
                                                  self._shm_path))).decode()
            self.workers.append(subprocess.Popen([sys.executable, "-m", "llmserve.executor.rank_process", args]))
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for rank, worker in enumerate(self.workers, start=1):
            while not store.check([f"joined/{rank}"]):
                if worker.poll() is not None or time.monotonic() > deadline:
                    self._failure = self._describe_exit(rank, worker) if worker.poll() is not None else None
                    raise WorkerDiedError(self._failure or f"tensor-parallel rank {rank} did not start within "
                                          f"{STARTUP_TIMEOUT_S:.0f} s")
                time.sleep(0.05)
        ps.init_tensor_parallel(0, size, platform.dist_backend, COLLECTIVE_TIMEOUT_S, store=store)
        if shm is not None:
            ps.use_shared_memory(shm)

    def _remove_shm_file(self) -> None:
        if self._shm_path:
            try:
                os.unlink(self._shm_path)
            except FileNotFoundError:
                pass
            self._shm_path = None

    @staticmethod
    def _describe_exit(rank: int, worker: subprocess.Popen) -> str:
        code = worker.poll()
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with status {code}"
        return f"tensor-parallel rank {rank} (pid {worker.pid}) {how}; its requests cannot finish"

    def failure(self) -> str | None:
        if self._failure is None and not self._closed:
            for rank, worker in enumerate(self.workers, start=1):
                if worker.poll() is not None:
                    self._failure = self._describe_exit(rank, worker)
                    logger.error("%s", self._failure)
                    break
        return self._failure

    def _collective(self, method: str, *args):
        """Tells every rank to run `method`; a collective that fails because a rank died raises WorkerDiedError."""
        if self.failure():
            raise WorkerDiedError(self._failure)
        ps.broadcast_object((method, args))

    def _raise_if_died(self, error: BaseException) -> None:
        deadline = time.monotonic() + 2.0  # the socket closes a moment before the process is reaped
        while self.workers and self.failure() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        failure = self._failure or (f"a tensor-parallel rank stopped answering: {error}" if not self.workers else None)
        if failure:
            raise WorkerDiedError(failure) from error

    def execute(self, step: StepInput) -> StepOutput:
        try:
            self._collective("execute", step)
            return self.runner.execute(step)
        except WorkerDiedError:
            raise
        except RuntimeError as e:
            self._raise_if_died(e)
            raise

    # The spill tiers store whole blocks (every KV head), as with one rank: rank 0 gathers the ranks' heads.
    def read_block(self, block: int) -> torch.Tensor:
        try:
            self._collective("read_block", block)
            parts = ps.gather_objects(self.runner.read_block(block))
        except RuntimeError as e:
            self._raise_if_died(e)
            raise
        return torch.cat(parts, dim=3)  # [layers, 2, block_size, kv_heads, head_dim]

    def write_block(self, block: int, data: torch.Tensor) -> None:
        bounds = [0]
        for n in self.kv_heads_per_rank:
            bounds.append(bounds[-1] + n)
        parts = [data[:, :, :, a:b].contiguous() for a, b in zip(bounds, bounds[1:])]
        try:
            self._collective("write_block", block)
            mine = ps.scatter_objects(parts)
        except RuntimeError as e:
            self._raise_if_died(e)
            raise
        self.runner.write_block(block, mine)

    def add_lora(self, request) -> int:
        raise InvalidRequestError("LoRA adapters do not support tensor parallelism yet", "enable_lora")

    def remove_lora(self, lora_int_id: int) -> None:
        pass

    def pin_lora(self, lora_int_id: int, pinned: bool) -> None:
        pass

    def lora_ids(self) -> list[int]:
        return []

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._running and self._failure is None:
            try:
                ps.broadcast_object(None)  # the workers leave their loops and exit
            except RuntimeError:
                pass
        for worker in self.workers:
            try:
                worker.wait(timeout=5 if self._running else 0.01)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait(timeout=5)
        ps.destroy_tensor_parallel()
        self._remove_shm_file()
        self.platform.release_rank()


def _shutdown_at_exit(ref) -> None:
    executor = ref()
    if executor is not None:
        executor.shutdown()
