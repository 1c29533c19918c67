"""Typed config schema. Hydra merges YAML onto these dataclasses, so an unknown key or a wrongly
typed value is an error at composition time, and an Enum field names its allowed values.

Torch-free: the launcher, the dry run and validation use it.
"""

from __future__ import annotations

from .choice import Choice

from dataclasses import dataclass, field
from typing import Any, List, Optional

from .dtypes import Dtype
from .fp8 import FP8Format, FP8Recipe
from .sharding import OuterStrategy, ZeroStrategy


class Backend(Choice):
    nccl = "nccl"
    gloo = "gloo"


class Dataset(Choice):
    synthetic = "synthetic"
    text = "text"
    tokens = "tokens"


class Pack(Choice):
    windows = "windows"
    documents = "documents"


class ResumeMode(Choice):
    auto = "auto"
    must = "must"
    never = "never"


class KeepBest(Choice):
    """checkpoint.keep_best: keep (a pointer to, protected from keep_last) the best checkpoint."""

    none = "none"
    val_loss = "val_loss"  # the step with the lowest validation loss (checkpoint/best.py)


class CudaGraphMode(Choice):
    none = "none"
    full_iteration = "full_iteration"


class OptimName(Choice):
    """optim.name: the update rule (components/optim.py, components/muon.py)."""

    adamw = "adamw"
    muon = "muon"  # Newton-Schulz orthogonalized momentum on 2-D weights, AdamW for the rest


class OptimImpl(Choice):
    """optim.impl: which AdamW kernel runs the update."""

    torch = "torch"  # torch.optim.AdamW: fused on CUDA, torch's default (for-loop/foreach) elsewhere
    fused = "fused"  # torch.optim.AdamW(fused=True)
    foreach = "foreach"  # torch.optim.AdamW(foreach=True)
    te_fused = "te_fused"
    # the launcher's own AdamW kernel (Triton, CUDA; components/fused_adamw.py): gradients read in
    # their own dtype (bf16 main gradients under engine.use_decoupled_grad), never written back
    triton = "triton"


class Schedule(Choice):
    """optim.schedule: the LR after the linear warm-up (components/schedule.py)."""

    cosine = "cosine"  # cosine to min_lr_ratio * lr over decay_steps
    linear = "linear"  # straight line to min_lr_ratio * lr over decay_steps
    wsd = "wsd"  # warm-up, stable at lr, then a linear decay over the last decay_fraction
    constant = "constant"  # lr after warm-up


class ACMode(Choice):
    """model.activation_checkpointing: which transformer blocks recompute their forward in backward."""

    none = "none"
    full = "full"  # every block
    selective = "selective"  # every model.ac_every-th block


class LossKernel(Choice):
    """model.loss_kernel (gpt, te_gpt, hf): how the next-token cross-entropy runs."""

    torch = "torch"  # F.cross_entropy on fp32 logits
    te_fused = "te_fused"  # gpt, te_gpt: TE's fused kernel on the bf16 logits (CUDA): no fp32 copy, fewer kernels
    chunked = "chunked"  # hf: head + cross-entropy a chunk of tokens at a time, recomputed in backward


class LauncherKind(Choice):
    torchrun = "torchrun"
    slurm = "slurm"
    pytorchjob = "pytorchjob"  # launcher=kubernetes: a Kubeflow PyTorchJob
    jobset = "jobset"  # launcher=kubernetes launcher.kind=jobset: a JobSet


# The kinds that write a job for a scheduler to run on other machines (nothing starts here).
SCHEDULED_KINDS = (LauncherKind.slurm, LauncherKind.pytorchjob, LauncherKind.jobset)
KUBERNETES_KINDS = (LauncherKind.pytorchjob, LauncherKind.jobset)


@dataclass
class MeshConfig:
    # `nodes`: one outer replica per node (launcher.nnodes), so HSDP/HFSDP shards within a node,
    # over NVLink, and reduces across nodes; on one node that is plain FSDP.
    dp_outer: Any = 1
    dp_shard: int = -1  # -1: infer from the world size
    cp: int = 1
    tp: int = 1
    # Expert parallelism (model.moe): the routed experts split over this many of the dp_shard x cp
    # ranks, tokens sent to them by all-to-all (mfsdp_launch/mesh.py); it must divide both.
    ep: int = 1
    # false: let Megatron-FSDP build its own default mesh (the seed's "ez" path).
    enabled: bool = True


@dataclass
class EngineConfig:
    """The keys every engine reads; each engine's section (engines/config.py) extends it."""

    name: str = "fsdp2"
    # Distributed backend; null picks nccl when CUDA is present, else gloo.
    backend: Optional[Backend] = None
    # Every microbatch all-reduces/reduce-scatters when true; else only the last one does.
    sync_every_microbatch: bool = False


@dataclass
class ShardingConfig:
    # A name or its number (0-3 / 0-1).
    zero_dp_strategy: ZeroStrategy = ZeroStrategy.optim_grads_params
    outer_dp_sharding_strategy: OuterStrategy = OuterStrategy.no_shard


@dataclass
class PrecisionConfig:
    # null: fp32 (resolved before the config is frozen).
    compute_dtype: Optional[Dtype] = Dtype.fp32
    main_params_dtype: Optional[Dtype] = Dtype.fp32
    main_grads_dtype: Optional[Dtype] = None
    grad_comm_dtype: Optional[Dtype] = None


@dataclass
class FP8Config:
    recipe: FP8Recipe = FP8Recipe.none
    format: FP8Format = FP8Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    margin: int = 0
    # Quantized (FP8) parameters via TE quantized_model_init.
    params: bool = False
    # Module-name globs that stay in high precision (first/last layers, the head).
    skip: List[str] = field(default_factory=list)
    # FP8 dot-product attention (TE's fp8_dpa, beta there): cuDNN runs QK^T, softmax and PV with FP8
    # inputs. Delayed or current scaling; trades attention accuracy for speed at long sequences.
    attention: bool = False
    # fused_rowwise at train.grad_accum_steps > 1: cast each weight once a step, not once a
    # micro-batch, kept in 2 bytes a weight (the whole model's Linears, unsharded) of GPU memory.
    cache_weight_casts: bool = False


class ModelLoss(Choice):
    """model=custom: how a batch becomes the loss (docs/models.md, "Batch contract")."""

    auto = "auto"  # `model` when forward takes `labels`, else `cross_entropy`
    cross_entropy = "cross_entropy"  # forward(input_ids) -> logits
    model = "model"  # forward(input_ids, labels) -> scalar loss


class PeftKind(Choice):
    """model.peft.kind: parameter-efficient fine-tuning (models/lora.py)."""

    none = "none"  # every parameter trains (or model.freeze's complement)
    lora = "lora"  # low-rank adapters on model.peft.targets; the pretrained base stays frozen
    qlora = "qlora"  # lora over a base whose linear layers are 4-bit NF4, whole on every rank (models/qlora.py)


@dataclass
class PeftConfig:
    """model.peft: LoRA adapters (the `peft` library) on the linear layers named by `targets`, for
    model=gpt and model=hf over a pretrained base; checkpoints hold the adapters only."""

    kind: PeftKind = PeftKind.none
    r: int = 8  # the adapters' rank
    alpha: float = 16.0  # their output is scaled by alpha / r
    dropout: float = 0.0  # on each adapter's input
    # Linear layers that get an adapter: a module whose name is an entry or ends with "." + entry
    # (peft's target_modules), e.g. [wqkv, wo, w_gate_up, w_down] for gpt, [q_proj, v_proj] for hf.
    targets: List[str] = field(default_factory=list)


@dataclass
class ModelConfig:
    """The keys every family reads. Each family's section extends it with its own keys (registered
    by the family's package: models/llama/config.py, toys/, custom/, hf/), so a key another family
    reads is unknown to this one."""

    name: str = "gpt"
    # TE models, custom and hf: the dtype parameters are built in; null follows
    # precision.compute_dtype (resolved).
    params_dtype: Optional[Dtype] = None
    init_on_meta: bool = False
    # Globs over parameter names; matches get requires_grad=False and no optimizer state.
    freeze: List[str] = field(default_factory=list)
    # Dotted class names overriding the factory's FSDP unit modules.
    fsdp_unit_modules: List[str] = field(default_factory=list)
    # none | full (every block) | selective (every ac_every-th block); models/activation_checkpoint.py.
    activation_checkpointing: ACMode = ACMode.none
    ac_every: int = 2
    # LoRA: {kind: lora, r, alpha, dropout, targets: [...]} (docs/models.md, "LoRA").
    peft: PeftConfig = field(default_factory=PeftConfig)


@dataclass
class OptimConfig:
    name: OptimName = OptimName.adamw
    impl: OptimImpl = OptimImpl.torch
    # AdamW's two moments: fp32, or bf16 (half the optimizer state; components/adamw.py)
    state_dtype: Dtype = Dtype.fp32
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    # Muon's momentum (optim.name=muon); beta1/beta2 stay those of its AdamW part.
    muon_momentum: float = 0.95
    schedule: Schedule = Schedule.cosine
    warmup_steps: int = 10
    # Length of the whole schedule (warm-up included); null: train.steps.
    decay_steps: Optional[int] = None
    # schedule=wsd: the last fraction of decay_steps that decays to min_lr_ratio * lr.
    decay_fraction: float = 0.2


@dataclass
class ProfileConfig:
    """torch.profiler over steps start..start+steps-1: a trace per rank in run.dir/profile/."""

    start: int = 10
    steps: int = 0  # 0: off


@dataclass
class TrainConfig:
    steps: int = 100
    micro_batch_size: int = 4
    grad_accum_steps: int = 1
    seq_len: int = 256
    log_interval: int = 10
    compile: bool = False
    # FSDP2: the sharded parameters, gradients and optimizer state live in host memory (the
    # optimizer steps on the CPU); each unit is copied to the GPU for its forward and backward.
    cpu_offload: bool = False
    seed: int = 1234
    grad_clip: Optional[float] = 1.0
    cuda_graph: CudaGraphMode = CudaGraphMode.none  # full_iteration: one replayed graph a step (docs/performance.md)
    progress: bool = True
    # At every log step, name a rank whose busy time per step is over this many times the median
    # of the others (rank/straggler.py: one all_gather of a float); 0: off.
    straggler_ratio: float = 1.5
    # The dense bf16 peak in TFLOP/s for MFU; null looks the device up, and MFU is null if unknown.
    # mfu_at_precision's FP8 peak keeps the device's FP8:bf16 ratio (core/mfu.py).
    peak_tflops: Optional[float] = None
    # Hang diagnosis: when no step completes for this many seconds, every rank prints all its
    # threads' Python stacks to stderr (again every period while stalled). null: off.
    stall_dump_s: Optional[float] = None
    # Validation (needs data.val_fraction or data.val_sources): every val_interval steps (0: only
    # at the end; a final validation always runs), val_steps micro-batches per rank each time.
    val_interval: int = 0
    val_steps: int = 10
    # Bad steps (rank/step_guard.py), checked every step before the optimizer step: a non-finite
    # loss or gradient norm is skipped (no update); max_bad_steps of them in a row roll the run back
    # to its newest checkpoint (0: the first one stops the run), the LR then x rollback_lr_scale;
    # the bad steps after max_rollbacks rollbacks stop it (exit code 5).
    max_bad_steps: int = 3
    max_rollbacks: int = 2
    rollback_lr_scale: float = 1.0
    # A loss this many standard deviations above the mean of the last 100 steps is a bad step too; null: off.
    spike_zscore: Optional[float] = None
    # e.g. {start: 10, steps: 3} or train.profile.steps=3: profile those steps (components/profiling.py);
    # steps 0 or null: off. (A node, not a None default: Hydra cannot merge a mapping into None.)
    profile: Optional[ProfileConfig] = field(default_factory=ProfileConfig)


@dataclass
class DataSource:
    # A prepared dir (manifest.json), a Megatron PREFIX(.bin/.idx), a flat .bin, or a glob of these.
    path: Optional[str] = None
    weight: float = 1.0


@dataclass
class DataConfig:
    name: Dataset = Dataset.synthetic
    # text: a file, directory or glob; null uses the Python standard library's sources.
    path: Optional[str] = None
    tokenizer: Optional[str] = None  # text: path to a local tokenizer.json; null: bytes
    cache_dir: Optional[str] = None
    max_bytes: int = 64_000_000  # text
    # tokens: token corpora mixed by weight (docs/data.md).
    sources: List[DataSource] = field(default_factory=list)
    # text|tokens: samples start anywhere (windows) or at document starts (documents).
    pack: Pack = Pack.windows
    # text|tokens, model=gpt|hf: attention stays inside each document of a sample (models/doc_attention.py).
    doc_mask: bool = False
    # tokens: split flat .bin sources into documents after this token id.
    eos_id: Optional[int] = None
    # Held-out data for validation: the last fraction of each source (text|tokens), or other sources (tokens).
    val_fraction: float = 0.0
    val_sources: List[DataSource] = field(default_factory=list)


@dataclass
class CheckpointConfig:
    interval: int = 0  # every N steps; 0: by time (interval_minutes) and at the end only
    # Also save after this many minutes of training since the last save (Lightning's
    # train_time_interval; rank 0's clock, agreed by every rank); null: by steps only.
    interval_minutes: Optional[float] = 30.0
    keep_last: int = 3
    # val_loss: a validation that beats the best so far saves its step, `checkpoints/best` points
    # at it and keep_last never rotates it away (`mfsdp-export RUN OUT --step best`).
    keep_best: KeepBest = KeepBest.none
    async_save: bool = False
    resume: ResumeMode = ResumeMode.auto
    # resume=never in a run dir with checkpoints: start over anyway, the earlier run's files moved
    # to run.dir/previous/<n>/ (never deleted). false: refused, naming the checkpoints.
    overwrite: bool = False
    # Resume although a key that decides which samples train changed (checkpoint/manifest.py
    # SAMPLE_KEYS: data sources, weights, split, seq_len, pack, seed); false: refused.
    allow_data_change: bool = False
    load_step: Optional[int] = None
    load_path: Optional[str] = None
    load_weights_only: bool = False
    save_final: bool = True


@dataclass
class RunConfig:
    name: str = "run"
    # A directory, or an object store: s3://BUCKET/PATH, gs://BUCKET/PATH (docs/checkpoints.md).
    dir: str = "runs/${run.name}"
    # Object-store run.dir only: this machine's folder for the logs, the STOP file and the frozen
    # config the ranks read; null: runs/<scheme>/<bucket>/<path> in the working directory.
    local_dir: Optional[str] = None


@dataclass
class LauncherConfig:
    kind: LauncherKind = LauncherKind.torchrun
    # A number, or `auto`: every visible GPU (2 processes on a CPU machine); resolve.py makes it a number.
    nproc_per_node: Any = 1
    # Filled by resolve when nproc_per_node was auto: what it found (the dry run and config.yaml show it).
    nproc_auto: Optional[str] = None
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: Optional[str] = None
    rdzv_id: Optional[str] = None
    max_restarts: int = 0
    dry_run: bool = False
    # slurm: write (and with submit=true, submit) an sbatch script.
    submit: bool = False
    partition: Optional[str] = None
    account: Optional[str] = None
    time_limit: str = "04:00:00"
    gpus_per_node: Optional[int] = None
    # kubernetes (pytorchjob|jobset): one pod per node running `image`; the run dir is the volume
    # claim `pvc` mounted at `pvc_mount` in every pod (sub-directory run.name); docs/sweeps_and_clusters.md.
    image: Optional[str] = None
    namespace: Optional[str] = None
    pvc: Optional[str] = None
    pvc_mount: str = "/mnt/run"
    cpus_per_node: Optional[int] = None
    memory_per_node: Optional[str] = None  # a Kubernetes quantity, e.g. 1500Gi
    # SIGTERM (a preemption, a drain) to a pod: the ranks save and stop within this many seconds.
    termination_grace_s: int = 300
    # Restarts of the job after a failure or a preemption (PyTorchJob backoffLimit, JobSet maxRestarts).
    backoff_limit: int = 3
    # Start even when the memory estimate (planner/memory.py) exceeds the GPU's memory.
    force_memory: bool = False


class WandbMode(Choice):
    online = "online"
    offline = "offline"
    disabled = "disabled"


@dataclass
class WandbConfig:
    """Weights & Biases (the `wandb` extra); a resume re-attaches to the run id kept in run.dir."""

    enabled: bool = False
    project: str = "mfsdp-launch"
    entity: Optional[str] = None
    mode: WandbMode = WandbMode.offline
    name: Optional[str] = None  # null: run.name
    tags: List[str] = field(default_factory=list)
    dir: Optional[str] = None  # null: run.dir


@dataclass
class MlflowConfig:
    """MLflow (the `mlflow` extra); null tracking_uri: a file store in run.dir/mlruns."""

    enabled: bool = False
    tracking_uri: Optional[str] = None
    experiment: str = "mfsdp-launch"
    run_name: Optional[str] = None


@dataclass
class LoggingConfig:
    tensorboard: bool = False
    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)


@dataclass
class Config:
    mesh: MeshConfig = field(default_factory=MeshConfig)
    # Typed by the engine's section (engines/config.py) when the engine group is composed.
    engine: Any = field(default_factory=EngineConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    fp8: FP8Config = field(default_factory=FP8Config)
    # Typed by the family's section (models/*/config.py) when the model group is composed.
    model: Any = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
