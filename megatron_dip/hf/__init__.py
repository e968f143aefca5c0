"""Hugging Face checkpoints in and out: module shapes and options from `config.json`
(`config`), the correspondence between Hugging Face tensor names and our global parameter names
(`names`), and reading / writing safetensors by slices (`weights`).

Supported: Llama and Qwen2 decoders as the LLM or as the text-to-video text encoder (model_type
"llama", "qwen2"). `config` and `names` are torch-free; `weights` imports torch and safetensors.
The importer and exporter are `tools/hf_checkpoint.py`.
"""
