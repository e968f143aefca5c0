"""Hugging Face checkpoints in and out: module shapes and options from `config.json`
(`config`), the correspondence between Hugging Face tensor names and our global parameter names
(`names`), and reading / writing safetensors by slices (`weights`).

Supported: Llama and Qwen2 decoders as the LLM or as the text-to-video text encoder (model_type
"llama", "qwen2"), and Qwen2-VL (model_type "qwen2_vl": vision tower + merger as the ViT, its
Qwen2 decoder with M-RoPE as the LLM). `config` and `names` are torch-free; `weights` imports
torch and safetensors.
The importer and exporter are `tools/hf_checkpoint.py`.
"""
