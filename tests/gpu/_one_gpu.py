"""The one-GPU tier's CLI runs: `python -m mfsdp_launch ...` (and `mfsdp-export ...`) as real
subprocesses, several at a time on the one GPU, in the background.

The tiny runs of this tier use a sliver of an H200 each, but every launch pays its start-up
(imports, torchrun, CUDA and NCCL init) on the CPU. So the runs are declared up front (`define`),
tests name the runs they read (`@uses(...)`), and the first test that asks (`start`, or `get`)
starts every run that the selected tests need, MAX_PARALLEL at a time, in a background thread of
the pytest process: the in-process engine jobs (_harness.py) run meanwhile. A run that needs
another's checkpoint (`after=`) starts when that one has finished. `get(name)` waits for one run.

Only the public surface is used: the CLI, its frozen config.yaml, metrics.jsonl, checkpoints/,
the exit code and the console; `mfsdp-export` is started from pyproject.toml's entry point, so a
module move inside the package does not break it.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
# Under pytest-xdist (the tier's `-n`, tests/gpu/device_run.sh) each worker has a pool and a
# folder of its own, and starts only the runs of the files it was handed (see `start`).
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
BASE_DIR = Path(os.environ.get("MFSDP_GPU_TEST_LOGS", tempfile.gettempdir())) / "one_gpu" / (XDIST_WORKER or "main")
RUNS_DIR = BASE_DIR / "runs"
MAX_PARALLEL = int(os.environ.get("MFSDP_ONE_GPU_PARALLEL", max(2, min(8, (os.cpu_count() or 4) // 2))))
STALL_DUMP_S = 90  # a step slower than this is a hang here: every rank dumps its stacks to its log
DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")

# Corpora of exactly one training window (seq_len + 1 bytes, byte tokens): every sample of every
# step is this text, so the loss logged at step k+1 is the loss of step k's weights on it.
_TEXT = b"The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. " * 4


def window_file(seq_len: int) -> Path:
    return BASE_DIR / f"window{seq_len}.txt"


def window_bytes(seq_len: int) -> bytes:
    return _TEXT[:seq_len + 1]


def tiny_gpt_bf16(seq_len: int, steps: int) -> List[str]:
    """The tiny gpt under Megatron-FSDP, bf16 compute over fp32 main weights, on the window text,
    logging every step: the runs whose losses two settings are compared on."""
    return ["engine=megatron_fsdp", "model=gpt", "model.preset=tiny", "data=text", f"data.path={window_file(seq_len)}",
            f"train.seq_len={seq_len}", "train.micro_batch_size=4", "train.log_interval=1", "train.progress=false",
            "optim.lr=3e-3", "optim.warmup_steps=0", "optim.decay_steps=50", "precision.compute_dtype=bf16",
            "precision.main_params_dtype=fp32", f"train.steps={steps}"]


@dataclass
class Run:
    """One CLI process. `argv` follows `python3` (for training: `-m mfsdp_launch ...`)."""

    name: str
    argv: List[str]
    run_dir: Optional[Path] = None  # a training run's run.dir (fresh for every session)
    needs_te: bool = False
    after: Sequence[str] = ()
    prepare: Optional[Callable[["Run"], None]] = None  # just before the start (after `after`)
    env: Dict[str, str] = field(default_factory=dict)
    timeout: float = 300.0
    priority: int = 1  # lower starts first (runs that others wait for)
    # filled in by the pool
    proc: Optional[subprocess.Popen] = None
    started: Optional[float] = None
    seconds: Optional[float] = None
    rc: Optional[int] = None
    timed_out: bool = False
    error: Optional[str] = None  # why it never started
    kill_stage: int = 0
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def log(self) -> Path:
        return BASE_DIR / "logs" / f"{self.name}.out"

    @property
    def err_log(self) -> Path:
        return BASE_DIR / "logs" / f"{self.name}.err"


@dataclass
class Result:
    name: str
    rc: Optional[int]
    stdout: str
    stderr: str
    run_dir: Optional[Path]
    seconds: Optional[float]
    timed_out: bool
    error: Optional[str]

    @property
    def console(self) -> str:
        return self.stdout + self.stderr

    def tail(self, n: int = 3000) -> str:
        return f"--- {self.name}: rc={self.rc} timed_out={self.timed_out} ({self.seconds} s)\n" \
               f"--- stdout\n{self.stdout[-n:]}\n--- stderr\n{self.stderr[-n:]}"

    def ok(self) -> "Result":
        """Assert the run exited 0; returns self."""
        assert self.error is None, self.error
        assert self.rc == 0, self.tail()
        return self

    def rows(self) -> List[dict]:
        path = self.run_dir / "metrics.jsonl"
        assert path.is_file(), self.tail()
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def losses(self) -> Dict[int, float]:
        return {r["step"]: r["loss"] for r in self.rows() if "loss" in r}

    def config(self):
        from omegaconf import OmegaConf

        return OmegaConf.load(self.run_dir / "config.yaml")


REGISTRY: Dict[str, Run] = {}


def define(run: Run) -> Run:
    if run.name in REGISTRY:
        raise ValueError(f"run {run.name} defined twice")
    REGISTRY[run.name] = run
    return run


def train(name: str, *overrides: str, needs_te: bool = False, after: Sequence[str] = (), prepare=None,
          env: Optional[dict] = None, timeout: float = 300.0, priority: int = 1) -> Run:
    """A `python -m mfsdp_launch OVERRIDES run.dir=...` run (one GPU)."""
    run_dir = RUNS_DIR / name
    argv = ["-m", "mfsdp_launch", *overrides, "launcher.nproc_per_node=1", f"train.stall_dump_s={STALL_DUMP_S}",
            f"run.dir={run_dir}"]
    return define(Run(name, argv, run_dir=run_dir, needs_te=needs_te, after=tuple(after), prepare=prepare,
                      env=dict(env or {}), timeout=timeout, priority=priority))


def console_script(name: str) -> List[str]:
    """`python3 -c ...` arguments that run the package's console script `name` (pyproject.toml)."""
    text = (ROOT / "pyproject.toml").read_text()
    try:
        import tomllib

        target = tomllib.loads(text)["project"]["scripts"][name]
    except ImportError:  # Python < 3.11
        m = re.search(rf'^{re.escape(name)}\s*=\s*"([^"]+)"', text, re.M)
        assert m, f"no console script {name} in pyproject.toml"
        target = m.group(1)
    module, func = target.split(":")
    return ["-c", f"import sys; from {module} import {func} as main; sys.exit(main())"]


def command(name: str, script: str, *args: str, after: Sequence[str] = (), needs_te: bool = False,
            timeout: float = 240.0, prepare=None) -> Run:
    """A console script (e.g. mfsdp-export) with these arguments, after the runs it reads."""
    return define(Run(name, [*console_script(script), *args], needs_te=needs_te, after=tuple(after),
                      timeout=timeout, prepare=prepare))


def uses(*names):
    """Mark a test with the runs it reads: names, or a callable of the test's parameters dict
    (its callspec) returning names."""

    def deco(fn):
        fn._one_gpu_runs = tuple(names) + tuple(getattr(fn, "_one_gpu_runs", ()))
        return fn

    return deco


# ------------------------------------------------------------------------------------- the pool


def _env(run: Run) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS and not k.startswith("TORCHELASTIC_")}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    env["MFSDP_CACHE_DIR"] = str(BASE_DIR / "token_cache" / run.name)  # no two runs build one cache
    # Several runs share the CPU cores: the launcher would give each rank all of them.
    env.setdefault("OMP_NUM_THREADS", "2")
    extra = dict(run.env)
    if "PYTHONPATH" in extra:  # a run's own modules (model=custom) come first
        env["PYTHONPATH"] = extra.pop("PYTHONPATH") + os.pathsep + env["PYTHONPATH"]
    env.update(extra)
    return env


class Pool:
    def __init__(self):
        self.lock = threading.Lock()
        self.wanted: set = set()
        self.thread: Optional[threading.Thread] = None
        self.stopping = False

    # -- scheduling (background thread)
    def _ready(self, run: Run) -> bool:
        return all(REGISTRY[a].done.is_set() for a in run.after)

    def _start(self, run: Run) -> None:
        failed = [a for a in run.after if REGISTRY[a].rc != 0]
        if failed:
            run.error = f"run {run.name} not started: it needs {', '.join(failed)}, which failed"
            run.done.set()
            return
        run.log.parent.mkdir(parents=True, exist_ok=True)
        try:
            if run.run_dir is not None:
                shutil.rmtree(run.run_dir, ignore_errors=True)
            if run.prepare is not None:
                run.prepare(run)
            out, err = open(run.log, "w"), open(run.err_log, "w")
            out.write(f"$ python3 {' '.join(run.argv)}\n")
            out.flush()
            run.proc = subprocess.Popen([sys.executable, *run.argv], cwd=str(ROOT), env=_env(run), stdout=out,
                                        stderr=err, text=True, start_new_session=True)
            out.close()
            err.close()
            run.started = time.time()
        except Exception as exc:  # noqa: BLE001 - reported by the test that reads the run
            run.error = f"run {run.name} could not start: {type(exc).__name__}: {exc}"
            run.done.set()

    def _reap(self, run: Run) -> None:
        code = run.proc.poll()
        now = time.time()
        if code is not None:
            run.rc = code
            run.seconds = round(now - run.started, 1)
            run.done.set()
            return
        age = now - run.started
        # Past the timeout: the launcher's own stop path first (SIGTERM: save and stop; a second
        # SIGTERM: stop torchrun), then SIGKILL of its process group.
        if age > run.timeout and run.kill_stage == 0:
            run.timed_out, run.kill_stage = True, 1
            _signal(run.proc, signal.SIGTERM)
        elif age > run.timeout + 10 and run.kill_stage == 1:
            run.kill_stage = 2
            _signal(run.proc, signal.SIGTERM)
        elif age > run.timeout + 60 and run.kill_stage == 2:
            run.kill_stage = 3
            _killpg(run.proc)

    def _loop(self) -> None:
        while not self.stopping:
            with self.lock:
                running = [r for r in REGISTRY.values() if r.proc is not None and not r.done.is_set()]
                for r in running:
                    self._reap(r)
                running = [r for r in running if not r.done.is_set()]
                pending = sorted((r for r in REGISTRY.values() if r.name in self.wanted and r.proc is None
                                  and not r.done.is_set() and self._ready(r)),
                                 key=lambda r: (r.priority, list(REGISTRY).index(r.name)))
                for r in pending[:max(0, MAX_PARALLEL - len(running))]:
                    self._start(r)
                if all(REGISTRY[n].done.is_set() for n in self.wanted):
                    pass  # idle until more is wanted
            time.sleep(0.25)

    # -- the pytest side
    def want(self, names: Iterable[str]) -> None:
        todo = list(names)
        with self.lock:
            while todo:
                name = todo.pop()
                if name not in REGISTRY:
                    raise KeyError(f"no run named {name}")
                if name not in self.wanted:
                    self.wanted.add(name)
                    todo.extend(REGISTRY[name].after)
            if self.thread is None:
                (BASE_DIR / "exports").mkdir(parents=True, exist_ok=True)
                for seq in (64, 128):
                    window_file(seq).write_bytes(window_bytes(seq))
                self.thread = threading.Thread(target=self._loop, name="one-gpu-runs", daemon=True)
                self.thread.start()
                atexit.register(self.shutdown)
                _stop_runs_on_sigterm(self)

    def shutdown(self) -> None:
        """Stop what still runs: the launcher's stop (SIGTERM), its abort (a second SIGTERM stops
        torchrun's session), then SIGKILL of the launcher's process group."""
        self.stopping = True
        live = [r for r in REGISTRY.values() if r.proc is not None and r.proc.poll() is None]
        for sig, wait in ((signal.SIGTERM, 4.0), (signal.SIGTERM, 3.0)):
            for r in live:
                if r.proc.poll() is None:
                    _signal(r.proc, sig)
            deadline = time.time() + wait
            while time.time() < deadline and any(r.proc.poll() is None for r in live):
                time.sleep(0.1)
        for r in live:
            if r.proc.poll() is None:
                _killpg(r.proc)


def _stop_runs_on_sigterm(pool: "Pool") -> None:
    """pytest killed by `timeout` (SIGTERM) skips atexit: stop the runs first, which run in
    sessions of their own, then die of the signal as before."""
    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)

    def handler(signum, frame):
        pool.shutdown()
        signal.signal(signum, previous if callable(previous) or previous == signal.SIG_IGN else signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, handler)


def _signal(proc: subprocess.Popen, sig) -> None:
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass


def _killpg(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


POOL = Pool()


def _te_usable() -> bool:
    from _harness import te_available

    return te_available()[0]


def _item_runs(item) -> List[str]:
    fn = getattr(item, "function", None)
    names: List[str] = []
    for spec in getattr(fn, "_one_gpu_runs", ()):
        if callable(spec):
            params = dict(getattr(getattr(item, "callspec", None), "params", {}) or {})
            names.extend(spec(params))
        else:
            names.append(spec)
    return names


def start(request) -> None:
    """Start (in the background) every run the session's selected, not skipped tests read; under
    xdist, those of the asking test's file only (`--dist loadfile` hands a file to one worker, whole),
    so two workers never start one run."""
    if POOL.thread is not None:
        return
    items = request.session.items
    if XDIST_WORKER:
        items = [item for item in items if item.path == request.node.path]
    names = set()
    for item in items:
        if item.get_closest_marker("skip"):
            continue
        names.update(_item_runs(item))
    te = None
    chosen = []
    for name in sorted(names):
        run = REGISTRY[name]
        if run.needs_te:
            te = _te_usable() if te is None else te
            if not te:
                continue
        chosen.append(name)
    POOL.want(chosen)


def get(request, name: str, wait: float = 900.0) -> Result:
    """The finished run `name` (started now if it was not yet)."""
    start(request)
    POOL.want([name])
    run = REGISTRY[name]
    if not run.done.wait(wait):
        pytest.fail(f"run {name} did not finish in {wait} s (started: {run.started is not None})")
    stdout = run.log.read_text(errors="replace") if run.log.exists() else ""
    stderr = run.err_log.read_text(errors="replace") if run.err_log.exists() else ""
    return Result(name, run.rc, stdout, stderr, run.run_dir, run.seconds, run.timed_out, run.error)


# ------------------------------------------------------------------------------------- helpers


def copy_checkpoint(source: str, step: int):
    """A `prepare` that seeds a run dir with another run's committed step (a resume from it)."""

    def prepare(run: Run) -> None:
        src = REGISTRY[source].run_dir / "checkpoints" / f"step_{step}"
        (run.run_dir / "checkpoints").mkdir(parents=True)
        shutil.copytree(src, run.run_dir / "checkpoints" / f"step_{step}")

    return prepare


def assert_close(got: Dict[int, float], ref: Dict[int, float], steps: Iterable[int], rel: float, what: str = ""):
    steps = list(steps)
    missing = [s for s in steps if s not in got or s not in ref]
    assert not missing, f"{what}: steps {missing} missing (got {sorted(got)}, ref {sorted(ref)})"
    worst = max(abs(got[s] - ref[s]) / abs(ref[s]) for s in steps)
    bad = {s: (ref[s], got[s]) for s in steps if abs(got[s] - ref[s]) > rel * abs(ref[s])}
    print(f"{what}: max relative loss difference {worst:.2e} over steps {steps[0]}..{steps[-1]} (bound {rel:.0e})")
    assert not bad, f"{what}: steps whose loss differs by more than {rel:.0e} (ref, got): {bad}"
    return worst


def assert_learns(losses: Dict[int, float], steps: int, min_drop: float, what: str = ""):
    import math

    assert sorted(losses) == list(range(1, steps + 1)), (what, sorted(losses))
    values = [losses[s] for s in sorted(losses)]
    assert all(math.isfinite(v) for v in values), (what, values)
    assert values[-1] < values[0] - min_drop, (what, values)
    return values
