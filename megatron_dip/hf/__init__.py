"""Hugging Face checkpoints in and out: module shapes and options from `config.json`
(`config`), the correspondence between Hugging Face tensor names and our global parameter names
(`names`), and reading / writing safetensors by slices (`weights`).

Supported (`config.FAMILIES`): Llama, Mistral (no sliding window), Qwen2 and Qwen3 decoders as
the LLM or as the text-to-video text encoder; Qwen2-VL (vision tower + merger as the ViT, its
Qwen2 decoder with M-RoPE as the LLM); Qwen2.5-VL (its window-attention vision tower as the
ViT); LLaVA at base resolution (a CLIP or SigLIP tower and the two-layer projector as the ViT, a
Llama / Mistral / Qwen2 LLM; the tower tensors it never runs carried for the export). `config` and `names` are
torch-free; `weights` imports torch and safetensors.
The importer and exporter are `tools/hf_checkpoint.py`.
"""
