"""One error type for everything a user can act on; cli.py turns it into an exit code."""

from __future__ import annotations


class EdgetuneError(Exception):
    """A failure the user can act on. `exit_code` is what the CLI returns for it."""

    exit_code = 1


class InputError(EdgetuneError):
    """Bad input (recipe, profile, model file): exit code 2.

    Carries every problem found, each already located ("recipe.yaml:12: fleet[0].profile: ...").
    """

    exit_code = 2

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


class BuildError(EdgetuneError):
    """The pipeline ran but could not produce a correct artifact: exit code 1."""

    exit_code = 1
