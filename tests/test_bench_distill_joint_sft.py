"""benchmarks/distill_joint_sft.py: the control refuses a work folder without the recipe's checkpoints, naming
the one missing, before it trains anything."""

import distill_joint_sft  # benchmarks/ (pyproject's pytest pythonpath)
import pytest


def test_a_work_folder_without_the_recipe_is_refused_by_name(tmp_path):
    with pytest.raises(SystemExit, match="no checkpoint at .*cold"):
        distill_joint_sft.main(["--work", str(tmp_path), "--out", str(tmp_path / "x.json")])
    (tmp_path / "cold").mkdir()
    (tmp_path / "cold" / "config.json").write_text("{}")
    with pytest.raises(SystemExit, match="teacher-files-low"):
        distill_joint_sft.main(["--work", str(tmp_path), "--out", str(tmp_path / "x.json")])
    assert not (tmp_path / "joint-sft").exists() and not (tmp_path / "x.json").exists()
