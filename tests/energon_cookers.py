"""Helpers, no tests: a user cooker for crude Energon datasets, named by
`--dip-energon-cooker energon_cookers:COOKERS` in test_data_energon.py (tests/ is importable)."""

from megatron.energon import CaptioningSample, Cooker, basic_sample_keys


def cook_caption(sample: dict) -> CaptioningSample:
    """A crude sample with "png" and "txt" parts as a captioning sample (image passed through)."""
    return CaptioningSample(**basic_sample_keys(sample), image=sample["png"], caption=sample["txt"])


COOKERS = [Cooker(cook_caption, has_subflavors={"kind": "caption"})]
