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


#: the longest text of one field of a Problem (longer quotes are cut, the cut counted)
MAX_PROBLEM_CHARS = 1000


@dataclass(frozen=True)
class Problem:
    """One configuration problem: where it is, what is wrong, and how to fix it."""

    where: str
    message: str
    fix: str = ""

    def __post_init__(self) -> None:
        # a problem quotes what it found: never a megabyte of it
        for name in ("where", "message", "fix"):
            value = getattr(self, name)
            if len(value) > MAX_PROBLEM_CHARS:
                cut = len(value) - MAX_PROBLEM_CHARS
                object.__setattr__(self, name, f"{value[:MAX_PROBLEM_CHARS]}… ({cut:,} more "
                                   "characters)")

    def __str__(self) -> str:
        text = f"At '{self.where}': {self.message}"
        return f"{text} ({self.fix})" if self.fix else text


#: at most this many problems are listed by one error; the others are counted
MAX_PROBLEMS = 20


class Problems:
    """A bounded collector of problems: keeps the first ``limit`` (in the order found) and
    counts the others, so a file of a million bad lines costs memory and output for
    ``limit`` of them. ``len()`` is the number found."""

    def __init__(self, limit: int = MAX_PROBLEMS) -> None:
        self.limit = limit
        self.kept: list[Problem] = []
        self.more = 0

    def add(self, problem: Problem) -> None:
        if len(self.kept) < self.limit:
            self.kept.append(problem)
        else:
            self.more += 1

    def __len__(self) -> int:
        return len(self.kept) + self.more

    def __bool__(self) -> bool:
        return bool(self.kept)

    def listed(self, source: str = "") -> list[Problem]:
        """The kept problems, then one that counts the others (if any)."""
        if not self.more:
            return list(self.kept)
        return [*self.kept, Problem(source or "(more)", f"and {self.more:,} more "
                                    "problem(s) of the same input, not listed",
                                    "fix the ones above, then check again")]


class ConfigError(KvpError):
    """One or more configuration problems, all reported together (at most
    :data:`MAX_PROBLEMS` listed, the others counted)."""

    exit_code = EXIT_USAGE

    def __init__(self, problems: list[Problem] | Problem | Problems,
                 source: str = "") -> None:
        if isinstance(problems, Problems):
            listed = problems.listed(source)
        else:
            listed = [problems] if isinstance(problems, Problem) else list(problems)
            if len(listed) > MAX_PROBLEMS + 1:
                bounded = Problems()
                for p in listed:
                    bounded.add(p)
                listed = bounded.listed(source)
        self.problems = listed
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
