"""A request's timeline: episodes written when their request finishes, and the ones still open when the tier
stops (vLLM tells a tier a request finished only at its next step)."""

from __future__ import annotations

from pathlib import Path

from kvstore.engine.timeline import FINISHED, IDLE_WAIT, LOOKUP, STEP, Timeline, read_timelines


def test_finished_and_open_episodes_are_written(tmp_path: Path) -> None:
    path = tmp_path / "timeline.jsonl"
    timeline = Timeline(path)
    timeline.begin("a")
    timeline.mark(STEP)
    timeline.mark(IDLE_WAIT)
    timeline.end("a")
    timeline.begin("b")
    timeline.mark(STEP)
    timeline.mark(STEP)
    assert [e.request for e in read_timelines(path)] == ["a"]

    timeline.close()
    a, b = read_timelines(path)
    assert (a.request, b.request) == ("a", "b")
    assert FINISHED in a.milestones and FINISHED not in b.milestones
    assert a.milestones[IDLE_WAIT].count == 1 and b.milestones[STEP].count == 2
    assert b.milestones[LOOKUP].count == 1
    timeline.close()  # nothing open: nothing more written
    timeline.mark(STEP)  # no episode open: nothing to mark
    assert len(read_timelines(path)) == 2
