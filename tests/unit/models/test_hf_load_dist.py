"""Sliced HF loading into sharded models, with real gloo process groups in child processes.

The parent writes an HF Llama directory (exported from a seeded `gpt`); two gloo ranks
(helpers.run_ranks) run _child and assert on their side:

* FSDP2 (`fully_shard` per Block on a 1-D mesh), loaded through the FSDP2 engine's state dict:
  the gathered weights equal the files' and each rank requested exactly the bytes of its shards.
* te_gpt's interleaved QKV layout into even (FSDP2-style) and uneven (Megatron-FSDP-style, chunk
  metadata from megatron_fsdp's own function) DTensor shards.
* model=hf (with transformers): a tied Qwen2 built on meta, sharded, initialized, then loaded
  from its own safetensors, which lack the tied head.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers import run_ranks

pytest.importorskip("safetensors")

# vocab 257: the embedding and head split 129/128 rows, an uneven FSDP2 shard.
DIMS = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=192, vocab_size=257,
            tie_embeddings=False, norm_eps=1e-5, rope_theta=10000.0)


def _dims():
    from mfsdp_launch.models.llama.dims import GPTDims

    return GPTDims(**DIMS)


def _reference(hf_dir: str, model: str):
    """The files' weights in our layout, read whole by safetensors (independent of load.py)."""
    from safetensors.torch import load_file

    from mfsdp_launch.models.llama import hf_keys as llama_keys

    return llama_keys.hf_to_state(load_file(os.path.join(hf_dir, "model.safetensors")), _dims(), model)


def _fsdp2_gpt(rank: int, world: int, hf_dir: str) -> None:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from mfsdp_launch.engines.base import local_tensor
    from mfsdp_launch.engines.fsdp2 import FSDP2Engine
    from mfsdp_launch.models.llama import hf_keys as llama_keys
    from mfsdp_launch.models import hf_weights as load
    from mfsdp_launch.models.llama.gpt_modules import GPT, Block

    dims = _dims()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(1000 + rank)  # a different init per rank: only the load can make them agree
    model = GPT(dims)
    for block in model.layers:
        assert isinstance(block, Block)
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    engine = FSDP2Engine(engine_cfg=None, sharding_cfg=None, precision_cfg=None, dims=None, mesh=mesh,
                         device=torch.device("cpu"))
    state = engine.state_dict(model, None)
    report = load.load_hf_weights(state["model"], hf_dir, sources=llama_keys.sources(dims, "gpt"))
    engine.load_state_dict(model, None, state)

    local_bytes = sum(local_tensor(p).numel() * 4 for p in model.parameters())  # fp32 files
    total_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert report.bytes_read == local_bytes, (report.bytes_read, local_bytes)
    assert report.bytes_read < 0.6 * total_bytes, (report.bytes_read, total_bytes)
    assert report.unused == [], report.unused

    ref = _reference(hf_dir, "gpt")
    full = {k: v.full_tensor() for k, v in engine.state_dict(model, None)["model"].items()}
    assert sorted(full) == sorted(ref)
    for k in ref:
        assert torch.equal(full[k], ref[k]), k
    plain = GPT(dims)
    plain.load_state_dict(ref)
    ids = torch.randint(0, dims.vocab_size, (2, 16), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        diff = (model(ids) - plain(ids)).abs().max().item()
    assert diff <= 1e-5, diff
    print(f"rank {rank}: fsdp2 gpt ok, read {report.bytes_read} of {total_bytes} bytes", flush=True)


def _te_layout(rank: int, world: int, hf_dir: str) -> None:
    """te_gpt's names and shapes as DTensors: even Shard(0) and uneven (Megatron-FSDP) chunks."""
    import torch
    import torch.distributed as dist
    from megatron_fsdp.uneven_dtensor import update_uneven_dtensor_chunk_metadata
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from mfsdp_launch.models.llama import hf_keys as llama_keys
    from mfsdp_launch.models import hf_weights as load

    dims = _dims()
    mesh = init_device_mesh("cpu", (world,))
    ref = _reference(hf_dir, "te_gpt")
    even = {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)]) for k, v in ref.items()}
    uneven = {}
    for k, v in ref.items():
        cut = max(1, v.shape[0] // 3)  # rank 0 holds a third of the rows, rank 1 the rest
        rows = (0, cut) if rank == 0 else (cut, v.shape[0])
        local = torch.zeros((rows[1] - rows[0], *v.shape[1:]))
        uneven[k] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=v.shape, stride=v.stride())
        update_uneven_dtensor_chunk_metadata(uneven[k])

    def gather_rows(t):  # uneven row chunks, in rank order (gloo's all_gather needs equal sizes)
        parts = [None] * world
        dist.all_gather_object(parts, t.to_local())
        return torch.cat(parts)

    sources = llama_keys.sources(dims, "te_gpt")
    for state, gather in ((even, lambda t: t.full_tensor()), (uneven, gather_rows)):
        report = load.load_hf_weights(state, hf_dir, sources=sources)
        assert report.bytes_read == sum(t.to_local().numel() * 4 for t in state.values())
        for k in ref:
            assert torch.equal(gather(state[k]), ref[k]), k
    print(f"rank {rank}: te_gpt layout ok (even and uneven shards)", flush=True)


def _fsdp2_hf(rank: int, world: int, hf_dir: str) -> None:
    """model=hf: a tied Qwen2 built on meta, sharded per decoder layer, initialized with its own
    init, then its pretrained weights (HF names, the tied head absent from the file)."""
    import torch
    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from mfsdp_launch.engines.fsdp2 import FSDP2Engine
    from mfsdp_launch.models.hf import model as hf_model
    from mfsdp_launch.models import hf_weights as load

    mesh = init_device_mesh("cpu", (world,))
    src = hf_model.resolve_hf_model(path=hf_dir)
    with torch.device("meta"):
        model = hf_model.build_hf_model(src)
    for unit in [m for m in model.modules() if isinstance(m, hf_model.unit_module_classes(model))]:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    hf_model.init_hf_weights(model)
    engine = FSDP2Engine(engine_cfg=None, sharding_cfg=None, precision_cfg=None, dims=None, mesh=mesh,
                         device=torch.device("cpu"))
    report = load.load_into_model(model, hf_dir, engine=engine, key="model.path")
    assert report.unused == [], report.unused
    ref = load_file(os.path.join(hf_dir, "model.safetensors"))
    assert "lm_head.weight" not in ref
    full = {k: v.full_tensor() for k, v in engine.state_dict(model, None)["model"].items()}
    for k, v in full.items():
        assert torch.equal(v, ref.get(k, ref["model.embed_tokens.weight"])), k
    plain = hf_model.build_hf_model(src)
    plain.load_state_dict(ref, strict=False)
    plain.tie_weights()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        diff = (hf_model.hf_logits(model, ids) - hf_model.hf_logits(plain, ids)).abs().max().item()
    assert diff <= 1e-5, diff
    print(f"rank {rank}: fsdp2 hf qwen2 ok", flush=True)


def _child(rank: int, world: int, hf_dir: str) -> None:
    _fsdp2_gpt(rank, world, hf_dir)
    _te_layout(rank, world, hf_dir)
    if os.path.isdir(hf_dir + "_qwen2"):
        _fsdp2_hf(rank, world, hf_dir + "_qwen2")


# ================================================================================ parent side


@pytest.mark.slow
def test_sliced_load_fsdp2_and_uneven_shards(tmp_path):
    import torch

    from mfsdp_launch.models.llama.hf_export import export_gpt_state
    from mfsdp_launch.models.llama.gpt_modules import GPT

    torch.manual_seed(0)
    export_gpt_state(GPT(_dims()).state_dict(), tmp_path / "hf", dims=_dims())
    have_transformers = _save_qwen2(tmp_path / "hf_qwen2")
    outs = run_ranks(_child, 2, tmp_path / "hf")
    for rank, out in enumerate(outs):
        assert f"rank {rank}: fsdp2 gpt ok" in out and f"rank {rank}: te_gpt layout ok" in out, out[-2000:]
        assert (f"rank {rank}: fsdp2 hf qwen2 ok" in out) == have_transformers, out[-2000:]


def _save_qwen2(path: Path) -> bool:
    try:
        import transformers
    except ImportError:
        return False
    from mfsdp_launch.models.hf import model as hf_model

    src = hf_model.resolve_hf_model(hf_config=dict(
        model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, tie_word_embeddings=True))
    hf_model.build_hf_model(src).save_pretrained(path)
    assert transformers.AutoConfig.from_pretrained(path).tie_word_embeddings
    return True
