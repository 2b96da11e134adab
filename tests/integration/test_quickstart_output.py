"""The main job's output: quiet while it runs, and a slow-down said and drawn as one."""

from __future__ import annotations


def test_quiet_silences_only_while_it_runs():
    """The main job's ``quiet()``: Lightning's info lines, harmless warnings and per-file progress bars off inside;
    afterwards the process logs and warns as before (a test worker that ran the quickstart once used to lose
    Lightning's INFO lines for good)."""
    import logging
    import warnings

    import datasets
    from transformers.utils import logging as transformers_logging

    from swiftkv.quickstart.run import quiet

    lightning_logger = logging.getLogger("lightning.pytorch")
    level, bars = lightning_logger.level, datasets.are_progress_bars_disabled()
    transformers_bar = transformers_logging.is_progress_bar_enabled()
    lightning_logger.setLevel(logging.INFO)
    datasets.enable_progress_bars()
    transformers_logging.enable_progress_bar()
    filters_before = list(warnings.filters)
    harmless = "Checkpoint directory /x exists and is not empty."
    try:
        with quiet():
            assert lightning_logger.level == logging.ERROR
            assert (
                datasets.are_progress_bars_disabled() and not transformers_logging.is_progress_bar_enabled()
            )
            with warnings.catch_warnings(record=True) as caught:
                warnings.warn(harmless, UserWarning, stacklevel=1)
            assert caught == []
        assert lightning_logger.level == logging.INFO
        assert warnings.filters == filters_before
        assert not datasets.are_progress_bars_disabled() and transformers_logging.is_progress_bar_enabled()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            warnings.warn(harmless, UserWarning, stacklevel=1)
        assert [str(w.message) for w in caught] == [harmless]
    finally:  # this worker's later tests log and show bars as before this one
        lightning_logger.setLevel(level)
        if bars:
            datasets.disable_progress_bars()
        if not transformers_bar:
            transformers_logging.disable_progress_bar()


def test_a_slow_down_is_reported_as_one(tmp_path):
    """A SwiftKV time that is worse (an eager GPU prefill bound by kernel launches, a busy machine) reads as a
    slow-down in the report's words, and the speed-up plot shows it rather than clipping it at 1x."""
    import matplotlib.image
    import matplotlib.pyplot as plt

    from swiftkv.quickstart.report import _plot_prefill, _prefill_figure, in_words

    assert (in_words(1.25), in_words(0.8), in_words(0.8, "faster", "slower")) == (
        "1.25x lower", "1.25x higher", "1.25x slower",
    )  # fmt: skip
    rows = [{"prompt_tokens": n, "off_s": 0.1, "on_s": 0.1 / x, "speedup_x": x, "flops_bound_x": 1.4}
            for n, x in ((256, 0.8), (1024, 1.2))]  # fmt: skip
    assert matplotlib.image.imread(_plot_prefill(rows, tmp_path / "prefill.png")).shape[2] in (3, 4)
    speed_up = _prefill_figure(rows).axes[1]
    bottom, top = speed_up.get_ylim()
    assert bottom <= 0.8 < 1.2 <= top  # the 0.8x point inside the axis (it once started at 1x)
    assert [tuple(line.get_ydata()) for line in speed_up.lines][-1] == (1.0, 1.0)  # the 1x line drawn
    faster = [{**r, "speedup_x": 1.3, "on_s": 0.1 / 1.3} for r in rows]
    assert _prefill_figure(faster).axes[1].get_ylim()[0] == 1.0  # no slow-down: the axis starts at 1x
    plt.close("all")
