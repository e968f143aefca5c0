"""planner/paper.py: the names and mixtures the simulation tools accept."""

from megatron_dip.planner.paper import AUTO_MIXTURES, check_names, mixtures_for


def test_unknown_setup_or_mixture_is_named_with_the_known_ones() -> None:
    assert check_names("vlm-s,t2v-l", "auto") is None
    assert check_names("vlm-s", "mixed,t2v-blend") is None
    error = check_names("vlm-s,vlm-xl", "mixed")
    assert error.startswith("--setups: unknown setup 'vlm-xl'") and "vlm-m" in error
    error = check_names("vlm-s", "mixed,nope")
    assert error.startswith("--mixtures: unknown mixture 'nope'") and "laion" in error


def test_mixtures_that_do_not_suit_the_model_are_left_out() -> None:
    vlm, t2v = mixtures_for("vlm-s", "auto"), mixtures_for("t2v-s", "auto")
    assert "mixed" in vlm and "mixed-blend" in vlm and "t2v" not in vlm
    assert "t2v" in t2v and "t2v-blend" in t2v and "mixed" not in t2v
    assert set(vlm) | set(t2v) <= set(AUTO_MIXTURES)
    assert mixtures_for("vlm-s", "t2v,laion") == ["laion"]
    assert mixtures_for("t2v-s", "t2v-mixed") == ["t2v-mixed"]  # named: kept though not in auto
    assert mixtures_for("t2v-s", "auto", auto=("t2v",)) == ["t2v"]
