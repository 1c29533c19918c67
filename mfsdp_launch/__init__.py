"""mfsdp-launch: a config-driven launcher for Megatron-FSDP and PyTorch FSDP2 training."""

__version__ = "0.1.0"
