"""LoRA in one run as mfsdp-train's ranks run it (helpers.train_ranks: `gpt` over a Hugging Face
Llama base, FSDP2 on 2 gloo ranks),
then in this process: its checkpoints hold the adapters only (< 2 % of the base's bytes) and
the base's checksum; `mfsdp-export --format peft` loads with `peft.PeftModel.from_pretrained`,
`--format hf --merge` gives the logits of peft's own merged model and of the trained model;
a moved or changed base is one line for the export and for a resume. And in this process (one
file, one import of peft and transformers): a `model=hf` LoRA over a bf16 base, built by the
rank's own builders on real FSDP2 (a 1-rank gloo group) with real DCP checkpoints, trains only
its fp32 adapters (the base's weights compared before and after), saves only them, and resumes
bitwise from a checkpoint it saved."""

from __future__ import annotations

import importlib.util
import json

import pytest

from helpers import SMOKE, one_rank_group, train_ranks, write_llama_dir

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
# peft takes ~3 s to import: the test that uses it imports it, not every worker's collection.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="needs peft")

DIMS = dict(hidden_size=128, intermediate_size=256)
PEFT = "model.peft={kind: lora, r: 2, alpha: 4, targets: [wqkv, wo, w_gate_up, w_down]}"
RUN = [*SMOKE, "data=synthetic", "train.seq_len=32", "train.micro_batch_size=2", "train.steps=4",
       "checkpoint.interval=2", "optim.warmup_steps=0", "optim.lr=1e-2", PEFT]


def _logits(model, ids):
    with torch.no_grad():
        out = model.eval()(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


@pytest.mark.slow
def test_gpt_lora_saves_adapters_only_and_exports_to_peft_and_merged_hf(tmp_path):
    from mfsdp_launch.checkpoint.adapters import base_checksum
    from mfsdp_launch.checkpoint.weights import read_model_state
    from mfsdp_launch.core.errors import ConfigError
    from mfsdp_launch.models import build_model_spec, lora, section_from
    from mfsdp_launch.models.hf_weights import load_into_model
    from mfsdp_launch.models.llama import hf_keys
    from mfsdp_launch.models.llama.dims import resolve_gpt_dims
    from mfsdp_launch.tools.export import export

    base, run = write_llama_dir(tmp_path / "base", **DIMS), tmp_path / "run"
    out = train_ranks(*RUN, f"model.init_from={base}", f"run.dir={run}")  # mfsdp-train's ranks
    assert "model.peft: LoRA r=2 alpha=4 on 8 layers" in out
    step2, step4 = run / "checkpoints" / "step_2", run / "checkpoints" / "step_4"

    # The checkpoint: adapters only, a small fraction of the model, and the base's reference.
    state, found = read_model_state(step4)
    assert state and all(lora.is_adapter(k) for k in state), sorted(state)
    adapter_bytes = sum(t.numel() * t.element_size() for t in state.values())
    assert adapter_bytes < 0.02 * (base / "model.safetensors").stat().st_size
    ref = found.manifest["model"]["peft"]["base"]
    assert ref == {"key": "model.init_from", "path": str(base), "checksum": base_checksum(base)}
    earlier, _ = read_model_state(step2)
    assert any(not torch.equal(earlier[k], state[k]) for k in state if ".lora_B." in k)

    # The trained model in this process: gpt + its adapters over the base.
    m = section_from(found.manifest["config"]["model"])
    model = build_model_spec(m, 32).build()
    lora.apply_lora(model, m.peft)
    load_into_model(model, base, sources=hf_keys.sources(resolve_gpt_dims(m), "gpt"))
    assert model.load_state_dict(state, strict=False).unexpected_keys == []
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    ours = _logits(model, ids)

    export(run, tmp_path / "adapter", fmt="peft")
    export(run, tmp_path / "merged", fmt="hf", merge=True)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (2, 4, str(base))
    hf = transformers.AutoModelForCausalLM.from_pretrained
    import peft

    with_adapter = peft.PeftModel.from_pretrained(hf(base, dtype=torch.float32), tmp_path / "adapter")
    theirs = _logits(with_adapter, ids)
    peft_merged = _logits(with_adapter.merge_and_unload(), ids)
    merged = _logits(hf(tmp_path / "merged", dtype=torch.float32), ids)
    assert (merged - peft_merged).abs().max().item() <= 1e-5
    assert (theirs - ours).abs().max().item() <= 1e-5 and (merged - ours).abs().max().item() <= 1e-5
    assert (merged - _logits(hf(base, dtype=torch.float32), ids)).abs().max().item() > 1e-3  # it trained

    def refusal(**kw):
        with pytest.raises(ConfigError) as e:
            export(step4, tmp_path / "x", **kw)
        assert "\n" not in str(e.value)
        return str(e.value)

    assert refusal(fmt="hf").startswith("--format: hf: ") and "holds LoRA adapters only" in refusal(fmt="hf")
    moved = base.rename(tmp_path / "moved")
    assert refusal(fmt="hf", merge=True).startswith(f"--base: the LoRA base {base} (recorded in the checkpoint) "
                                                    "is not a directory")
    export(step4, tmp_path / "merged2", fmt="hf", merge=True, base=str(moved))
    other = write_llama_dir(tmp_path / "other", seed=1, **DIMS)
    assert "are not the base the adapters were trained over" in refusal(fmt="peft", base=str(other))

    # A resume over another base: refused before spawning, naming the key.
    from mfsdp_launch.checkpoint import preflight
    from mfsdp_launch.planner import prepare

    cfg, _ = prepare([*RUN, f"model.init_from={other}", f"run.dir={run}", "train.steps=6"])
    with pytest.raises(ConfigError) as e:
        preflight(cfg)
    assert e.value.key == "model.init_from" and "the frozen base the adapters were trained over" in str(e.value)


# ------------------------------------------------------------- model=hf, FSDP2, in this process


HF = ["model=hf", "model.path={base}", "model.pretrained=true"]


def _cfg(base, run_dir, *more):
    from mfsdp_launch.planner import prepare

    cfg, _ = prepare([*(o.format(base=base) for o in HF), "engine=fsdp2", "data=synthetic",
                      "model.peft={kind: lora, r: 4, alpha: 8, dropout: 0.1, targets: [q_proj, v_proj, down_proj]}",
                      "train.seq_len=16", "train.micro_batch_size=2", "train.grad_accum_steps=2", "train.steps=4",
                      "precision.compute_dtype=bf16", "precision.main_params_dtype=fp32", "optim.warmup_steps=0",
                      "optim.lr=1e-2", "launcher.nproc_per_node=1", "checkpoint.interval=2",
                      "checkpoint.interval_minutes=null", f"run.dir={run_dir}", *more])
    return cfg


def _train(cfg, steps):
    """The rank's builders, a plain microbatch loop, the checkpoint manager's saves."""
    import torch.distributed as dist

    from mfsdp_launch.mesh import ParallelDims
    from mfsdp_launch.rank.loop import TrainState
    from mfsdp_launch.rank.runtime import Runtime, batch_source, build_checkpoints, build_training

    dims = ParallelDims.from_config(cfg.mesh, 1)
    rt = Runtime(0, 0, 1, torch.device("cpu"), dist.group.WORLD, dims, dims.build("cpu"))
    tr = build_training(cfg, rt)
    ckpts = build_checkpoints(cfg, rt, tr.engine)
    state = TrainState()
    ckpts.resume(tr.model, tr.optimizer, tr.scheduler, state)
    before = {n: p.full_tensor().clone() for n, p in tr.model.named_parameters()}
    next_batch = batch_source(cfg, tr.spec, rt, state)
    ga = cfg.train.grad_accum_steps
    for step in range(state.step + 1, steps + 1):
        for micro in range(ga):
            (tr.spec.loss(tr.model, next_batch(step, micro)) / ga).backward()
        tr.optimizer.step()
        tr.scheduler.step()
        tr.optimizer.zero_grad(set_to_none=True)
        state.step, state.consumed_samples = step, state.consumed_samples + ga * cfg.train.micro_batch_size
        ckpts.maybe_save(step, tr.model, tr.optimizer, tr.scheduler, state)
    ckpts.wait()
    return tr, before


def test_hf_lora_over_a_bf16_base_trains_saves_and_resumes_only_its_fp32_adapters(tmp_path):
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    from mfsdp_launch.models.lora import is_adapter

    base, a_dir, b_dir = write_llama_dir(tmp_path / "base"), tmp_path / "A", tmp_path / "B"
    with one_rank_group(tmp_path / "store"):
        tr, before = _train(_cfg(base, a_dir), 4)
        params = dict(tr.model.named_parameters())
        trained = {n for n, p in params.items() if p.requires_grad}
        assert trained and all(is_adapter(n) for n in trained) and len(trained) == 2 * 3 * 2  # A, B x 3 x 2 layers
        assert {params[n].dtype for n in trained} == {torch.float32}
        assert {p.dtype for n, p in params.items() if n not in trained} == {torch.bfloat16}
        assert len(tr.optimizer.state) == len(trained)  # no optimizer state for the base
        after = {n: p.full_tensor() for n, p in params.items()}
        file = load_file(base / "model.safetensors")
        for name in params:
            if name in trained:
                continue
            assert torch.equal(after[name], before[name]), name  # the base never moved
            assert torch.equal(after[name], file[name.replace(".base_layer.", ".")].to(torch.bfloat16)), name
        assert all(not torch.equal(after[n], before[n]) for n in trained if ".lora_B." in n)  # from zero
        saved = dcp.FileSystemReader(str(a_dir / "checkpoints" / "step_2")).read_metadata().state_dict_metadata
        model_keys = [k for k in saved if k.startswith("model.")]
        assert model_keys and all(is_adapter(k) for k in model_keys), model_keys

        # A new run from A's step 2 continues to A's step 4 bitwise (base reloaded, adapters,
        # Adam's moments, schedule and the dropout RNG from the checkpoint).
        resumed, _ = _train(_cfg(base, b_dir, f"checkpoint.load_path={a_dir / 'checkpoints' / 'step_2'}"), 4)
        for n, p in resumed.model.named_parameters():
            assert torch.equal(p.full_tensor(), after[n]), n
