"""Tensor-parallel ranks 1.. as Ray actors, driven step by step by rank 0.

Rank 0 (the engine's process) decides everything: each step it broadcasts the step's
`StepInputs` (input tensors, block copies, adapter slot writes; model_runner.py) and
every rank runs it with the same `ModelRunner.run` on its shard; the collectives inside
the model (all-reduce after row-parallel projections and the embedding, all-gather of
the logits) keep the ranks in lockstep. Workers never schedule, sample or load adapters
from disk.

    rank 0                                   rank r (TPWorker actor)
    TPWorkers.start -> actors created        __init__: cheap (started = placed)
    ... group joined, shard loaded           setup(): join the group, load shard, KV,
                                                      LoRA slots, its ModelRunner
    runner.execute: send(StepInputs) ------> run(): receive, runner.write_slots,
                    runner.run <-- collectives --> runner.run, receive the next ...
    shutdown: broadcast STOP --------------> return

Inside a Ray Serve replica whose deployment reserves one placement-group bundle per
rank, worker r is placed in bundle r of the replica's group; elsewhere (offline `LLM`)
the actors go wherever Ray puts them (`ray.init()` is called if needed). A worker that
dies makes rank 0's next collective fail (or time out), which stops the engine loop.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from loraplex.platform.compute_threads import use_compute_threads
from loraplex.platform.cpu_allocator import keep_freed_memory
from loraplex.platform.model_runner import StepInputs
from loraplex.platform.parallel.group import TPGroup
from loraplex.platform.rank_builder import RankSpec, build_rank

logger = logging.getLogger(__name__)

STOP = None
"""What rank 0 broadcasts instead of a step's `StepInputs` to end the worker loops."""


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs (plain values: it crosses processes): what its rank
    builds from, and how the group meets. `port` is filled in by `TPWorkers.start` once
    rank 0's store is open."""

    rank: RankSpec
    size: int
    timeout_s: float
    num_threads: int
    num_cpus: float
    port: int = 0


@dataclass(frozen=True)
class ShardMemory:
    """Bytes one rank holds for model weights and for its KV cache, and its process."""

    rank: int
    weight_bytes: int
    kv_cache_bytes: int
    pid: int


def tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def model_weight_bytes(model: torch.nn.Module) -> int:
    """Parameter bytes, tied tensors counted once."""
    seen = {id(p): p for p in model.parameters()}
    return tensor_bytes(seen.values())


class TPWorker:
    """One tensor-parallel rank > 0 (wrapped by `ray.remote` in `TPWorkers.start`)."""

    def __init__(self, spec: WorkerSpec, rank: int) -> None:
        """Cheap, so rank 0 can tell "not scheduled" from "failed to load"."""
        use_compute_threads(spec.num_threads)
        if torch.device(spec.rank.device).type == "cpu":
            keep_freed_memory()
        self.spec = spec
        self.rank = rank
        self.device = torch.device(spec.rank.device)

    def setup(self) -> ShardMemory:
        """Joins the group (rank 0 joins at the same time), loads this rank's shard,
        allocates its KV cache and LoRA slots and builds its runner; returns the shard's
        sizes."""
        spec, rank = self.spec, self.rank
        self.group = TPGroup.connect(rank, spec.size, spec.port, self.device, spec.timeout_s)
        self.runner = build_rank(spec.rank, rank, self.group)
        logger.info("tensor-parallel rank %d/%d ready (pid %d)", rank, spec.size, os.getpid())
        return self.memory()

    def memory(self) -> ShardMemory:
        runner = self.runner
        weights, kv = model_weight_bytes(runner.model), tensor_bytes(runner.kv_caches)
        return ShardMemory(self.rank, weights, kv, os.getpid())

    @torch.inference_mode()
    def run(self) -> int:
        """Runs rank 0's steps until it sends `STOP`; returns the number of steps run."""
        use_compute_threads(self.spec.num_threads)
        steps = 0
        while True:
            inputs: StepInputs | None = self.group.broadcast_object(None, idle_wait=True)
            if inputs is STOP:
                return steps
            self.runner.write_slots(inputs.slot_writes)
            self.runner.run(inputs)
            steps += 1


def _wait_started(actors: list[Any], spec: WorkerSpec) -> None:
    """RuntimeError naming the resources when a worker actor does not start in time."""
    import ray
    from ray.exceptions import GetTimeoutError

    try:
        ray.get([actor.__ray_ready__.remote() for actor in actors], timeout=spec.timeout_s)
    except GetTimeoutError:
        gpu = " and 1 GPU" if spec.rank.device.startswith("cuda") else ""
        need = f"{spec.num_cpus} CPU{gpu}"
        raise RuntimeError(
            f"tensor-parallel workers did not start within {spec.timeout_s:.0f}s: each of "
            f"the {spec.size - 1} worker(s) needs {need} (worker_num_cpus) in this Ray cluster"
        ) from None


class TPWorkers:
    """Rank 0's handle on the worker actors: start, per-step send, health, shutdown."""

    def __init__(
        self, group: TPGroup, actors: list[Any], runs: list[Any], memory: list[ShardMemory]
    ) -> None:
        self.group = group
        self.actors = actors
        self.memory = memory
        """Each worker's shard sizes (ranks 1..)."""
        self._runs = runs
        self._stopped = False

    @classmethod
    def start(cls, spec: WorkerSpec) -> TPWorkers:
        """Starts ranks 1 .. size-1 and joins the group as rank 0 (blocks until every
        rank has joined; model loading then runs on all ranks at once)."""
        import ray
        from ray.util import get_current_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            ray.init(log_to_driver=False)
        store = TPGroup.make_store(spec.size, spec.timeout_s)
        spec = dataclasses.replace(spec, port=store.port)
        placement_group = get_current_placement_group()
        actor_class = ray.remote(TPWorker)
        actors = []
        for rank in range(1, spec.size):
            options: dict[str, Any] = {"num_cpus": spec.num_cpus, "max_restarts": 0}
            if spec.rank.device.startswith("cuda"):
                options["num_gpus"] = 1
            if placement_group is not None:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=placement_group, placement_group_bundle_index=rank
                )
            actors.append(actor_class.options(**options).remote(spec, rank))
        try:
            _wait_started(actors, spec)
            setups = [actor.setup.remote() for actor in actors]
            device = torch.device(spec.rank.device)
            group = TPGroup.connect(0, spec.size, store.port, device, spec.timeout_s, store)
            # Shard sizes are fixed once loaded; `run` then keeps each actor busy.
            memory = ray.get(setups, timeout=max(spec.timeout_s, 600.0))
        except BaseException:
            for actor in actors:
                ray.kill(actor, no_restart=True)
            raise
        runs = [actor.run.remote() for actor in actors]
        return cls(group, actors, runs, memory)

    def send(self, inputs: StepInputs) -> None:
        """Hands the workers the step rank 0 is about to run (each runs it with rank 0)."""
        self.group.broadcast_object(inputs)

    def check(self) -> None:
        """RuntimeError naming the rank when a worker's loop has ended (it died)."""
        import ray

        done, _ = ray.wait(self._runs, num_returns=len(self._runs), timeout=0)
        if not done or self._stopped:
            return
        rank = self._runs.index(done[0]) + 1
        try:
            ray.get(done[0])
            reason = "its loop returned"
        except Exception as exc:
            reason = repr(exc)
        raise RuntimeError(f"tensor-parallel worker rank {rank} stopped: {reason}")

    def shutdown(self) -> None:
        """Stops the worker loops (when they still listen) and kills the actors."""
        import ray

        if self._stopped:
            return
        try:
            self.check()
            self._stopped = True
            self.group.broadcast_object(STOP)
            ray.get(self._runs, timeout=10)
        except Exception as exc:
            logger.warning("tensor-parallel workers did not stop cleanly: %r", exc)
        self._stopped = True
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
