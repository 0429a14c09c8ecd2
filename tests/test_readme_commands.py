"""The README's command block against the real CLI: every command is listed, every flag
the README shows exists (in that command's `-h`), and every flag that exists is shown."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from zerod.cli import cli

README = Path(__file__).resolve().parent.parent / "README.md"
FLAG = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")


def readme_block() -> dict[str, set[str]]:
    """{command: flags shown} from the first code block under "## Commands";
    flags of the `zerod -h | zerod --version` line go under ""."""
    text = README.read_text()
    section = text[text.index("## Commands\n"):]
    block = section.split("```\n")[1]
    shown: dict[str, set[str]] = {}
    command = None
    for line in block.splitlines():
        if line.startswith("zerod "):
            words = line.split()[1:3] + [""]
            command = "" if words[0].startswith("-") else words[0]
            if re.fullmatch(r"[a-z]+", words[1]):      # a group's subcommand: `zerod config check`
                command += " " + words[1]
            shown.setdefault(command, set())
        assert command is not None, f"README command block: a line before any command: {line!r}"
        shown[command].update(FLAG.findall(line))
    return shown


def help_text(*args: str) -> str:
    r = CliRunner().invoke(cli, [*args, "-h"], prog_name="zerod")
    assert r.exit_code == 0, r.output
    assert r.output.startswith("Usage: zerod"), r.output
    return r.output


def help_flags(*args: str) -> list[set[str]]:
    """Each option of `zerod ARGS -h` as the set of its names (`--warmup, --num-warmups`)."""
    out = help_text(*args)
    options = out[out.index("Options:"):].split("\n\n")[0]
    groups = []
    for line in options.splitlines()[1:]:
        if line.lstrip().startswith("-"):
            names = re.split(r"\s{2,}", line.strip())[0]  # the help column starts after 2 spaces
            groups.append(set(FLAG.findall(names)))
    return groups


def listed_commands(*group: str) -> list[str]:
    """Every command, a group's subcommands as `group sub`."""
    out = help_text(*group)
    if "Commands:" not in out:
        return [" ".join(group)]
    commands = out[out.index("Commands:"):].splitlines()[1:]
    # "  name  help", help wrapping onto lines indented further
    names = [m.group(1) for m in map(re.compile(r"^  (\S+)").match, commands) if m]
    return [c for n in names for c in (listed_commands(*group, n) if not group else [f"{group[0]} {n}"])]


def test_every_command_is_in_the_readme_and_every_readme_command_exists():
    shown = set(readme_block()) - {""}
    assert set(listed_commands()) == shown


@pytest.mark.parametrize("command", listed_commands())
def test_readme_flags_match_the_commands_help(command):
    groups = help_flags(*command.split())
    existing = set().union(*groups)
    shown = readme_block()[command]
    assert shown <= existing, f"in the README but not in `zerod {command} -h`: {sorted(shown - existing)}"
    missing = [sorted(g) for g in groups if g and not g & (shown | {"-h", "--help"})]
    assert not missing, f"`zerod {command}` options missing from the README: {missing}"


def test_the_global_line_flags_exist():
    existing = set().union(*help_flags())
    assert readme_block()[""] <= existing


def test_dash_h_is_help_everywhere():
    assert "Commands:" in help_text()
    assert "--json" in help_text("doctor")
