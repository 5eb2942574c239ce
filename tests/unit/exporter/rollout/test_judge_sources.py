"""The reason a task judge gives for its default disagreement limit names the figures of the
model's own task (issue 45 item 5: a text model's verdict quoted what digits retrains change).
Real exports of the small torch models of test_judge through onnxruntime."""

from __future__ import annotations

from exporter.rollout.judge import judge_offline
from tests.unit.exporter.rollout.test_judge import Flip, _repo
from tritonguard.rollout.judging import SOURCES


def test_each_task_names_its_own_default(tmp_path):
    repo, _ = _repo(tmp_path, Flip(0.94))
    # promote passes what judge_limits resolved: the generic default's text when nobody set one
    for given in ("", SOURCES["max_disagreement"]):
        text = judge_offline(repo, "tiny_raw", 1, 2, judge="task", task="embedding", output="P",
                             limit_source=given)
        assert "all-MiniLM-L6-v2 fine-tune" in text.limit_source and "digits" not in text.limit_source
        assert "digits" not in text.summary(), text.summary()
        digits = judge_offline(repo, "tiny_raw", 1, 2, judge="task", task="classifier", output="P",
                               limit_source=given)
        assert "genuine digits retrains" in digits.limit_source
    # a limit the operator set is named as set, whatever the task
    flag = judge_offline(repo, "tiny_raw", 1, 2, judge="task", task="embedding", output="P",
                         max_disagreement=0.15, limit_source="--max-disagreement")
    assert flag.limit_source == "--max-disagreement"
