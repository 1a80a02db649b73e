"""``python -m serving``: every flag explained by ``--help``, a tiny ``generate``, bad input."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from serving.__main__ import build_parser, main

GENERATE_FLAGS = (
    "--prompt",
    "--max-tokens",
    "--temperature",
    "--top-p",
    "--top-k",
    "--min-p",
    "--seed",
    "--parallel",
    "--speculative",
    "--backend",
    "--stats",
)


def test_help_lists_the_subcommands_and_explains_every_generate_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert all(name in text for name in ("generate", "demo", "paged-demo"))
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = capsys.readouterr().out
    assert all(flag in text for flag in GENERATE_FLAGS)
    # argparse keeps its actions in ``_actions``: every option of every subcommand has a help.
    (commands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    for name, subparser in commands.choices.items():
        for action in subparser._actions:
            assert action.help, f"{name} {action.option_strings} has no help"


def test_generate_prints_the_continuations(capsys):
    status = main(
        [
            "generate",
            "--prompt",
            "def main(",
            "--prompt",
            "import os",
            "--max-tokens",
            "5",
            "--temperature",
            "0",
            "--parallel",
            "2",
            "--speculative",
            "2",
            "--backend",
            "reference",
            "--stats",
        ]
    )
    captured = capsys.readouterr()
    assert status == 0
    assert "--- prompt 1 ---" in captured.out and "--- prompt 2 ---" in captured.out
    assert "acceptance alpha" in captured.err


def test_generate_refuses_bad_values_with_their_names(capsys):
    assert main(["generate", "--prompt", "", "--max-tokens", "2"]) == 2
    assert "--prompt number 1 is empty" in capsys.readouterr().err
    assert main(["generate", "--prompt", "a", "--top-p", "0"]) == 2
    assert "top_p must be in (0, 1]" in capsys.readouterr().err


def test_module_entry_point_runs():
    result = subprocess.run(
        [sys.executable, "-m", "serving", "generate", "--help"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0 and "--speculative" in result.stdout
