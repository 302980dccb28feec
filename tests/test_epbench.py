"""CPU: the expert-parallel runs' launcher (moegen.epbench.launch): every rank a fresh interpreter
with its own log; a failing or late rank is named, with its log, and the others are stopped."""

from __future__ import annotations

import sys
import time

import pytest

from moegen.epbench import RankError, launch


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_every_rank_runs_to_the_end(tmp_path):
    cmds = [_py(f"import pathlib; pathlib.Path({str(tmp_path / f'out{r}')!r}).write_text('rank {r}')") for r in range(3)]
    launch(cmds, [tmp_path / f"rank{r}.log" for r in range(3)], timeout=60)
    assert [(tmp_path / f"out{r}").read_text() for r in range(3)] == ["rank 0", "rank 1", "rank 2"]


def test_a_failing_rank_is_named_with_its_log_and_the_others_stopped(tmp_path):
    cmds = [_py("import time; time.sleep(60)"), _py("import sys; print('rank one says boom'); sys.exit(3)")]
    t0 = time.monotonic()
    with pytest.raises(RankError, match=r"(?s)rank 1 of 2 exited with status 3.*rank one says boom"):
        launch(cmds, [tmp_path / "rank0.log", tmp_path / "rank1.log"], timeout=120)
    assert time.monotonic() - t0 < 30  # rank 0 was killed, not waited for


def test_a_rank_past_the_timeout_is_named(tmp_path):
    cmds = [_py("print('done')"), _py("print('waiting', flush=True); import time; time.sleep(60)")]
    with pytest.raises(RankError, match=r"(?s)ranks \[1\] of 2 still running after 2 s.*waiting"):
        launch(cmds, [tmp_path / "rank0.log", tmp_path / "rank1.log"], timeout=2)
