"""What a model family declares (torch-free) and what it builds (a ModelSpec, with torch).

A family is one file under models/: its dimensions, parameter count, FLOPs per token, activation
memory, config checks, how to build and initialize it, its FSDP unit modules and its loss. The
registry (models/__init__.py) maps `model.name` to a family; every list of model names derives
from it. Validation, the dry run, the checkpoint manifest and the worker ask the family.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, FrozenSet, List, Optional, Sequence

from ..core.errors import ConfigError
from ..core.fp8 import LINEAR_RECIPES, TE_RECIPES
from ..core.parallel import Parallel  # noqa: F401  (families declare their modes with it)
from ..core.schema import ModelConfig
from ..core.names import import_object

if TYPE_CHECKING:
    import torch
    from torch import nn


@dataclass(frozen=True)
class ModelContext:
    """The settings outside `model.*` that a family's checks need."""

    tp: int = 1
    cp: int = 1
    seq_len: int = 1
    micro_batch_size: int = 1
    fp8_recipe: str = "none"
    fp8_skip: Sequence[str] = ()
    fp8_params: bool = False
    data_name: str = "synthetic"
    engine: str = ""  # engine.name ("" when the caller does not say)
    ep: int = 1  # mesh.ep: ranks the routed experts are split over


@dataclass(frozen=True)
class Support:
    """A family's answer for one engine: what it does with tp, cp, activation checkpointing,
    document masks, FP8 and CPU offload. Validation, the memory estimate, the runtime and the
    table in docs/models.md (models/support_table.py) all read this one answer."""

    tp: str  # a Parallel mode; NONE where the family has none or the engine does not take it
    cp: str
    activation_checkpointing: bool
    doc_mask: bool
    fp8: FrozenSet[str] = frozenset()  # the fp8.recipe values it runs (TE's on TE layers, torchao's)
    cpu_offload: bool = False  # train.cpu_offload: parameters, gradients and optimizer state on the host
    expert_parallel: bool = False  # mesh.ep > 1: its routed experts split over ranks, tokens sent by all-to-all

    @property
    def splits_over_tp(self) -> bool:
        return self.tp in Parallel.SPLITTING

    @property
    def splits_sequence(self) -> bool:
        return self.cp in Parallel.SPLITTING


@dataclass
class ModelSpec:
    """Everything the engines and the loop need about a built model (nothing distributed applied)."""

    name: str
    # Constructs the model on the CURRENT default device: callers wrap it in
    # `with torch.device("meta")` for meta init, or `torch.device("cuda")`.
    build: Callable[[], "nn.Module"]
    unit_modules: tuple  # FSDP unit classes (model.fsdp_unit_modules overrides them)
    loss: Callable[["nn.Module", dict], "torch.Tensor"]  # forward on a batch -> scalar loss
    # Re-inits the params of a (possibly sharded, DTensor) model in place after meta-device init
    # + to_empty(). Call it before building the optimizer (TE FP8 params are re-created).
    init_weights: Callable[["nn.Module"], None]
    uses_tokens: bool  # batches are {"input_ids", "labels"} [B, T]
    # Toys: (generator, micro_batch_size, device) -> {"x", "y"}; None for LMs.
    synthetic_batch: Optional[Callable[["torch.Generator", int, "torch.device"], dict]]
    tokens_per_sample: int  # seq_len for LMs, 1 for toys
    num_params: int
    flops_per_token: float  # per sample for toys
    vocab_size: Optional[int] = None
    # Mixture-of-experts models: (model, applied) -> metrics (device tensors), after every step's
    # optimizer decision on every rank (a collective; models/llama/moe_stats.py). `applied`: a bool,
    # or a 0-d device flag (1.0: applied) when the verdict is read late. None: nothing to do.
    after_step: Optional[Callable[["nn.Module", object], dict]] = None
    peft_line: str = ""  # what trains, when model.peft adapted the built model (models/lora.py: adapt)


class ModelFamily:
    """Base class: override what differs. Methods take the `model` config section (`m`)."""

    name = ""
    section: type = ModelConfig  # its `model` config section (a dataclass extending ModelConfig)
    uses_tokens = True
    has_te_layers = False  # FP8 recipes act on TE layers only
    # What it does with mesh.tp / mesh.cp above 1 (a Parallel mode); an engine takes some modes
    # (engines/__init__.py), and `support` pairs the two.
    tp_mode = Parallel.NONE
    cp_mode = Parallel.NONE
    attention = True  # has attention heads that tp must divide
    # Its numbers come from a meta-device build in a short-lived process (models/custom/family.py, models/hf/__init__.py):
    # unit sizes are measured, and name globs were checked there.
    measured = False
    activation_checkpointing = False  # has blocks that model.activation_checkpointing can wrap
    # Its loss passes a batch's "doc_ids" (data.doc_mask) on to a forward that masks attention per document.
    doc_mask = False
    # model.peft (models/lora.py): takes LoRA adapters on its linear layers, over the pretrained
    # base that the key `base_key` names (`base_dir`).
    lora = False
    base_key = ""
    base_hint = ""  # what `base_key` takes, for the refusal of a LoRA without a base
    # Its matmuls are plain nn.Linear layers that the linear FP8 recipes convert (torchao_*, fused_rowwise).
    linear_fp8 = False
    # Its mixture-of-experts layers split their experts over mesh.ep (models/expert_parallel.py), and
    # what gives it those experts (the support table in docs/models.md).
    expert_parallel = False
    experts_from = ""

    def support(self, engine) -> Support:
        """What this family does under `engine` (an EngineCaps): its modes where the engine takes them."""
        fp8 = set(TE_RECIPES) if self.has_te_layers else set()
        if self.linear_fp8 and engine.linear_fp8:
            fp8 |= LINEAR_RECIPES
        return Support(tp=self.tp_mode if self.tp_mode in engine.tp_modes else Parallel.NONE,
                       cp=self.cp_mode if self.cp_mode in engine.cp_modes else Parallel.NONE,
                       activation_checkpointing=self.activation_checkpointing, doc_mask=self.doc_mask,
                       fp8=frozenset(str(r) for r in fp8),
                       # TE layers keep their own FP8 state on the device: offloading them is not wired.
                       cpu_offload=engine.cpu_offload and not self.has_te_layers,
                       expert_parallel=self.expert_parallel and engine.expert_parallel)

    def parallelize(self, model: "nn.Module", m, dims, mesh) -> None:
        """Tensor parallelism, context parallelism, then activation checkpointing, in place, on the
        built model before the engine shards it (torchtitan's parallelize_llama order). Validation
        let only what `support` answered reach here."""
        self.apply_activation_checkpointing(model, m)

    def apply_activation_checkpointing(self, model: "nn.Module", m) -> None:
        if str(m.activation_checkpointing) != "none":
            from .activation_checkpoint import apply_activation_checkpointing

            apply_activation_checkpointing(model, m.activation_checkpointing, m.ac_every)

    def spec_for(self, m, seq_len: int, tp: int = 1) -> ModelSpec:
        """The ModelSpec for a mesh of `tp`: families that build tensor-parallel layers (TE) take it."""
        return self.spec(m, seq_len)

    def check(self, m, ctx: ModelContext) -> List[str]:
        """Refuse (ConfigError) what this family cannot run; return warnings."""
        return []

    def resolve(self, m, compute_dtype) -> None:
        """Fill derived `model.*` values in place, before the config is frozen."""

    def n_heads(self, m) -> Optional[int]:
        return None

    def vocab_size(self, m) -> Optional[int]:
        return None

    def shape(self, m) -> dict:
        """The resolved fields that decide the saved tensors (checkpoint compatibility)."""
        raise NotImplementedError

    def param_count(self, m) -> int:
        raise NotImplementedError

    def flops_per_token(self, m, seq_len: int) -> float:
        raise NotImplementedError

    def activation_bytes(self, m, micro_batch_size: int, seq_len: int, bytes_per_el: int) -> int:
        raise NotImplementedError

    def matmuls(self, m, seq_len: int, linears: Optional[dict] = None) -> Optional[list]:
        """The matmuls of a token's training step (core/fp8_flops.Matmul: which run in FP8, for
        `mfu_at_precision`); None when the family cannot tell. `linears`: the built model's
        {name: (in_features, out_features)} of its nn.Linear layers, for families that measure
        rather than derive (models/measured.py)."""
        return None

    def activation_parts(self, m, micro_batch_size: int, seq_len: int, bytes_per_el: int, tp: int = 1,
                         compiled: bool = False) -> dict:
        """The memory estimate's activation lines (planner/memory.py); LLM families split off the logits
        (`compiled`: under train.compile, whose cross-entropy saves less)."""
        return {"activations": self.activation_bytes(m, micro_batch_size, seq_len, bytes_per_el), "logits": 0}

    def experts(self, m) -> int:
        """Routed experts per MoE layer; 0 for a model without experts."""
        return 0

    def expert_params(self, m) -> int:
        """Routed-expert weights (what mesh.ep splits over ranks); 0 for a model without experts."""
        return 0

    def unit_expert_params(self, m) -> int:
        """Of `largest_unit_params`, the routed-expert weights (mesh.ep gathers 1/ep of them)."""
        return 0

    def largest_unit_params(self, m) -> int:
        """Parameters of the largest FSDP unit (the most one all-gather materializes)."""
        return self.param_count(m)

    def muon_matrix_params(self, m) -> int:
        """Of the parameters, those `optim.name=muon` updates (components/muon.muon_parameters: the
        2-D weights but embeddings, head and norms), which keep one momentum buffer instead of Adam's
        two moments; 0 when the family cannot tell (the memory estimate then counts Adam for all)."""
        return 0

    def describe(self, m, seq_len: int) -> str:
        return f"{self.name} params={self.param_count(m):,} flops/token={self.flops_per_token(m, seq_len):.3e}"

    def spec(self, m, seq_len: int) -> ModelSpec:
        """Build the ModelSpec (imports torch)."""
        raise NotImplementedError

    def load_weights(self, m, model: "nn.Module", engine) -> None:
        """Fill the sharded, initialized model with weights from outside (pretrained / init_from),
        before the optimizer exists; a checkpoint resume overwrites them afterwards. A collective."""

    def base_dir(self, m) -> Optional[str]:
        """The local directory its weights start from (a pretrained base), None when initialized."""
        return None

    def modules(self, m, seq_len: int) -> dict:
        """{module name: (in_features, out_features) of a linear layer, None for another module} of
        the built model: what model.peft.targets name."""
        raise NotImplementedError

    def tokenizer_dir(self, m) -> Optional[str]:
        """A directory holding the model's own tokenizer files (mfsdp-generate), if it has one."""
        return None

    def averages_own_loss(self, m) -> bool:
        """Whether the loss is the model's own scalar mean (model=custom model.loss=model): then the
        loop cannot weigh loss-masked micro-batches per token (rank/token_weights.py)."""
        return False


def resolve_unit_modules(names: Sequence[str]) -> tuple:
    """Dotted class names ("torch.nn.Linear", "transformer_engine.pytorch.TransformerLayer") ->
    classes: the longest importable module prefix, then attributes. ConfigError naming the entry."""
    import torch.nn as nn

    classes = []
    for name in map(str, names):
        try:
            obj = import_object(name, key="model.fsdp_unit_modules")
        except ConfigError as exc:
            raise ConfigError(exc.key, f"cannot resolve {name!r} ({exc.problem})") from None
        if not (isinstance(obj, type) and issubclass(obj, nn.Module)):
            raise ConfigError("model.fsdp_unit_modules", f"{name!r} is not an nn.Module class")
        classes.append(obj)
    return tuple(classes)


def find_module(model: "nn.Module", cls: type) -> "nn.Module":
    """The `cls` instance inside a possibly wrapped model (FSDP, Megatron-FSDP, torch.compile)."""
    for module in model.modules():
        if isinstance(module, cls):
            return module
    raise TypeError(f"no {cls.__name__} inside {type(model).__name__}")
