"""What a user sees in a real terminal (a pseudo-terminal of a set width): the live line of
`submit --wait` and the log lines never share a line."""

from __future__ import annotations

import re

from tests.terminal import Terminal, launcher_argv, screen_lines

LOG_LINES = ("fake trainer for ", "metrics step=", "holding", "summary steps=")


def test_the_live_line_is_never_glued_to_a_log_line(home):
    # The stand-in trainer holds after its 3 steps, until `release` appears: the live line is
    # drawn by then (step 3), and the summary line is written while it is on the screen.
    argv = launcher_argv("submit", "recipes/tiny-cpu.yaml", "--wait", fake_trainer=True)
    terminal = Terminal(argv, columns=160, env={"LAUNCHER_HOME": str(home), "FAKE_TRAIN_HOLD": "1"})
    terminal.read_until(lambda written: "holding" in written)
    terminal.read_until(lambda written: "step 3/20" in written.split("holding", 1)[1])
    for job in (home / "jobs").iterdir():
        (job / "release").touch()
    assert terminal.finish() == 0, terminal.written

    screen = screen_lines(terminal.written, terminal.columns)
    logged = [line for line in screen if any(text in line for text in LOG_LINES)]
    assert [line for line in logged if not line.startswith(LOG_LINES)] == [], "\n".join(screen)
    assert sum(line.startswith("metrics step=") for line in logged) == 3 and logged[-1].startswith("summary steps=3")
    assert "step 3/20  loss 1.6667" not in "\n".join(screen)  # the live line is gone at the end
    # The stand-in trainer's speed against the host-CPU prediction of tiny-cpu's layout
    assert re.search(r"Completed\. loss 1\.667, tokens/s/GPU 1002, step 3; ran at \d+% of predicted$", screen[-1]), (
        screen[-1]
    )
