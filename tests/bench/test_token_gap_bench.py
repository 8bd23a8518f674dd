"""The pure parts of benchmarks/quality/token_gap.py: tokens to dp's T per seed, and the table."""


import pytest

from benchmarks.quality import token_gap


def run(final, points):
    return {"final_loss": final, "curve": [{"seconds": 0, "tokens": t, "loss": loss} for t, loss in points]}


RESULTS = {
    "seeds": [0, 1],
    "variants": {"default": "", "slow": "--quorum 4"},
    "runs": {
        "dp@0": run(2.0, [(0, 5.0), (100, 2.1), (200, 2.0)]),
        "dp@1": run(2.0, [(0, 5.0), (100, 2.1), (200, 2.0)]),
        "default@0": run(2.05, [(0, 5.0), (100, 2.3), (200, 2.1), (300, 2.05)]),  # T = 2.1 first at 200
        "default@1": run(2.0, [(0, 5.0), (150, 2.1), (300, 2.0)]),
        "slow@0": run(2.5, [(0, 5.0), (300, 2.5)]),  # never reaches T
    },
}


def test_tokens_to_t_are_divided_by_dps_per_seed_and_missing_runs_are_skipped():
    rows = {r["variant"]: r for r in token_gap.ratio_rows(RESULTS, margin=0.05)}
    assert rows["default"]["tokens_ratio"] == pytest.approx([2.0, 1.5])  # dp reaches 2.1 at 100 tokens
    assert rows["default"]["final_minus_dp"] == pytest.approx([0.05, 0.0])
    assert rows["slow"]["tokens_ratio"] == [float("inf")] and len(rows["slow"]["final"]) == 1  # seed 1 not run


def test_wire_bytes_to_t_are_set_against_dps_ring_all_reduce_bytes_pro_rata():
    dp = {**run(2.0, [(0, 5.0), (100, 2.1), (200, 2.0)]), "wire_bytes": 8000, "tokens_trained": 200}
    variant = {"final_loss": 2.0, "curve": [{"seconds": 0, "tokens": 0, "loss": 5.0, "wire_bytes": None},
                                            {"seconds": 1, "tokens": 100, "loss": 2.3, "wire_bytes": 10},
                                            {"seconds": 2, "tokens": 200, "loss": 2.1, "wire_bytes": 30}]}
    results = {"seeds": [0], "variants": {"v": ""}, "runs": {"dp@0": dp, "v@0": variant}}
    (row,) = token_gap.ratio_rows(results, margin=0.05)
    assert row["fp32_dp_bytes_ratio"] == pytest.approx([4000 / 30])  # dp: 100 of its 200 tokens, half its bytes
    assert "| v | `(defaults)` | 2.00× | +0.0000 | 67× (133×) |" in token_gap.markdown(results, margin=0.05)


def test_a_variant_that_trained_past_its_budget_is_marked_as_no_equal_token_comparison():
    results = {**RESULTS, "tokens": 200}
    results["runs"] = {**RESULTS["runs"], "default@1": {**RESULTS["runs"]["default@1"], "tokens_trained": 400}}
    table = token_gap.markdown(results, margin=0.05)
    assert "| default | `(defaults)` **trained up to 2.00× the budget: not at equal tokens** |" in table
    assert "| slow | `--quorum 4` |" in table


def test_the_table_says_when_a_seed_never_reached_t():
    table = token_gap.markdown(RESULTS, margin=0.05)
    assert "| default | `(defaults)` | 1.75 (1.50–2.00)× |" in table
    assert "| slow | `--quorum 4` | not reached in 1 of 1 seeds |" in table
    assert token_gap.ratio_cell([1.2, float("inf"), 1.4]) == "not reached in 1 of 3 seeds; 1.20×, 1.40×"


def test_where_the_bytes_went_by_call_and_part():
    parts = {"push": {"payload:int4": 340, "framing": 60}, "downlink": {"payload:int8": 330, "framing": 70},
             "join": {"payload:fp32": 150, "framing": 10}, "heartbeat": {"framing": 40}}
    table = token_gap.parts_markdown({"runs": {"v@0": {"wire_bytes": 1000, "wire_parts": parts}, "dp@0": {}}})
    # scales (bf16): an int4 block is 2 + 32 bytes, an int8 block 2 + 64: 340 / 17 + 330 / 33 = 30 bytes
    assert "| v@0 | 0.00 | 40.0% | 40.0% | 16.0% | 4.0% | 18.0% | 3.0% |" in table
    assert "dp@0" not in table
