"""The progress bar's fields: with run.time_budget_min the run ends on the budget, not at
run.steps (the bar's total), so the bar shows the budget's minutes left, counting what earlier
launches of the run spent."""

from megarl.metrics import MetricsWriter

RECORD = {"step": 3, "reward_mean": 0.25, "samples_per_s": 1.5}


def test_budget_left_counts_earlier_launches(tmp_path):
    writer = MetricsWriter(tmp_path, 200, 2, progress=False, time_budget_s=30 * 60.0, budget_spent_s=12 * 60.0)
    fields = writer.progress_fields(RECORD)
    writer.close()
    assert fields["reward_mean"] == "0.25" and fields["samples_per_s"] == "1.5"
    # 30 - 12 = 18 minutes left, less the microseconds since the writer started
    assert fields["budget_left"] in ("18.0min", "17.9min")


def test_no_budget_no_field(tmp_path):
    writer = MetricsWriter(tmp_path, 200, progress=False)
    fields = writer.progress_fields(RECORD)
    writer.close()
    assert "budget_left" not in fields


def test_spent_budget_shows_zero(tmp_path):
    writer = MetricsWriter(tmp_path, 200, progress=False, time_budget_s=60.0, budget_spent_s=90.0)
    assert writer.progress_fields(RECORD)["budget_left"] == "0.0min"
    writer.close()
