"""An example that hangs under torchrun fails its test with every rank's Python stacks, instead
of hanging until pytest-timeout kills the test with nothing to read."""

from __future__ import annotations

import pytest

from tests.multirank import harness


def test_a_hung_example_fails_with_the_stacks_of_its_ranks(tmp_path, monkeypatch):
    example = tmp_path / "hangs.py"
    example.write_text(
        "import time\n"
        "def wait_for_the_other_rank():\n"
        "    time.sleep(600)\n"
        "wait_for_the_other_rank()\n"
    )
    # torchrun and two Python start-ups take ≈ 7 s on 2 idle cores: 8 s failed once, with rank
    # 0 not yet started, while other tests loaded the machine
    monkeypatch.setattr(harness, "EXAMPLE_TIMEOUT", 25.0)
    with pytest.raises(AssertionError, match="still ran after 25 s") as caught:
        harness.run_example_under_torchrun(example, [], tmp_path)
    # faulthandler's dump from each of the 2 ranks, each in its own section, names the function
    # they hang in
    ranks = str(caught.value).split("\n--- ")[1:-1]  # the last section is torchrun's output
    assert len(ranks) == 2, str(caught.value)
    assert all("in wait_for_the_other_rank" in r for r in ranks), str(caught.value)
