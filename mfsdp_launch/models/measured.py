"""Families whose numbers are measured, not derived: `custom` and `hf` build the model on the meta
device in a short-lived process (models/probe.py) and read parameter count, matmul weights, units and
vocabulary off it. The launcher never imports torch or the user's code for them."""

from __future__ import annotations

from . import probe as P
from .family import ModelFamily
from .llama.dims import lm_flops_per_token


class MeasuredFamily(ModelFamily):
    measured = True
    # model.activation_checkpointing wraps the FSDP unit modules (models/activation_checkpoint.py).
    activation_checkpointing = True
    linear_fp8 = True  # torchao converts the model's nn.Linear layers (components/float8.py)

    def probe(self, m) -> dict:
        """The meta-device measurements of this model config (cached for the run)."""
        raise NotImplementedError

    def vocab_size(self, m) -> int:
        return self.probe(m)["vocab_size"]

    def param_count(self, m) -> int:
        return self.probe(m)["num_params"]

    def muon_matrix_params(self, m) -> int:
        return self.probe(m).get("muon_params", 0)

    def matmul_params(self, m) -> int:
        """The weights a token multiplies (what FLOPs count); `hf` leaves out the routed experts a
        token does not go to."""
        return self.probe(m)["matmul_params"]

    def flops_per_token(self, m, seq_len: int) -> float:
        d, n = self.probe(m)["dims"], self.matmul_params(m)
        return lm_flops_per_token(n, d["n_layers"], d["dim"], seq_len) if d else 6.0 * n

    def matmuls(self, m, seq_len: int, linears=None):
        """From the built model's nn.Linear layers (`linears`; None before the build): 6 x each one's
        weights, scaled down where they hold more than a token multiplies (unused experts), and the
        rest of the FLOPs (the attention core, matmuls outside nn.Linear) in high precision. Exact
        for a dense model whose matmul weights are all nn.Linear."""
        if linears is None:
            return None
        from ..core.fp8_flops import HIGH, LINEAR, Matmul

        weights = sum(i * o for i, o in linears.values())
        scale = min(1.0, self.matmul_params(m) / weights) if weights else 0.0
        out = [Matmul(name, 6.0 * i * o * scale, LINEAR, (i, o)) for name, (i, o) in linears.items()]
        rest = self.flops_per_token(m, seq_len) - sum(mm.flops for mm in out)
        return out + [Matmul("", max(rest, 0.0), HIGH)]

    def activation_bytes(self, m, micro_batch_size: int, seq_len: int, bytes_per_el: int) -> int:
        return sum(self.activation_parts(m, micro_batch_size, seq_len, bytes_per_el).values())

    def activation_parts(self, m, micro_batch_size: int, seq_len: int, bytes_per_el: int, tp: int = 1,
                         compiled: bool = False) -> dict:
        p = self.probe(m)
        return P.activation_parts(p, micro_batch_size, seq_len, bytes_per_el, p["vocab_size"],
                                  mode=str(m.activation_checkpointing), every=m.ac_every,
                                  loss_kernel=str(getattr(m, "loss_kernel", "torch")), compiled=compiled)

    def unit_classes(self, m) -> tuple:
        """The FSDP unit classes the probe found (model.fsdp_unit_modules, or the model's own)."""
        from .family import resolve_unit_modules

        return resolve_unit_modules(self.probe(m)["unit_classes"])

    def apply_activation_checkpointing(self, model, m) -> None:
        if str(m.activation_checkpointing) != "none":
            from .activation_checkpoint import checkpoint_units

            checkpoint_units(model, self.unit_classes(m), m.activation_checkpointing, m.ac_every)

    def largest_unit_params(self, m) -> int:
        return self.probe(m)["largest_unit_params"]
