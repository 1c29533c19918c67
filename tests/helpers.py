"""What the tests share: the CLI as a subprocess, the run dir's metrics, refusals, a user's model
module, small prepared corpora, and gloo process groups (N ranks in child processes, or one in
this process). Imported as `helpers` (pytest puts tests/, conftest.py's folder, on sys.path).

A rank child is a fork of a server that has imported torch once (forked.py); it runs
rank_main(): imports the test file by path, joins a gloo group over TCP and calls the named
function as fn(rank, world, *args)."""

from __future__ import annotations

import contextlib
import json
import logging
import importlib.util
import inspect
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from mfsdp_launch.launcher.runstate import read_metrics  # noqa: F401  (the launcher's reader of metrics.jsonl)

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------- the CLI


def cli_env() -> dict:
    """The environment of a user's shell running this checkout's CLI."""
    # A user's shell is not inside a job: drop any rank/rendezvous variables the test process has.
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS and not k.startswith("SLURM_")
           and not k.startswith("TORCHELASTIC_")}
    env.setdefault("MFSDP_CACHE_DIR", str(ROOT / ".pytest_cache" / "tokens"))
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def cli(*args: str, module: str = "mfsdp_launch", cwd=None, timeout: float = 600,
        env=None) -> subprocess.CompletedProcess:
    """Run `python -m MODULE ARGS` (the launcher unless told) the way a user would, capturing its output."""
    full_env = cli_env()
    if env:
        full_env.update(env)
    # The launcher in a fork that has imported it (forked.py); same code path. Not where the caller
    # changes PYTHONPATH: the interpreter reads it (and its sitecustomize) at start-up only.
    if module == "mfsdp_launch" and "PYTHONPATH" not in (env or {}):
        import forked

        return forked.run_module(module, args, cwd=cwd or ROOT, env=full_env, timeout=timeout)
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd or ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def cli_ok(*args: str, **kw) -> subprocess.CompletedProcess:
    """cli(), asserting exit code 0 (the failure shows the output's tails)."""
    out = cli(*args, **kw)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


# A fast cpu_smoke run: short sequences, a small slice of the stdlib text, a row every step.
SMOKE = ["+recipe=cpu_smoke", "train.log_interval=1", "train.progress=false", "train.seq_len=64",
         "data.max_bytes=2000000"]


def smoke_run(run_dir, *overrides: str, expect: int = 0) -> subprocess.CompletedProcess:
    """A SMOKE run in `run_dir`, asserting its exit code (the failure shows the output's tails)."""
    out = cli(*SMOKE, f"run.dir={run_dir}", *overrides, timeout=300)
    assert out.returncode == expect, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def start_cli(*args: str, env=None, **popen) -> subprocess.Popen:
    """The launcher started in the background (text mode; pass stdout/stderr)."""
    full_env = cli_env()
    if env:
        full_env.update(env)
    return subprocess.Popen([sys.executable, "-m", "mfsdp_launch", *args], cwd=ROOT, env=full_env, text=True,
                            **popen)


def cli_error(result: subprocess.CompletedProcess, tool: str = "mfsdp-train") -> str:
    """The one line a refused command prints (exit code 2, no traceback), prefix included."""
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{tool}: error: "), result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    return lines[0]


# -------------------------------------------------------------------------------- config refusals


def refused(*overrides: str, hardware: bool = False):
    """The ConfigError planner.prepare raises for these overrides (fails the test if none)."""
    import pytest

    from mfsdp_launch.core.errors import ConfigError
    from mfsdp_launch.planner import prepare

    with pytest.raises(ConfigError) as e:
        prepare(list(overrides), check_hardware=hardware)
    return e.value


def one_line(exc_info, key: str) -> str:
    """The message of a raised ConfigError (pytest.raises's ExceptionInfo): one line naming `key`."""
    msg = str(exc_info.value)
    assert "\n" not in msg and msg.startswith(key + ": "), msg
    return msg


# ------------------------------------------------------------------------------------- metrics


def train_rows(run_dir) -> dict:
    """{step: row} of the training rows (those with a loss; validation may be merged into them)."""
    return {r["step"]: r for r in read_metrics(run_dir) if "loss" in r}


def losses(run_dir) -> dict:
    """{step: loss} of the training rows."""
    return {step: r["loss"] for step, r in train_rows(run_dir).items()}


def one_process_checkpoints(run_dir, sizes=(64, 256, 8), lr=1e-3, **checkpoint_keys):
    """(model, AdamW, TrainState, CheckpointManager) of a seeded MLP of `sizes` (in, hidden, out) in
    this process: real DCP under FSDP2Engine with no mesh, the manager over `run_dir`."""
    import torch
    import torch.nn as nn

    from mfsdp_launch import checkpoint
    from mfsdp_launch.core.schema import CheckpointConfig
    from mfsdp_launch.engines.fsdp2 import FSDP2Engine
    from mfsdp_launch.rank.loop import TrainState

    torch.manual_seed(0)
    d_in, hidden, d_out = sizes
    model = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, d_out))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    engine = FSDP2Engine(engine_cfg=None, sharding_cfg=None, precision_cfg=None, dims=None, mesh=None,
                         device=torch.device("cpu"))
    info = {"model": {"name": "mlp", "shape": {"hidden": hidden}}, "engine": {"name": "fsdp2"}, "seed": 3}
    mgr = checkpoint.CheckpointManager(CheckpointConfig(**checkpoint_keys), run_dir, manifest_info=info, rank=0,
                                       world_size=1, engine=engine)
    return model, opt, TrainState(), mgr


# ------------------------------------------------------------------------------ a user's module

USER_MODULE_NAME = "mfsdp_test_usermodel"
# The README's mymodel.py, with a build() that takes its sizes and one attribute that is not callable.
USER_MODULE = '''
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        return x + self.ff(self.norm(x))


class LM(nn.Module):
    def __init__(self, vocab, dim, n_layers):
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, vocab, bias=False)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(n_layers))

    def forward(self, input_ids):
        x = self.emb(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(vocab=256, dim=32, n_layers=2):
    return LM(vocab, dim, n_layers)


NOT_CALLABLE = 3
'''


def write_user_module(folder: Path, source: str = USER_MODULE, name: str = USER_MODULE_NAME) -> dict:
    """Write `source` as FOLDER/NAME.py; returns the env (PYTHONPATH) a CLI run needs to import it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.py").write_text(textwrap.dedent(source))
    return {"PYTHONPATH": f"{folder}{os.pathsep}{cli_env()['PYTHONPATH']}"}


# ---------------------------------------------------------------------------- prepared corpora

EOS = 0


def write_corpus(path: Path, docs, *, vocab=256, sha="bytes", per_shard=50, tokenizer_file="test") -> str:
    """A prepared (data=tokens) corpus directory holding `docs` (int arrays, each ending with EOS)."""
    import numpy as np

    from mfsdp_launch.corpus import shards

    path.mkdir(parents=True)
    entries = []
    for i in range(0, len(docs), per_shard):
        part = docs[i : i + per_shard]
        entries.append(shards.write_shard(str(path), i // per_shard, np.concatenate(part).astype(np.uint16),
                                          [len(d) for d in part]))
    meta = {"tokenizer": {"file": tokenizer_file, "sha256": sha, "vocab_size": vocab}, "eos_id": EOS,
            "dtype": "uint16"}
    shards.write_manifest(str(path), shards.build_manifest(entries, meta))
    return str(path)


# ----------------------------------------------------------------------------- gloo process groups


def init_gloo(rank: int, world: int, port: int, timeout_s: float = 120) -> None:
    """Join (rank of world) the gloo group served at 127.0.0.1:port."""
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))


@contextlib.contextmanager
def one_rank_group(store: Path):
    """A 1-rank gloo group in this process (a file store at `store`), destroyed on exit."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def rank_log(logs: Path, rank: int) -> Path:
    return Path(f"{logs}.rank{rank}.out")


def spawn_ranks(fn, world: int, *args, logs: Path) -> list:
    """Start `world` child processes, each calling fn(rank, world, *args) (args as strings) in one
    gloo group. fn is a module-level function of a test file; rank r's output goes to
    rank_log(logs, r). Returns Popen-like handles (forked.Forked)."""
    import forked

    port = free_port()
    full_env = {**cli_env(), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    full_env["PYTHONPATH"] = f"{TESTS}{os.pathsep}{full_env['PYTHONPATH']}"
    path, common = inspect.getfile(fn), [str(world), str(port), *map(str, args)]
    return [forked.rank([path, fn.__name__, str(rank), *common], str(rank_log(logs, rank)), full_env, str(ROOT))
            for rank in range(world)]


def run_ranks(fn, world: int, *args, timeout: float = 120, logs: Path | None = None) -> list:
    """spawn_ranks() and wait: every rank must exit 0 within `timeout` (else all are killed and the
    test fails with their output). Returns each rank's output."""
    with contextlib.ExitStack() as stack:
        if logs is None:
            logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ranks"))) / fn.__name__
        procs = spawn_ranks(fn, world, *args, logs=logs)
        return _all_exit_0(procs, [rank_log(logs, r) for r in range(world)], timeout, fn.__name__)


def _all_exit_0(procs, logs, timeout: float, what: str) -> list:
    """Wait for every rank; all must exit 0 within `timeout` (else all are killed and the test fails
    with their output). Returns each rank's output (the text of its log)."""
    deadline, timed_out = time.monotonic() + timeout, False
    try:
        for p in procs:
            p.wait(timeout=max(1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        timed_out = True
        for p in procs:
            p.kill()
            p.wait()
    outs = [Path(log).read_text() for log in logs]
    assert not timed_out, f"{what} timed out after {timeout} s:\n" + "\n".join(o[-2000:] for o in outs)
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"{what} rank {rank} exit {p.returncode}:\n{out[-4000:]}"
    return outs


def train_ranks(*overrides: str, timeout: float = 300, env=None) -> str:
    """A training run of `overrides` as mfsdp-train's ranks run it: the launcher's checks and
    frozen config.yaml, then launcher.nproc_per_node forked processes of `python -m
    mfsdp_launch.rank --config ...` with the environment torchrun and the launcher give them
    (forked.py: no torch import per rank). What the CLI adds around the ranks (torchrun, the
    supervisor, the end-of-run line) is proven by tests/e2e. `env`: more variables for the ranks
    (PYTHONPATH entries go on their sys.path, as at start-up). Returns rank 0's output."""
    import forked
    from mfsdp_launch.launcher.launch import prepare_run_dir, worker_env
    from mfsdp_launch.planner import prepare

    cfg, _ = prepare(list(overrides), check_hardware=False)
    if str(cfg.data.name) == "text":  # as the launcher does before spawning
        from mfsdp_launch.data import build_token_cache

        build_token_cache(cfg.data)
    config = prepare_run_dir(cfg, list(overrides))
    world, logs = int(cfg.launcher.nproc_per_node), Path(cfg.run.dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    # The launcher's environment for torchrun (from the user's shell), then what torchrun adds.
    env = {**worker_env(cfg.launcher, Path(cfg.run.dir), environ=cli_env()), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
           "GROUP_RANK": "0", **(env or {})}
    rank_logs = [logs / f"rank{rank}.forked.log" for rank in range(world)]
    procs = [forked.start_module("mfsdp_launch.rank", ["--config", str(config)], stdout=str(log), stderr=str(log),
                                 env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, cwd=ROOT)
             for rank, log in enumerate(rank_logs)]
    return _all_exit_0(procs, rank_logs, timeout, "mfsdp-train's ranks")[0]


def rank_main(argv) -> None:
    """A rank child (see spawn_ranks): FILE FUNCTION RANK WORLD PORT ARGS..."""
    import traceback

    import torch.distributed as dist

    from mfsdp_launch.rank.worker import leave

    path, name, rank, world, port, *args = argv
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    rank, world = int(rank), int(world)
    init_gloo(rank, world, int(port))
    try:
        getattr(module, name)(rank, world, *args)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        leave(1)
    leave(0)  # no interpreter teardown: gloo's threads have aborted a finished process there


def model_cfg(name: str, **keys):
    """A `model` section as the family types it (models/*/config.py), e.g. model_cfg("gpt", preset="8b")."""
    from mfsdp_launch.models import section_of

    return section_of(name)(name=name, **keys)


def unknown_key(key: str, family: str) -> str:
    """The schema's one line for a `model.*` key that `family`'s section does not have."""
    import dataclasses

    from mfsdp_launch.models import section_of
    from mfsdp_launch.planner.compose import unknown_key_problem

    section = section_of(family)
    keys = "|".join(f.name for f in dataclasses.fields(section))
    return f"{key}: {unknown_key_problem(key, section)} (allowed: {keys})"


# ------------------------------------------------------------------------- a local object store


@contextlib.contextmanager
def local_s3(bucket: str = "runs"):
    """A moto S3 server on a free loopback port with `bucket` in it; yields the AWS_* environment
    that points s3fs at it (set in this process meanwhile; pass it to child processes)."""
    from unittest import mock

    import boto3
    from moto.server import ThreadedMotoServer

    port = free_port()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    try:
        with mock.patch.dict(os.environ, env):
            boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"]).create_bucket(Bucket=bucket)
            _clear_s3fs_instances()  # s3fs caches clients per arguments: none may point at an old server
            yield env
    finally:
        _clear_s3fs_instances()
        server.stop()


def _clear_s3fs_instances() -> None:
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


def write_masked_corpus(path: Path, docs, masks, *, vocab=256, per_shard=50) -> str:
    """A prepared corpus like write_corpus's whose documents carry a loss mask each (1 = a
    target token), as `mfsdp-data prepare --chat` writes it."""
    import numpy as np

    from mfsdp_launch.corpus import shards

    path.mkdir(parents=True)
    entries = []
    for i in range(0, len(docs), per_shard):
        part, mpart = docs[i : i + per_shard], masks[i : i + per_shard]
        entries.append(shards.write_shard(str(path), i // per_shard, np.concatenate(part).astype(np.uint16),
                                          [len(d) for d in part], mask=np.concatenate(mpart)))
    meta = {"tokenizer": {"file": "test", "sha256": "bytes", "vocab_size": vocab}, "eos_id": EOS,
            "dtype": "uint16", "loss_mask": {"train_on": "assistant"}}
    shards.write_manifest(str(path), shards.build_manifest(entries, meta))
    return str(path)


def write_llama_dir(path: Path, seed: int = 0, **dims) -> Path:
    """A tiny Hugging Face Llama directory (config.json, model.safetensors) with seeded random
    weights: a local pretrained base (model.init_from, model=hf model.pretrained=true)."""
    import torch
    import transformers

    fields = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256, tie_word_embeddings=False, max_position_embeddings=256)
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**fields, **dims})).save_pretrained(path)
    return Path(path)


def train_wired(rank: int, world: int, overrides, *, grads=None, labels=None):
    """Train in this process group (rank of world, gloo) through the worker's own wiring: the
    planner's config for `overrides`, rank/runtime.py's builders, the real loop and DCP
    checkpoints. `grads` / `labels` (dicts), when given, collect the applied gradients per step
    (gathered: a collective) and each micro-batch's labels per (step, micro). Returns the
    TrainState and the model's spec."""
    import torch
    import torch.distributed as dist

    from mfsdp_launch.mesh import ParallelDims
    from mfsdp_launch.planner import prepare
    from mfsdp_launch.rank.loop import LoopContext, TrainState, train
    from mfsdp_launch.rank.runtime import Runtime, build_checkpoints, build_io, build_training, token_copies

    cfg, _ = prepare(list(overrides), check_hardware=False)
    cfg.run.dir = str(Path(cfg.run.dir).resolve())
    dims = ParallelDims.from_config(cfg.mesh, world)
    rt = Runtime(rank, rank, world, torch.device("cpu"), dist.group.WORLD, dims, dims.build("cpu"))
    tr = build_training(cfg, rt)
    checkpoints = build_checkpoints(cfg, rt, tr.engine)
    state = TrainState()
    checkpoints.resume(tr.model, tr.optimizer, tr.scheduler, state)
    io = build_io(cfg, rt, tr, resumed=state)
    if grads is not None:
        def snapshot(optimizer, args, kwargs):
            grads[state.step + 1] = {n: p.grad.full_tensor().clone() for n, p in tr.model.named_parameters()}

        tr.optimizer.register_step_pre_hook(snapshot)

    def next_batch(step, micro):
        batch = io.next_batch(step, micro)
        if labels is not None:
            labels[(step + 1, micro)] = batch["labels"].clone()
        return batch

    ctx = LoopContext(engine=tr.engine, spec=tr.spec, optimizer=tr.optimizer, scheduler=tr.scheduler,
                      next_batch=next_batch, forward_context=tr.forward_context, device=rt.device,
                      world_size=world, dp_size=dims.dp_size, rank=rank, peak_tflops=None, metrics=io.metrics,
                      checkpoints=checkpoints, stop_requested=lambda step: False,
                      masked_labels=bool(getattr(io.next_batch, "masked_labels", False)),
                      token_copies=token_copies(cfg, rt))
    train(tr.forward_model, cfg.train, state, ctx)
    checkpoints.wait()
    io.metrics.close()
    return state, tr


def interpreted(script: str) -> dict:
    """What `script` prints last (JSON), run in a process whose Triton kernels run in Triton's
    interpreter on CPU tensors (TRITON_INTERPRET=1 must be set before triton is imported)."""
    import pytest

    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
