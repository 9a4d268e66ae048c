"""Distributed set-up of the train stage: ranks from torchrun or Slurm, the DeepSpeed engine."""

from __future__ import annotations

import logging
import os
import socket
import subprocess

import torch
from omegaconf import DictConfig

from otbflow.models.logits import check_head_logits, check_packing
from otbflow.runtime import manifest, resident
from otbflow.training.logprobs import ResponseLogprobs

log = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _slurm_master_addr() -> str:
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout.split()
        return out[0] if out else "127.0.0.1"
    except (KeyError, OSError, subprocess.SubprocessError):
        return "127.0.0.1"


def init_distributed_env() -> tuple[int, int]:
    """Set the torch.distributed variables DeepSpeed needs; returns (rank, world_size).

    - A launcher (torchrun, deepspeed) already set RANK: keep everything.
    - Under srun (SLURM_PROCID set): RANK / LOCAL_RANK / WORLD_SIZE from SLURM_PROCID /
      SLURM_LOCALID / SLURM_NTASKS, MASTER_ADDR the first node of the job, MASTER_PORT derived
      from the job id (the same on every rank).
    - Otherwise one process: rank 0 of 1 on 127.0.0.1 and a free port.

    DS_ACCELERATOR=cpu is set when there is no CUDA (before deepspeed is imported).
    """
    env = os.environ
    if "RANK" not in env and "SLURM_PROCID" in env:
        env["RANK"] = env["SLURM_PROCID"]
        env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
        env["WORLD_SIZE"] = env.get("SLURM_NTASKS", "1")
        env.setdefault("MASTER_ADDR", _slurm_master_addr())
        env.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
    elif "RANK" not in env:
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    env.setdefault("LOCAL_RANK", "0")
    if not torch.cuda.is_available():
        env.setdefault("DS_ACCELERATOR", "cpu")
    return int(env["RANK"]), int(env["WORLD_SIZE"])


def init_worker_group():
    """A train worker of several ranks (``otbflow worker train --tasks N``): ranks as for a train job
    (``init_distributed_env``), then the process group its jobs' DeepSpeed engines use, made now
    and kept for every job (DeepSpeed takes a group that exists), on the launcher's rendezvous store
    (torchrun's agent's, or rank 0's under srun). Returns (rank, world size, a store under its own
    prefix for the worker's ranks: rank 0 hands them each job through it, ``otbflow.ops.worker``)."""
    rank, world_size = init_distributed_env()
    from deepspeed.accelerator import get_accelerator
    from deepspeed.constants import default_pg_timeout as timeout  # what DeepSpeed's own init takes

    store, rank, world_size = next(torch.distributed.rendezvous("env://"))
    store.set_timeout(timeout)
    torch.distributed.init_process_group(
        get_accelerator().communication_backend_name(),
        store=torch.distributed.PrefixStore("default_pg", store),
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )
    return rank, world_size, torch.distributed.PrefixStore("otbflow-worker", store)


def broadcast_text(text: str, device) -> str:
    """Rank 0's ``text`` (ASCII, at most 255 characters) on every rank: collective."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return text
    data = torch.zeros(256, dtype=torch.uint8, device=device)
    raw = text.encode("ascii")[:255]
    data[0] = len(raw)
    data[1 : 1 + len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    torch.distributed.broadcast(data, src=0)
    values = data.cpu().tolist()
    return bytes(values[1 : 1 + values[0]]).decode("ascii")


def skip_cpu_shm_op() -> None:
    """On CPU, DeepSpeed's communication backend JIT-compiles a shared-memory all-reduce op when
    it starts (about a minute of C++ on 2 cores, in the first train job) and takes a ``lock``
    file in torch's extension cache on every load, which a killed job (preempted, ``kill -9``)
    leaves behind for every later job to wait on forever. That op serves only
    ``inference_all_reduce`` (tensor-parallel inference); training's all-reduce goes through
    torch.distributed (gloo) either way. Marked unavailable, it is neither built nor loaded."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def deepspeed_config(tc: DictConfig, world_size: int) -> dict:
    """DeepSpeed config from the train section. The accumulation boundary is set explicitly
    per mini-batch (the last one may be partial), so gradient_accumulation_steps is nominal.
    The optimizer is torch's AdamW (``torch_adam``) with its fused kernel, on a CPU as on a GPU:
    one pass that updates each element in place. Torch's default on a CPU, one tensor at a time,
    allocates two temporaries of the whole flat master partition for the denominator (ZeRO's
    master weights are one tensor; docs/workers.md gives the train worker's peak with each)."""
    return {
        "train_micro_batch_size_per_gpu": tc.micro_batch_size,
        "gradient_accumulation_steps": max(1, tc.mini_batch_size // (tc.micro_batch_size * world_size)),
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": tc.lr, "weight_decay": tc.weight_decay, "torch_adam": True, "fused": True},
        },
        "gradient_clipping": tc.max_grad_norm,
        "zero_optimization": {"stage": tc.zero_stage},
        "bf16": {"enabled": bool(tc.bf16)},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def build_engine(policy_dir: str, tc: DictConfig, world_size: int):
    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    skip_cpu_shm_op()  # before ZeRO-3's loader starts the process group; CPU-only, nothing changes on GPUs
    config = deepspeed_config(tc, world_size)
    if tc.zero_stage == 3:
        policy = load_partitioned(policy_dir, config)  # checked below, once ZeRO-3's hooks can gather it
    else:
        policy = load_fp32(policy_dir)
        check_head_logits(policy)  # on the fp32 model, before DeepSpeed casts or moves it
        if tc.packing:
            check_packing(policy)
    # Eval mode, as in the features stage: no dropout (nor any other train-only randomness), so that
    # log pi_theta at the first step is the stored log pi_old. verl keeps dropout out of RL too
    # (its supported models have zero dropout, `override_config` exists "mainly [for] dropout",
    # its Megatron attention hard-codes dropout_rate = 0.0); eval() also covers models whose
    # checkpoints do set dropout, such as GPT-2's 0.1. Gradients are unaffected by the mode.
    module = ResponseLogprobs(policy, tc.logprob_chunk_size).eval()
    engine, *_ = deepspeed.initialize(model=module, model_parameters=module.parameters(), config=config)
    if tc.zero_stage == 3:
        check_head_logits(engine.module.policy)  # partitioned: ZeRO-3's hooks gather each layer for the check
        if tc.packing:
            check_packing(engine.module.policy)
    return engine


def load_fp32(policy_dir: str):
    """The fp32 policy, whole, in this process (every rank holds all of it until DeepSpeed takes it)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(policy_dir, local_files_only=True, dtype=torch.float32)


def load_partitioned(policy_dir: str, config: dict):
    """The policy under ZeRO-3, partitioned while it loads: ``load_fp32`` while transformers'
    DeepSpeed integration (``HfDeepSpeedConfig``) is live builds the model inside
    ``deepspeed.zero.Init``, which builds each module's parameters on the device and keeps this
    rank's 1/world share of them; rank 0 alone reads the checkpoint's values (memory-mapped) and
    hands each parameter out (the other ranks read only names and shapes). No GPU ever holds the
    whole module (docs/training.md: what it costs and saves)."""
    from transformers.integrations import HfDeepSpeedConfig

    hf_ds = HfDeepSpeedConfig(config)  # transformers keeps a weak reference: ZeRO-3 while it lives
    try:
        model = load_fp32(policy_dir)
    finally:
        del hf_ds  # later loads in this process (tokenizer, the reference policy) are plain ones
    held = sum(p.ds_tensor.numel() for p in model.parameters())
    total = sum(p.ds_numel for p in model.parameters())
    log.info(
        "%s loaded partitioned (ZeRO-3): rank %d holds %d of its %d parameter elements",
        policy_dir,
        torch.distributed.get_rank(),
        held,
        total,
    )
    return model


def load_reference(path: str, device, tc: DictConfig, world_size: int):
    """The frozen reference policy of the KL term, in fp32 (whatever train.bf16 says). Whole on
    every rank's device, or under ZeRO-3 partitioned as the policy is (``load_partitioned``) and
    wrapped in a DeepSpeed engine without an optimizer, whose hooks gather each layer for its
    forward: a whole fp32 copy per GPU would not fit where ZeRO-3 is needed. Checked as the policy
    is (``build_engine``): its output head (``check_head_logits``) and, with ``train.packing``, that
    its forward keeps packed sequences apart (``check_packing``), as it scores the same packed
    micro-batches."""
    if tc.zero_stage != 3:
        ref = load_fp32(path).to(device)
    else:
        import deepspeed

        config = dict(deepspeed_config(tc, world_size), bf16={"enabled": False})
        del config["optimizer"], config["gradient_clipping"]
        ref, *_ = deepspeed.initialize(model=load_partitioned(path, config), config=config)
        ref = ref.module
    ref.eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    check_head_logits(ref)
    if tc.packing:
        check_packing(ref)
    return ref


def all_reduce(values: list[float], world_size: int, device, op: str = "sum") -> list[float]:
    if world_size == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    torch.distributed.all_reduce(
        t, op=torch.distributed.ReduceOp.SUM if op == "sum" else torch.distributed.ReduceOp.MAX
    )
    return t.tolist()


def _destroy_process_group() -> None:
    """At exit: NCCL warns about (and may leak) a process group that was never destroyed."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def param_grad_norm(module) -> float | None:
    """L2 norm of the .grad of all parameters (None when no parameter holds one, as under ZeRO)."""
    grads = [p.grad.detach().float() for p in module.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))) if grads else None


def grads_finite(module) -> bool:
    return all(bool(torch.isfinite(p.grad).all()) for p in module.parameters() if p.grad is not None)


def resident_engine(layout: dict, prev_meta: dict, policy: str):
    """The resident engine (a warm worker's; None elsewhere) where it holds exactly this job's
    inputs, in the same layout: the job that left it published --policy (the policy's manifest,
    trusted with the run's key, names that job and its weights), or the optimizer state's meta
    names the job that left it and the policy it wrote, whose digest ``check_optimizer_state`` has
    found in --policy. None otherwise: the job builds its engine from its input folders (and
    replays the updates after them: --replay-advantages)."""
    held = resident.take("train")  # otbflow.stages.train.Resident
    if held is None or held.layout != layout:
        return None
    listed = manifest.read(policy)
    if manifest.trusted(policy, listed, resident.KEY):
        if listed["job_fingerprint"] == held.job_fingerprint and listed["weights"] == held.policy_weights:
            return held.engine
    if (
        prev_meta.get("job_fingerprint") != held.job_fingerprint
        or prev_meta.get("policy_weights") != held.policy_weights
    ):
        return None
    return held.engine
