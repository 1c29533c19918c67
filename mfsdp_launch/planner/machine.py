"""Checks that depend on the machine the launcher runs on: installed packages and GPUs."""

from __future__ import annotations

import importlib
import importlib.util
import warnings
from typing import Tuple

from ..engines import engine_caps
from ..core.errors import ConfigError
from ..core.hardware import local_gpu_count
from ..models import family
from ..core.fp8 import FP8Recipe, is_torchao, on_linears
from ..core.schema import Backend, LossKernel, OptimImpl
from ..core.names import first_line


def import_problem(module: str, probe: bool) -> str:
    """'' if `module` imports; else why not, in one line. probe=False only looks for the package."""
    try:
        if importlib.util.find_spec(module.split(".")[0]) is None:
            return "not installed"
    except (ImportError, ValueError):
        return "not installed"
    if not probe:
        return ""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            importlib.import_module(module)
    except Exception as exc:  # a half-installed TE raises RuntimeError/OSError, not ImportError
        first = first_line(exc)[:200]
        return f"installed but broken ({type(exc).__name__}: {first})"
    return ""


def check_installs(cfg, probe: bool) -> None:
    """The engine, Transformer Engine and TensorBoard import, before any process is spawned."""
    wanted = []
    if cfg.engine.name == "megatron_fsdp":
        wanted.append(("engine", "engine=megatron_fsdp", "megatron_fsdp", "pip install 'megatron-fsdp>=0.6.1'"))
    te_users = [("model", f"model={cfg.model.name}", family(cfg.model.name).has_te_layers),
                ("fp8.recipe", f"fp8.recipe={cfg.fp8.recipe}",
                 cfg.fp8.recipe != FP8Recipe.none and not on_linears(cfg.fp8.recipe)),
                ("optim.impl", "optim.impl=te_fused", cfg.optim.impl == OptimImpl.te_fused),
                ("model.loss_kernel", "model.loss_kernel=te_fused", uses_fused_loss(cfg))]
    for key, what, used in te_users:
        if used:
            wanted.append((key, what, "transformer_engine.pytorch", "pip install 'mfsdp-launch[te]'"))
            break
    if is_torchao(cfg.fp8.recipe):
        wanted.append(("fp8.recipe", f"fp8.recipe={cfg.fp8.recipe}", "torchao.float8", "pip install 'mfsdp-launch[torchao]'"))
    if cfg.optim.impl == OptimImpl.triton:
        wanted.append(("optim.impl", "optim.impl=triton", "triton", "pip install triton"))
    if cfg.fp8.recipe == FP8Recipe.fused_rowwise:
        wanted.append(("fp8.recipe", "fp8.recipe=fused_rowwise", "triton", "pip install triton"))
        if family(cfg.model.name).expert_params(cfg.model):  # the experts' FP8 grouped GEMM is torchao's
            wanted.append(("fp8.recipe", "fp8.recipe=fused_rowwise with a mixture of experts",
                           "torchao.prototype.moe_training", "pip install 'mfsdp-launch[torchao]'"))
    if cfg.logging.tensorboard:  # (torch.utils.tensorboard imports it)
        wanted.append(("logging.tensorboard", "logging.tensorboard=true", "tensorboard",
                       "pip install tensorboard, or logging.tensorboard=false"))
    for key, what, module, fix in wanted:
        problem = import_problem(module, probe)
        if problem:
            raise ConfigError(key, f"{what} needs {module}, which is {problem}; {fix}")
    if getattr(cfg.engine, "nccl_ub", False) and cfg.engine.name == "megatron_fsdp":
        # Megatron-FSDP allocates its registered buffers through either package's NCCL allocator.
        found = [m for m in ("megatron.core.nccl_allocator", "apex.contrib.nccl_allocator") if not import_problem(m, probe)]
        if not found:
            raise ConfigError("engine.nccl_ub", "needs megatron.core.nccl_allocator or apex.contrib.nccl_allocator, "
                              "neither imports; pip install megatron-core", "false")


def needs_cuda(cfg) -> Tuple[str, str]:
    """(the key, why this config needs CUDA GPUs), or ("", "") if it can run on CPU."""
    if engine_caps(cfg.engine.name).needs_cuda:
        return "engine", f"engine={cfg.engine.name} runs on CUDA + NCCL only"
    if family(cfg.model.name).has_te_layers:
        return "model", f"model={cfg.model.name} (Transformer Engine) needs CUDA"
    if uses_fused_loss(cfg):
        return "model.loss_kernel", "model.loss_kernel=te_fused (a Triton kernel) needs CUDA"
    if cfg.optim.impl == OptimImpl.triton:
        return "optim.impl", "optim.impl=triton (a Triton kernel) needs CUDA"
    if cfg.engine.backend == Backend.nccl:
        return "engine.backend", "engine.backend=nccl needs CUDA"
    return "", ""


def uses_fused_loss(cfg) -> bool:
    """model.loss_kernel=te_fused (a Llama-family key): TE's Triton cross-entropy (TE, CUDA, no
    CUDA-graph capture)."""
    return cfg.model.get("loss_kernel") == LossKernel.te_fused


def check_fused_optim(cfg) -> None:
    """optim.impl=fused on a CPU run: torch's fused AdamW must step on the CPU (torch >= 2.4)."""
    if cfg.optim.impl != OptimImpl.fused or (local_gpu_count() and cfg.engine.backend != Backend.gloo):
        return
    from ..components.optim import fused_adamw_problem

    problem = fused_adamw_problem("cpu")
    if problem:
        raise ConfigError("optim.impl", f"fused: this torch has no fused AdamW on the CPU ({problem[:160]})",
                          "torch|foreach")


def refuse_gpu_only(cfg, where: str) -> None:
    """One line for a setting that only means something on a GPU, on a run that is on the CPU
    (`where` says how we know): nothing to offload, no FP8 matmuls."""
    if cfg.train.cpu_offload:
        raise ConfigError("train.cpu_offload", f"true moves the sharded state from the GPU to host memory, but "
                          f"{where}: there it lives in host memory already", "false")
    if on_linears(cfg.fp8.recipe):
        raise ConfigError("fp8.recipe", f"{cfg.fp8.recipe}: FP8 training runs FP8 matmuls on CUDA GPUs of "
                          f"compute capability 8.9+; {where}", "none")
    if cfg.optim.impl == OptimImpl.triton:
        raise ConfigError("optim.impl", f"triton steps with a Triton kernel on CUDA tensors; {where}",
                          "torch|fused|foreach")


def check_gpus(cfg) -> None:
    key, why = needs_cuda(cfg)
    gpus = local_gpu_count()
    if why and gpus == 0:
        raise ConfigError(key, f"no CUDA GPU on this machine: {why}",
                          "engine=fsdp2 with a non-TE model for the CPU path, or launcher.dry_run=true")
    if gpus and (why or cfg.engine.backend != Backend.gloo) and cfg.launcher.nproc_per_node > gpus:
        raise ConfigError("launcher.nproc_per_node", f"{cfg.launcher.nproc_per_node} processes but "
                          f"only {gpus} GPUs here", f"1..{gpus}")
