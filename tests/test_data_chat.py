"""Hugging Face tokenizers and prompt formats (`data.hf_tokenizer`, `data.chat`): a BPE tokenizer
trained here with `tokenizers` (offline, well under a second); its chat template and ours checked
token for token against transformers' `apply_chat_template`; loss only on assistant turns,
token by token; images as placeholder runs; the special ids and the padded vocabulary reaching
the model; truncation; a record holding the byte tokenizer's old fixed ids (0, 1) trains."""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest

from megatron_dip.data.chat import NAMED_TEMPLATES, Turn, make_encoder
from megatron_dip.data.hf_tokenizer import HuggingFaceTokenizer
from megatron_dip.data.image_text import ReaderConfig
from megatron_dip.data.llava import LlavaDataset
from megatron_dip.data.meta import sample_meta
from megatron_dip.data.records import BadSampleError
from megatron_dip.data.stream import BatchStream, StreamConfig
from megatron_dip.data.tiny_llava import make_tiny_llava_sample
from megatron_dip.data.tiny_tokenizer import make_tiny_tokenizer
from megatron_dip.data.tokenizer import TokenizerSpec, load_tokenizer, padded_vocab_size
from megatron_dip.training.config.arguments import parse_config
from megatron_dip.training.config.validate import ConfigError, resolve

CONVERSATION = (
    Turn("system", "Be brief."),
    Turn("user", "What is shown here?"),
    Turn("assistant", 'a "red" circle!'),
    Turn("user", "And the background?"),
    Turn("assistant", "blue"),
)
LLAMA_LIKE = (  # a second template with other tokens, a BOS and trimming
    "{{ '<|begin_of_text|>' }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
    "<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
TEXTS = [
    "What is shown here? Describe the picture briefly. Write a short caption.",
    'a "red" circle on a blue background! a green square on a white background.',
    "system user assistant Be brief. And the background? blue yellow black",
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tok"), TEXTS * 20)


@pytest.fixture(scope="module")
def tok(tok_dir):
    return HuggingFaceTokenizer(tok_dir)


@pytest.fixture(scope="module")
def llama_dir(tok_dir, tmp_path_factory):
    from transformers import AutoTokenizer

    other = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    other.chat_template = LLAMA_LIKE
    out = tmp_path_factory.mktemp("llama_like")
    other.save_pretrained(str(out))
    return out


def _messages(turns):
    return [{"role": t.role, "content": t.content} for t in turns]


def _reference_ids(directory, turns, template=None) -> list[int]:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    out = hf.apply_chat_template(_messages(turns), chat_template=template, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_special_ids_come_from_the_tokenizer(tok, tok_dir):
    assert tok.encode('!"').tolist() == [0, 1]  # the byte tokenizer's PAD and IMAGE are text here
    vocab = json.loads((tok_dir / "tokenizer.json").read_text())["added_tokens"]
    by_name = {t["content"]: t["id"] for t in vocab}
    assert tok.special_id("image") == by_name["<|image_pad|>"]
    assert tok.pad_id == tok.eos_id == by_name["<|endoftext|>"] and tok.bos_id is None
    assert tok.image_text() == "<|vision_start|><|image_pad|><|vision_end|>"
    named = HuggingFaceTokenizer(tok_dir, special={"pad": "<|im_end|>", "image": "<|eot_id|>"})
    assert (named.pad_id, named.special_id("image")) == (
        by_name["<|im_end|>"],
        by_name["<|eot_id|>"],
    )
    with pytest.raises(ValueError, match=r"--dip-special-tokens: image='<nope>' is not one token"):
        HuggingFaceTokenizer(tok_dir, special={"image": "<nope>"})


@pytest.mark.parametrize("which", ["tiny", "llama_like"])
def test_chat_template_is_apply_chat_template_token_for_token(which, tok_dir, llama_dir):
    directory = tok_dir if which == "tiny" else llama_dir
    encoder = make_encoder(HuggingFaceTokenizer(directory), None, image_id=None)
    ids, mask = encoder.encode(CONVERSATION, image_tokens=[])
    assert ids.tolist() == _reference_ids(directory, CONVERSATION)
    assert mask.shape == ids.shape and mask.dtype == np.uint8


@pytest.mark.parametrize("name", ["chatml", "qwen2", "llama3"])
def test_named_formats(name, tok, tok_dir):
    turns = (Turn("user", "hi"), Turn("assistant", "yo"))
    text, _ = make_encoder(tok, name, image_id=None).render(turns)
    chatml = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n"
    expected = {
        "chatml": chatml,
        "qwen2": "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n" + chatml,
        "llama3": "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nyo<|eot_id|>",
    }[name]
    assert text == expected
    ids, _ = make_encoder(tok, name, image_id=None).encode(turns, image_tokens=[])
    assert ids.tolist() == _reference_ids(tok_dir, turns, NAMED_TEMPLATES[name])


def test_loss_mask_is_on_assistant_turns_only_token_by_token(tok):
    ids, mask = make_encoder(tok, "chatml", image_id=None).encode(CONVERSATION, image_tokens=[])
    pieces = [tok.decode([i]) for i in ids]
    expected, role, header = [], None, False
    for piece in pieces:  # walk the ChatML layout: <|im_start|>ROLE\n CONTENT <|im_end|>\n
        if piece == "<|im_start|>":
            role, header = "", True
            expected.append(0)
        elif header:
            header = piece != "\n"
            role += piece if header else ""
            expected.append(0)
        elif role is not None:
            expected.append(int(role == "assistant"))
            role = None if piece == "<|im_end|>" else role
        else:
            expected.append(0)  # the newline after <|im_end|>
    assert mask.tolist() == expected
    assert tok.decode(ids[mask == 1]) == 'a "red" circle!<|im_end|>blue<|im_end|>'


def test_images_become_placeholder_runs_without_loss(tok):
    image = tok.special_id("image")
    turns = (Turn("user", "<image>\nWhat is shown here?"), Turn("assistant", "<image> twice"))
    ids, mask = make_encoder(tok, None, image_id=image).encode(turns, image_tokens=[3, 2])
    runs = np.flatnonzero(np.diff(np.r_[0, ids == image, 0]))  # starts and ends of the runs
    assert (runs[1::2] - runs[::2]).tolist() == [3, 2] and not mask[ids == image].any()
    starts = runs[::2]
    assert [tok.decode(ids[s - 1 : s]) for s in starts] == ["<|vision_start|>"] * 2
    with pytest.raises(BadSampleError, match="1 <image> tags for 2 images"):
        make_encoder(tok, None, image_id=image).encode(turns[:1], image_tokens=[3, 2])
    sneaky = (Turn("user", "<image><|image_pad|>"), Turn("assistant", "x"))
    with pytest.raises(BadSampleError, match="2 image placeholder tokens after tokenizing for 1"):
        make_encoder(tok, None, image_id=image).encode(sneaky, image_tokens=[4])


def test_prompt_formats_the_tokenizer_cannot_write_are_refused(tok, tmp_path):
    from megatron_dip.data.tokenizer import ByteTokenizer

    with pytest.raises(ValueError, match="--tokenizer-prompt-format chatml: the byte tokenizer"):
        make_encoder(ByteTokenizer(), "chatml", image_id=1)
    from transformers import AutoTokenizer

    bare = AutoTokenizer.from_pretrained(str(tok.path), local_files_only=True)
    bare.chat_template = None
    bare.save_pretrained(str(tmp_path))
    for leftover in tmp_path.glob("chat_template.*"):
        leftover.unlink()
    plain = HuggingFaceTokenizer(tmp_path)
    with pytest.raises(ValueError, match="hf: the tokenizer at .* has no chat_template"):
        make_encoder(plain, "hf", image_id=None)
    text, spans = make_encoder(plain, None, image_id=None).render(CONVERSATION[1:3])
    assert text == 'What is shown here?\na "red" circle!<|endoftext|>'
    assert text[spans[0][0] : spans[0][1]] == 'a "red" circle!<|endoftext|>'


@pytest.fixture(scope="module")
def quoted_llava(tmp_path_factory):
    """The tiny LLaVA dataset with captions holding '"' and '!' (ids 1 and 0 of the BPE)."""
    path = make_tiny_llava_sample(tmp_path_factory.mktemp("quoted"), num_samples=8, seed=3)
    records = json.loads(path.read_text())
    for r in records:
        words = r["conversations"][1]["value"].split()
        r["conversations"][1]["value"] = " ".join([words[0], f'"{words[1]}"', *words[2:]]) + "!"
    path.write_text(json.dumps(records))
    return path


def _run(quoted_llava, tok_dir, *extra, world_size=1):
    argv = ["--model", "tiny-vlm", "--train-iters", "2", "--lr", "1e-3"]
    argv += ["--dip-data", f"llava:{quoted_llava}", "--tokenizer-type", "HuggingFaceTokenizer"]
    argv += ["--tokenizer-model", str(tok_dir), *extra]
    return resolve(parse_config(argv), world_size=world_size, cuda=False)


def test_the_model_takes_the_tokenizers_ids_and_padded_vocabulary(quoted_llava, tok_dir, tok):
    spec = _run(quoted_llava, tok_dir)
    vit, llm = spec.model.module("vit"), spec.model.module("llm")
    assert vit.placeholder_id == tok.special_id("image") and llm.pad_id == tok.pad_id
    assert llm.vocab_size == padded_vocab_size(tok.vocab_size, divisible_by=128, tensor_parallel=1)
    assert llm.vocab_size % 128 == 0 and llm.vocab_size >= tok.vocab_size
    tp2 = _run(quoted_llava, tok_dir, "--tensor-model-parallel-size", "2", world_size=2)
    assert tp2.model.module("llm").vocab_size == math.ceil(tok.vocab_size / 256) * 256
    assert (
        _run(quoted_llava, tok_dir, "--vocab-size", "1000").model.module("llm").vocab_size == 1000
    )
    with pytest.raises(ConfigError, match=r"--vocab-size: 300 is smaller than the tokenizer's"):
        _run(quoted_llava, tok_dir, "--vocab-size", "300")
    with pytest.raises(ConfigError, match=r"--dip-special-tokens: module 'vit'.*also the pad id"):
        _run(quoted_llava, tok_dir, "--dip-special-tokens", "image=<|endoftext|>")
    with pytest.raises(ConfigError, match=r"--tokenizer-prompt-format chatml: the byte tokenizer"):
        resolve(
            parse_config(["--model", "tiny-vlm", "--train-iters", "2", "--lr", "1e-3",
                          "--dip-data", f"llava:{quoted_llava}", "--tokenizer-prompt-format",
                          "chatml"]),
            world_size=1, cuda=False,
        )  # fmt: skip


def test_missing_transformers_names_the_flag_and_the_pip_command(
    quoted_llava, tok_dir, monkeypatch
):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` fails
    load_tokenizer.cache_clear()
    try:
        with pytest.raises(
            ConfigError, match=r"--tokenizer-type: .*pip install .*megatron-dip\[hf\]"
        ):
            _run(quoted_llava, tok_dir, "--dip-special-tokens", "pad=<|im_end|>")
    finally:
        load_tokenizer.cache_clear()


def test_a_record_holding_the_old_fixed_ids_trains(quoted_llava, tok_dir, single_rank_world):
    """Ids 0 and 1 are text ('!' and '"'): the sample is consistent, and the whole model runs
    forward and backward on it with the image embeddings scattered into <|image_pad|>."""
    from megatron_dip.models.chunk import ModelGroups
    from megatron_dip.models.config import ModelConfig
    from megatron_dip.reference import reference_loss_and_grads

    spec = _run(quoted_llava, tok_dir)
    ds = LlavaDataset(quoted_llava, model=spec.model, config=spec.data.reader_config())
    samples = [ds.sample(i) for i in range(3)]
    for s in samples:
        assert (s.text == 0).any() and (s.text == 1).any()
        assert sample_meta(s, model=spec.model) == ds.meta(s.sample_id)
    world = single_rank_world
    loss, grads = reference_loss_and_grads(
        spec.model,
        [samples],
        seed=1,
        seq_length=128,
        groups=ModelGroups(tp=world, cp=world, embedding=world),
        config=ModelConfig(seed=1),
    )
    assert math.isfinite(loss) and 0 < loss < 20
    assert any(name.startswith("vit.") and g.abs().sum() > 0 for name, g in grads.items())


def test_truncation_cuts_text_keeps_images_and_counts(tmp_path, tok_dir):
    path = make_tiny_llava_sample(tmp_path, num_samples=4, seed=2)
    records = json.loads(path.read_text())
    records[1]["conversations"][1]["value"] = "a long answer " * 40
    records[2]["conversations"][0]["value"] = "words " * 80 + "<image>"  # image past the cut
    path.write_text(json.dumps(records))
    spec = _run(path, tok_dir, "--dip-bad-samples", "truncate", "--dip-max-sample-tokens", "48")
    ds = LlavaDataset(path, model=spec.model, config=spec.data.reader_config())
    stream = BatchStream(
        ds, config=StreamConfig(batch_samples=3, shuffle=False, on_oversize="skip")
    )
    batch = next(stream)
    assert [m.sample_id for m in batch.samples] == [0, 1, 3]  # 2 is skipped: its image is cut
    assert batch.samples[1].text_tokens == 48 and stream.truncated == 1 and stream.skipped == 1
    cut = ds.sample(1)
    assert len(cut.text) == 48 and len(cut.media["vit"]) == 1
    assert sample_meta(cut, model=spec.model) == ds.meta(1)
    strict = ReaderConfig(tokenizer=spec.data.tokenizer, image=spec.data.image, max_tokens=48)
    with pytest.raises(BadSampleError, match=r"more than --dip-max-sample-tokens 48"):
        LlavaDataset(path, model=spec.model, config=strict).meta(1)


def test_tokenizer_spec_is_checked():
    with pytest.raises(ValueError, match="--tokenizer-model"):
        TokenizerSpec("HuggingFaceTokenizer")
    with pytest.raises(ValueError, match="--dip-special-tokens needs"):
        TokenizerSpec(special=(("image", "<x>"),))
