"""The error types of kvpersist.

Every error a user can cause derives from :class:`KvpError`; the CLI turns them into a
message and an exit code, never a traceback.
"""

from __future__ import annotations

from dataclasses import dataclass

EXIT_OK = 0
EXIT_PROBLEM = 1  # a check ran and found a problem
EXIT_USAGE = 2  # usage or configuration error


class KvpError(Exception):
    """Root of all kvpersist errors. ``exit_code`` is what the CLI exits with."""

    exit_code = EXIT_PROBLEM


@dataclass(frozen=True)
class Problem:
    """One configuration problem: where it is, what is wrong, and how to fix it."""

    where: str
    message: str
    fix: str = ""

    def __str__(self) -> str:
        text = f"At '{self.where}': {self.message}"
        return f"{text} ({self.fix})" if self.fix else text


class ConfigError(KvpError):
    """One or more configuration problems, all reported together."""

    exit_code = EXIT_USAGE

    def __init__(self, problems: list[Problem] | Problem, source: str = "") -> None:
        self.problems = [problems] if isinstance(problems, Problem) else list(problems)
        self.source = source
        head = f"{source}: " if source else ""
        lines = [f"{head}{len(self.problems)} configuration problem(s):"]
        lines += [f"  - {p}" for p in self.problems]
        super().__init__("\n".join(lines))


class UsageError(KvpError):
    """The command was called with arguments that cannot work."""

    exit_code = EXIT_USAGE


class CheckFailed(KvpError):
    """A check ran and found a problem (exit code 1)."""

    exit_code = EXIT_PROBLEM


class DemoFailed(KvpError):
    """A step of ``kvp-admin demo`` failed: which step, why (the underlying error on one
    line), and what the user should do (exit code 1)."""

    exit_code = EXIT_PROBLEM

    def __init__(self, step: str, cause: str, fix: str) -> None:
        self.step, self.cause, self.fix = step, cause, fix
        super().__init__(f"demo: {step} failed: {cause} ({fix})")
