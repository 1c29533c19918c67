"""Family `hf`: a Hugging Face causal LM from a local directory (`model.path`) or a config dict
(`model.hf_config` + `model.hf_class`), optionally with its pretrained safetensors weights
(`model.pretrained=true`, read slice by slice into the sharded model). The rules live in
models/hf/model.py and models/hf_weights.py; docs/models.md has the user's view.

As for `custom`, the launcher's checks and sizes come from one meta-device build in a short-lived
process (models/probe.py). Without transformers, `model=hf` is one line naming the extra.

A mixture of experts (Qwen3-MoE, Mixtral, ...: models/hf/moe.py) counts the weights a token uses
(FLOPs, MFU, `active=` in the parameter line), and mesh.ep > 1 splits the experts of the
architectures that models/hf/expert_parallel.py knows, through the Llama family's dispatcher.
"""

from __future__ import annotations

import importlib.util
from typing import List

from ...core.errors import ConfigError
from .. import probe as P
from ..family import ModelContext, ModelSpec, Parallel, find_module
from .config import HFModelConfig
from .moe import SPLITTABLE, inactive_params
from ..llama.moe_dims import check_expert_split
from ..measured import MeasuredFamily

PROBE = "mfsdp_launch.models.hf.family:probe_hf"


class HFFamily(MeasuredFamily):
    name = "hf"
    section = HFModelConfig
    # The architecture's own TP plan (models/hf/tensor_parallel.py), all-gather CP over SDPA
    # (models/hf/context_parallel.py).
    tp_mode = Parallel.DTENSOR
    cp_mode = Parallel.ALLGATHER
    lora = True  # through peft, on the model's own nn.Linear names (q_proj, v_proj, ...)
    doc_mask = True  # its attention through models/doc_attention.py: varlen on a GPU, positions per document
    base_key = "model.pretrained"
    base_hint = "true: model.path's weights"
    expert_parallel = True  # the experts blocks of SPLITTABLE architectures (models/hf/expert_parallel.py)
    experts_from = ", ".join(SPLITTABLE)

    def probe(self, m) -> dict:
        from .model import INSTALL_HINT, check_model_path

        if importlib.util.find_spec("transformers") is None:
            raise ConfigError("model", f"model=hf needs transformers, which is not installed ({INSTALL_HINT})")
        if m.path is not None:
            check_model_path(m.path)  # torch-free: a hub name or a directory without config.json
        if m.pretrained and m.path is None:
            raise ConfigError("model.pretrained", "true needs model.path, the directory holding the weights")
        if m.hf_config is not None and not hasattr(m.hf_config, "keys"):
            raise ConfigError("model.hf_config", f"must be a mapping of config fields, got {m.hf_config!r}")
        return P.probe(PROBE, m, crash_key="model.path" if m.path is not None else "model.hf_config")

    def check(self, m, ctx: ModelContext) -> List[str]:
        p = self.probe(m)
        self._check_loss_kernel(m, p, ctx)
        if ctx.tp > 1:
            self._check_tp(p, ctx)
        if ctx.cp > 1 and p["sliding_window"]:
            raise ConfigError("mesh.cp", f"{ctx.cp}: {p['hf_class']} uses sliding-window attention "
                              f"({p['sliding_window']} tokens), which context parallelism does not apply", "1")
        if ctx.ep > 1:
            self._check_ep(p, ctx)
        return []

    def _check_loss_kernel(self, m, p: dict, ctx: ModelContext) -> None:
        kernel = str(m.loss_kernel)
        if kernel == "te_fused":
            raise ConfigError("model.loss_kernel", "te_fused is the Llama family's (model=gpt, te_gpt); model=hf's "
                              "memory-lean loss is chunked", "torch, chunked")
        if kernel != "chunked":
            return
        if p.get("chunked_problem"):
            raise ConfigError("model.loss_kernel", f"chunked: {p['hf_class']} {p['chunked_problem']}", "torch")
        if ctx.tp > 1:  # the tensor-parallel plan makes the head a DTensor layer with its own hooks
            raise ConfigError("model.loss_kernel", f"chunked with mesh.tp={ctx.tp} is not wired", "torch, or mesh.tp=1")

    def _check_ep(self, p: dict, ctx: ModelContext) -> None:
        moe = p["moe"]
        if moe.get("split_problem"):
            raise ConfigError("mesh.ep", f"{ctx.ep}: {moe['split_problem']}", "1")
        check_expert_split(ctx.ep, moe.get("experts", 0), model=f"model=hf {p['hf_class']}",
                           source=f"{p['hf_class']}'s {moe.get('experts_key')}",
                           dense_hint=f"an HF mixture of experts ({', '.join(SPLITTABLE)})")

    def _check_tp(self, p: dict, ctx: ModelContext) -> None:
        if p["tp_problem"]:
            raise ConfigError("mesh.tp", f"{ctx.tp}: {p['tp_problem']}", "1")
        for what, size in p["tp_dims"].items():
            if size % ctx.tp:
                raise ConfigError("mesh.tp", f"{ctx.tp} does not divide the {size} {what} of {p['hf_class']}",
                                  f"a divisor of {size}")
        if ctx.seq_len % (ctx.cp * ctx.tp):  # sequence parallelism splits each cp rank's tokens over tp
            raise ConfigError("train.seq_len", f"{ctx.seq_len} is not divisible by mesh.cp*mesh.tp="
                              f"{ctx.cp * ctx.tp} (sequence parallelism)", f"a multiple of {ctx.cp * ctx.tp}")

    def parallelize(self, model, m, dims, mesh) -> None:
        if dims.tp > 1:
            from .tensor_parallel import parallelize_hf

            parallelize_hf(model, mesh["tp"])
        if dims.cp > 1:
            from .context_parallel import apply_context_parallel

            apply_context_parallel(model, mesh["cp"])
        moe = self.probe(m)["moe"]
        if moe and not moe["split_problem"]:
            from .expert_parallel import apply_expert_parallel, mark_experts

            if dims.ep > 1:
                apply_expert_parallel(model, mesh, dims)
            else:
                mark_experts(model)  # Megatron-FSDP's expert parameters at ep = 1
        self.apply_activation_checkpointing(model, m)

    def n_heads(self, m):
        return self.probe(m)["n_heads"]

    def shape(self, m) -> dict:
        p = self.probe(m)
        return {"hf_class": p["hf_class"], "params": p["num_params"], "param_shapes": p["param_digest"]}

    def describe(self, m, seq_len: int) -> str:
        p = self.probe(m)
        source = f"from {m.path}" + (" (pretrained)" if m.pretrained else "") if m.path else "from model.hf_config"
        line = (f"hf {p['hf_class']} {source} ({p['unit_count']} units; vocab={p['vocab_size']}) "
                + super().describe(m, seq_len).split(" ", 1)[1])
        moe = p["moe"]
        if not moe:
            return line
        # A mixture of experts: what a token uses (FLOPs and MFU count these), and what mesh.ep splits.
        return line.replace(" flops/token=", f" active={self.active_params(m):,} experts={moe['expert_params']:,} "
                            f"(moe: {moe['experts']} experts, top_k={moe['top_k']}, in {moe['moe_layers']} of "
                            f"{(p['dims'] or {}).get('n_layers', '?')} layers)"
                            " flops/token=", 1)

    # --- a mixture of experts (models/hf/moe.py); 0 for a dense model ---

    def experts(self, m) -> int:
        return self.probe(m)["moe"].get("experts", 0)

    def expert_params(self, m) -> int:
        return self.probe(m)["moe"].get("expert_params", 0)

    def unit_expert_params(self, m) -> int:
        return self.probe(m)["moe"].get("unit_expert_params", 0)

    def active_params(self, m) -> int:
        """Parameters one token uses: all but the routed experts it does not go to."""
        return self.param_count(m) - inactive_params(self.probe(m)["moe"])

    def matmul_params(self, m) -> int:
        return super().matmul_params(m) - inactive_params(self.probe(m)["moe"])

    def _source(self, m):
        from .model import resolve_hf_model

        return resolve_hf_model(path=m.path, hf_config=P.model_dict(m.hf_config) if m.hf_config else None,
                                hf_class=m.hf_class)

    def spec(self, m, seq_len: int) -> ModelSpec:
        from . import model as H
        from ..losses import hf_loss
        from ...components.precision import torch_dtype
        from ..family import resolve_unit_modules
        from .causal_attention import use_causal_attention

        p, src, dtype = self.probe(m), self._source(m), torch_dtype(m.params_dtype)
        chunked = str(m.loss_kernel) == "chunked"
        if chunked:
            from .. import chunked_loss
            from ..losses import hf_logits
        loss, moe = chunked_loss.chunked(hf_logits) if chunked else hf_loss, {}
        if p.get("moe"):  # routed experts: the balancing loss and the expert loads (router_loss.py)
            from .router_loss import after_step, attach, with_router_loss

            loss = with_router_loss(loss, p["moe"].get("router_aux_loss_coef", 0.0))
            moe = {"after_step": after_step}

        def build():
            model = H.build_hf_model(src, dtype)
            use_causal_attention(model)  # no mask preparation, no sync per forward (causal_attention.py)
            if any(t.is_meta for t in model.parameters()):
                H.support_module_init(model)
            if chunked:
                chunked_loss.install(model)
            return attach(model) if moe else model

        return ModelSpec(name=self.name, build=build, unit_modules=resolve_unit_modules(p["unit_classes"]),
                         loss=loss, init_weights=lambda model: H.init_hf_weights(find_module(model, src.cls)),
                         uses_tokens=True, synthetic_batch=None, tokens_per_sample=seq_len,
                         num_params=p["num_params"], flops_per_token=self.flops_per_token(m, seq_len),
                         vocab_size=p["vocab_size"], **moe)

    def base_dir(self, m):
        return m.path if m.pretrained else None

    def modules(self, m, seq_len: int) -> dict:
        return {n: tuple(io) if io else None for n, io in self.probe(m)["modules"].items()}

    def tokenizer_dir(self, m):
        return m.path  # an HF directory carries its tokenizer beside config.json

    def load_weights(self, m, model, engine) -> None:
        if not m.pretrained:
            return
        from ..hf_weights import announce, file_shapes, load_into_model, weight_files
        from .moe import legacy_expert_sources

        renamed = legacy_expert_sources(self.probe(m)["hf_class"],
                                        file_shapes(weight_files(m.path, key="model.pretrained")))
        report = load_into_model(model, m.path, engine=engine, key="model.pretrained", renamed=renamed)
        announce(report, key="model.pretrained", source=m.path)


# ------------------------------------------------------------------ the probe (imports torch)


def probe_hf(d: dict) -> dict:
    """Resolve and build the HF model on the meta device; check units, weights and freeze globs."""
    from types import SimpleNamespace

    from ...core.globs import check_globs_match
    from . import model as H
    from ..custom.user_model import build_on_meta, resolve_unit_classes
    from ..lora import KINDS, module_table

    m = SimpleNamespace(**d)
    src = H.resolve_hf_model(path=m.path, hf_config=m.hf_config or None, hf_class=m.hf_class)
    model = build_on_meta(lambda: H.build_hf_model(src))
    units = resolve_unit_classes(m.fsdp_unit_modules, model) if m.fsdp_unit_modules else H.unit_module_classes(model)
    if m.pretrained:
        _check_weights(model, src.path, src.class_name)
    out = P.measure(model, units)
    if str((m.peft or {}).get("kind", "none")) in KINDS:  # model.peft.targets' names
        out["modules"] = module_table(model)
    if m.freeze:
        check_globs_match("model.freeze", m.freeze, out["param_names"], "parameter")
    from .context_parallel import sliding_window
    from .tensor_parallel import tp_dims, tp_problem

    # what mesh.tp > 1 and mesh.cp > 1 need (HFFamily.check)
    out.update(tp_problem=tp_problem(model), tp_dims=tp_dims(model), sliding_window=sliding_window(src.config))
    from ..chunked_loss import chunked_problem

    out["chunked_problem"] = chunked_problem(model)  # what model.loss_kernel=chunked needs
    from .moe import moe_facts

    out["moe"] = moe_facts(model, units)  # {} for a dense model
    summary = H.model_summary(src)
    out.update(hf_class=src.class_name, vocab_size=summary["vocab_size"], n_heads=summary["n_heads"])
    return out


def _check_weights(model, hf_dir, hf_class: str) -> None:
    """Every parameter (a tied group once) is in the safetensors with its shape, under its own name
    or as the per-expert tensors of a fused experts weight (models/hf/moe.py): file headers only."""
    from ..hf_weights import check_source, file_shapes, weight_files
    from ..llama.hf_keys import Segment
    from .moe import legacy_expert_sources

    files = weight_files(hf_dir, key="model.pretrained")
    shapes = file_shapes(files)
    renamed = legacy_expert_sources(hf_class, shapes)
    groups = {}
    for name, t in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(t), []).append((name, tuple(t.shape)))
    for names in groups.values():
        held = [(n, shape) for n, shape in names if n in shapes or n in renamed]
        if not held:
            raise ConfigError("model.pretrained", f"{hf_dir} has no weights for {names[0][0]}")
        name, shape = held[0]
        source = [Segment(name, 0, shape[0] if shape else 1)] if name in shapes else renamed[name]
        check_source(name, shape, source, shapes.get, lambda _: hf_dir, "model.pretrained")


FAMILY = HFFamily()
