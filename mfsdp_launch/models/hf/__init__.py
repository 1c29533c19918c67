"""Hugging Face interop: Llama-layout weights in and out of `gpt`/`te_gpt`, HF causal LMs as
models (`model=hf`), and user-defined models (`model=custom`); the families themselves are
`models/hf/family.py` and `models/custom/family.py`.

Import-light: this package and `config`, `llama_keys`, `probe` and `user_model`'s resolution
helpers import neither torch nor transformers at module level, so the launcher's validation can
use them before anything is spawned (`probe` builds models in a short-lived process).
`transformers` and `safetensors` are optional (`pip install 'mfsdp-launch[hf]'`).
"""
