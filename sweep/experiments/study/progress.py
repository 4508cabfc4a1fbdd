"""The sweep's live display: trials done / running / pruned / failed and the current pick; a step bar."""

from __future__ import annotations

from collections.abc import Callable

from sweep.run.loop import progress_bar


class TrialProgress:
    """Two rows of the app's progress bar: the trials of this invocation, and the steps of the current one."""

    def __init__(self, console, enabled: bool, total: int, best: Callable[[], str], every: int = 50) -> None:
        self.best = best
        self.progress = progress_bar(enabled, console=console, every=every)
        self.trials = self.progress.add_task("trials", total=total, info="")
        self.steps = None
        self.done = self.pruned = self.failed = 0

    def __enter__(self):
        self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        return self.progress.__exit__(*exc)

    def _info(self, running: int) -> str:
        return (
            f"done {self.done} · running {running} · pruned {self.pruned} · failed {self.failed} · best {self.best()}"
        )

    def start_trial(self, n: int, dtype: str, max_norm: float, steps: int) -> None:
        label = f"trial {n} {dtype} τ={max_norm:.3g}"
        if self.steps is None:
            self.steps = self.progress.add_task(label, total=steps, info="")
        self.progress.reset(self.steps, total=steps, description=label, info="")
        self.progress.update(self.trials, info=self._info(1))

    def step(self, step: int) -> None:
        self.progress.update(self.steps, completed=step)

    def end_trial(self, n: int, state: str, info: str) -> None:
        self.done += 1
        self.pruned += state == "PRUNED"
        self.failed += state == "FAIL"
        self.progress.console.print(f"trial {n:>3} {state:<8} {info}")  # before the count it completes
        self.progress.update(self.trials, advance=1, info=self._info(0))
